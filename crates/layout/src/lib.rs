//! KV-cache pool geometry, SGLang-exact page segments and transfer plans.
#![forbid(unsafe_code)]
