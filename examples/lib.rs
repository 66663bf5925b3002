//! Support code shared by the runnable examples (the examples are the `[[example]]` targets).
