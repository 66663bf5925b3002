//! Bindings of the store's dummy clients (`pagewire-store`'s `standalone` module):
//! `pagewire._native.DummyClient`, which works through a standalone client
//! (`pagewire store client`) of this host, and the shared memory it hands over
//! (`shm_alloc` / `shm_free`, behind Mooncake's `MooncakeHostMemAllocator`).
//!
//! `DummyClient` has the methods of `StoreClient` that `MooncakeDistributedStore` calls,
//! with the same arguments and codes, so the Mooncake class drives either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use pagewire_store::{DummyConfig, IpcAddr, SharedBuf, StoreError as SErr};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::store::{codes, keys_of, parts_of, per_key, put_options, secs, store_err};

/// Shared buffers handed to Python by address (they live until `shm_free`).
fn handed_out() -> &'static Mutex<HashMap<u64, SharedBuf>> {
    static M: OnceLock<Mutex<HashMap<u64, SharedBuf>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

/// ``shm_alloc(size) -> int``: the address of ``size`` bytes of zeroed shared memory (a
/// sealed memfd mapped in this process), which a :class:`DummyClient` can register and
/// its standalone client then reads and writes directly. Raises :class:`StoreError` when
/// the memory cannot be had.
#[pyfunction]
fn shm_alloc(py: Python<'_>, size: u64) -> PyResult<u64> {
    let len = usize::try_from(size)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            store_err(
                py,
                SErr::InvalidArgument {
                    what: format!("size {size}"),
                },
            )
        })?;
    let b = py
        .detach(|| SharedBuf::new(len))
        .map_err(|e| store_err(py, e))?;
    let addr = b.addr();
    handed_out()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(addr, b);
    Ok(addr)
}

/// ``shm_free(addr) -> bool``: releases memory from :func:`shm_alloc` (a dummy client
/// that registered it keeps its mapping until it unregisters it); False if unknown.
#[pyfunction]
fn shm_free(addr: u64) -> bool {
    handed_out()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&addr)
        .is_some()
}

/// A store client without segment or engine, working through the standalone client
/// (``pagewire store client``) at ``address`` on this host.
///
/// ``DummyClient(address, *, token=None, timeout=40.0)``: ``address`` is Mooncake's
/// ``server_address`` (``host:port``), ``@abstract-name`` or ``unix:/path``; the token is
/// ``token``, else ``PAGEWIRE_TOKEN``. Buffers must come from :func:`shm_alloc`.
#[pyclass(frozen, module = "pagewire._native", name = "DummyClient")]
pub(crate) struct DummyClient {
    inner: pagewire_store::DummyClient,
    closed: AtomicBool,
}

impl DummyClient {
    fn client(&self) -> PyResult<pagewire_store::DummyClient> {
        if self.closed.load(Ordering::Acquire) {
            return Err(PyRuntimeError::new_err("the dummy client is closed"));
        }
        Ok(self.inner.clone())
    }
}

#[pymethods]
impl DummyClient {
    #[new]
    #[pyo3(signature = (address, *, token = None, timeout = 40.0))]
    fn new(py: Python<'_>, address: &str, token: Option<String>, timeout: f64) -> PyResult<Self> {
        let addr: IpcAddr = address.parse().map_err(|e| store_err(py, e))?;
        let mut cfg = DummyConfig::new(addr);
        cfg.token = token.or_else(|| std::env::var("PAGEWIRE_TOKEN").ok());
        cfg.timeout = secs(timeout, "timeout")?;
        let inner = py
            .detach(move || pagewire_store::DummyClient::connect(cfg))
            .map_err(|e| store_err(py, e))?;
        Ok(DummyClient {
            inner,
            closed: AtomicBool::new(false),
        })
    }

    /// ``""``: a dummy has no transport endpoint of its own (as Mooncake's).
    #[getter]
    fn endpoint(&self) -> String {
        String::new()
    }

    /// The standalone client's transport endpoint.
    fn real_endpoint(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.client()?;
        py.detach(move || c.real_endpoint())
            .map_err(|e| store_err(py, e))
    }

