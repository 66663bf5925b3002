//! Support code shared by the runnable examples (the examples are the `[[example]]` targets).

pub mod staged_bench;
