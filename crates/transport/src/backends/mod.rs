//! The data paths. Each backend module executes what the engine and the core decided and
//! reports through the contract (`crate::contract`); none imports the engine or another
//! backend.
//!
//! Each backend module provides an `open` function:
//! - `verbs::open(config: &EngineConfig) -> Result<Arc<dyn Backend>, Error>` (feature `verbs`)
//! - `tcp::open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>, Error>`
//! - `loopback::open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>, Error>`

use std::sync::Arc;

use crate::config::EngineConfig;
use crate::contract::{Backend, BackendInit};
use crate::error::{Error, Result};
use crate::types::BackendKind;

pub(crate) mod loopback;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

/// Opens the configured backend; returns it with the reason for the choice.
pub(crate) fn open(
    config: &EngineConfig,
    init: &BackendInit,
) -> Result<(Arc<dyn Backend>, String)> {
    match config.backend {
        BackendKind::Tcp => Ok((tcp::open(config, init)?, "forced by config".into())),
        BackendKind::Loopback => Ok((loopback::open(config, init)?, "forced by config".into())),
        BackendKind::Verbs => open_verbs(config).map(|b| (b, "forced by config".into())),
        BackendKind::Auto => match open_verbs(config) {
            Ok(b) => {
                let dev = b.info().device;
                Ok((b, format!("auto: RDMA device {dev} is usable")))
            }
            Err(e) => Ok((
                tcp::open(config, init)?,
                format!("auto: no usable RDMA device ({e}), using TCP"),
            )),
        },
        #[allow(unreachable_patterns)]
        other => Err(Error::Unsupported {
            what: format!("backend {other}"),
        }),
    }
}

#[cfg(feature = "verbs")]
fn open_verbs(config: &EngineConfig) -> Result<Arc<dyn Backend>> {
    verbs::open(config)
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(_config: &EngineConfig) -> Result<Arc<dyn Backend>> {
    Err(Error::BackendUnavailable {
        backend: BackendKind::Verbs,
        reason: "built without the `verbs` feature".into(),
    })
}
