//! The `pagewire._native` extension module: Python bindings over `pagewire-layout` and
//! `pagewire-transport`.
//!
//! Python code imports the `pagewire` package, not this module directly:
//!
//! ```python
//! import pagewire
//! print(pagewire.__version__)
//! ```
//!
//! The Rust side only converts arguments, releases the GIL around anything that waits or
//! moves data, and maps Rust errors to the exception classes of `pagewire.errors`; the
//! decisions stay in the crates it wraps.

use pyo3::prelude::*;

mod convert;
mod dummy;
mod errors;
mod ffi;
mod layout;
mod store;
mod transport;
// Transport bindings' helpers and the Mooncake-compatible engine.
mod compat;
mod transport_errors;

/// The extension module. Each submodule of this crate adds its classes and functions here.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    convert::register(m)?;
    layout::register(m)?;
    transport::register(m)?;
    compat::register(m)?;
    store::register(m)?;
    dummy::register(m)?;
    Ok(())
}
