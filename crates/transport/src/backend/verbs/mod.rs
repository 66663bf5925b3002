//! Verbs backend: PLACEHOLDER written by the engine core so the crate builds; the verbs
//! engineer owns this directory and replaces this file. Contract: docs/architecture.md and
//! `crate::backend` (this module must provide `open`).
use std::sync::Arc;

use super::Backend;
use crate::config::{BackendKind, EngineConfig};
use crate::error::{Error, Result};

pub(crate) fn open(_config: &EngineConfig) -> Result<Arc<dyn Backend>> {
    Err(Error::BackendUnavailable {
        backend: BackendKind::Verbs,
        reason: "verbs backend not implemented yet".into(),
    })
}
