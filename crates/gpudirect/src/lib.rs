//! GPU KV pages over pagewire transports.
