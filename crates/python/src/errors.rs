//! The exception hierarchy shared by every part of the module. `PagewireError` is the base
//! of all of them; each binding module adds its own subclasses next to its code.

use pyo3::create_exception;
use pyo3::prelude::*;

create_exception!(
    pagewire,
    PagewireError,
    pyo3::exceptions::PyException,
    "Base class of every error raised by pagewire."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PagewireError", m.py().get_type::<PagewireError>())?;
    Ok(())
}
