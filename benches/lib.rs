//! Shared helpers for the criterion benches (the benches are the `[[bench]]` targets).
