//! Bindings of `pagewire-layout`: pool geometry, page segments and transfer plans.

use pyo3::prelude::*;

pub(crate) fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
