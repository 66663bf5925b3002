//! Zero-copy one-sided page transfers.
