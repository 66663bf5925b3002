//! Bindings of `pagewire-transport`: engines, registrations, peers and batches.

use pyo3::prelude::*;

pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