    /// Registers the :func:`shm_alloc` buffer that holds ``[ptr, ptr+size)`` (the
    /// standalone client maps it once); other memory raises :class:`StoreError` (-600).
    fn register_buffer(&self, py: Python<'_>, ptr: u64, size: u64) -> PyResult<()> {
        let c = self.client()?;
        py.detach(move || c.register_buffer(ptr, size))
            .map_err(|e| store_err(py, e))
    }

    /// Unregisters the buffer that holds ``ptr``.
    fn unregister_buffer(&self, py: Python<'_>, ptr: u64) -> PyResult<()> {
        let c = self.client()?;
        py.detach(move || c.unregister_buffer(ptr))
            .map_err(|e| store_err(py, e))
    }

    /// As :meth:`StoreClient.put`, from registered shared memory.
    #[pyo3(signature = (keys, ptrs, sizes, *, replicas = 1, pin = "none", preferred = None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        replicas: u8,
        pin: &str,
        preferred: Option<String>,
    ) -> PyResult<Vec<i64>> {
        let c = self.client()?;
        let keys = keys_of(keys)?;
        let parts = parts_of(ptrs, sizes)?;
        let opts = put_options(replicas, pin, preferred)?;
        let r = py
            .detach(move || c.put(&keys, &parts, &opts))
            .map_err(|e| store_err(py, e))?;
        Ok(codes(r))
    }

    /// As :meth:`StoreClient.get`, into registered shared memory.
    fn get(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let c = self.client()?;
        let keys = keys_of(keys)?;
        let parts = parts_of(ptrs, sizes)?;
        let r = py
            .detach(move || c.get(&keys, &parts))
            .map_err(|e| store_err(py, e))?;
        Ok(per_key(r, |n| n as i64))
    }

    /// Per key ``1``, ``0`` or a negative code.
    fn exist(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let c = self.client()?;
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.exist(&keys))
            .map_err(|e| store_err(py, e))?;
        Ok(per_key(r, |b| b as i64))
    }

    /// Per key ``(size, [])`` (replicas are the standalone client's business) or a
    /// negative code.
    #[pyo3(signature = (keys, *, lease = false))]
    fn query(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, lease: bool) -> PyResult<Py<PyList>> {
        let _ = lease;
        let c = self.client()?;
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.size(&keys))
            .map_err(|e| store_err(py, e))?;
        let out = PyList::empty(py);
        for item in r {
            match item {
                Ok(n) => out.append((n, PyList::empty(py)))?,
                Err(c) => out.append(c.as_i32())?,
            }
        }
        Ok(out.unbind())
    }

    /// Per key ``0`` or a negative code.
    #[pyo3(signature = (keys, force = false))]
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, force: bool) -> PyResult<Vec<i64>> {
        let c = self.client()?;
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.remove(&keys, force))
            .map_err(|e| store_err(py, e))?;
        Ok(r.into_iter().map(|c| c.as_i32() as i64).collect())
    }

    /// How many objects were removed.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        let c = self.client()?;
        py.detach(move || c.remove_all(force))
            .map_err(|e| store_err(py, e))
    }

    /// How many complete objects whose key matches `pattern` were removed.
    #[pyo3(signature = (pattern, force = false))]
    fn remove_matching(&self, py: Python<'_>, pattern: String, force: bool) -> PyResult<u64> {
        let c = self.client()?;
        py.detach(move || c.remove_matching(&pattern, force))
            .map_err(|e| store_err(py, e))
    }

    /// Whether the standalone client and its master answer.
    #[pyo3(signature = (timeout = 2.0))]
    fn ping(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let _ = secs(timeout, "timeout")?;
        let c = self.client()?;
        Ok(py.detach(move || c.ping()).is_ok())
    }

    /// Leaves the standalone client (which unmaps this dummy's buffers). Idempotent.
    fn close(&self, py: Python<'_>) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            let c = self.inner.clone();
            py.detach(move || c.close());
        }
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DummyClient>()?;
    m.add_function(wrap_pyfunction!(shm_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(shm_free, m)?)?;
    Ok(())
}
