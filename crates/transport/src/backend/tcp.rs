//! TCP backend (placeholder until implemented).
use std::sync::Arc;

use super::{Backend, BackendInit};
use crate::config::{BackendKind, EngineConfig};
use crate::error::{Error, Result};

pub(crate) fn open(_config: &EngineConfig, _init: &BackendInit) -> Result<Arc<dyn Backend>> {
    Err(Error::BackendUnavailable {
        backend: BackendKind::Tcp,
        reason: "not implemented yet".into(),
    })
}
