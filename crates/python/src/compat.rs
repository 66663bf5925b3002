//! The Rust half of `pagewire.mooncake_compat.TransferEngine`: Mooncake's Python
//! `TransferEngine` surface (names, argument names, defaults, positional-only
//! arguments, return values) over `pagewire_mooncake::TransferEngine`, which holds
//! every rule (segments, registrations, range checks, batch ids, notifications, the
//! deadlines).
//!
//! This module only converts arguments (a wrong type is a `TypeError`, as pybind11
//! raises), releases the GIL around every call (the hot path, `batch_transfer_sync_write`
//! and friends, is Rust from the argument conversion to the return code), logs failures
//! through Python's `logging` (logger `pagewire.mooncake_compat`), and spells results as
//! Mooncake's binding does: 0 / -1, -3 / -4 / -7 from registrations, 0 as the failed
//! batch id, 1 / 0 / -1 / -2 from `transfer_check_status`. Before `initialize` every
//! method returns its failure value (Mooncake crashes).

use std::sync::{Arc, RwLock};
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use pagewire_mooncake::{
    BatchCheck, Code, DEFAULT_HANDSHAKE_TIMEOUT, Error, MAX_NOTIFY_BYTES, Opcode, Options,
    Transfer, TransferEngine,
};

use crate::convert::u64_vec;
use crate::transport::no_panic;

/// How long `unregister_memory` (and `close`, in all) waits for transfers that still use
/// a buffer.
const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

// ------------------------------------------------------------------------ logging

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Logs through Python's `logging` (logger `pagewire.mooncake_compat`).
fn log(py: Python<'_>, level: &str, msg: &str) {
    let logger = LOGGER.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py
            .import("logging")?
            .call_method1("getLogger", ("pagewire.mooncake_compat",))?
            .unbind())
    });
    if let Ok(l) = logger {
        let _ = l.bind(py).call_method1(level, (msg,));
    }
}

// ------------------------------------------------------------------------ arguments

/// One address or length; `TypeError` as pybind11 (a bool counts as 0 or 1).
fn addr(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return obj
            .extract::<bool>()
            .map(u64::from)
            .map_err(|e| PyTypeError::new_err(e.to_string()));
    }
    obj.extract::<u64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be an int in [0, 2**64), got {}",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}

/// A list (tuple, array...) of addresses; `TypeError` as pybind11.
fn addrs(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    u64_vec(obj, what).map_err(|e| PyTypeError::new_err(e.value(obj.py()).to_string()))
}

/// The ranges of a transfer call: one (no allocation) or three lists.
enum Ranges {
    One([u64; 3]),
    Lists(Vec<u64>, Vec<u64>, Vec<u64>),
}

impl Ranges {
    /// `buffer, peer_buffer_address, length`.
    fn one(b: &Bound<'_, PyAny>, p: &Bound<'_, PyAny>, l: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Ranges::One([
            addr(b, "buffer")?,
            addr(p, "peer_buffer_address")?,
            addr(l, "length")?,
        ]))
    }

    /// `buffers, peer_buffer_addresses, lengths`.
    fn lists(b: &Bound<'_, PyAny>, p: &Bound<'_, PyAny>, l: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Ranges::Lists(
            addrs(b, "buffers")?,
            addrs(p, "peer_buffer_addresses")?,
            addrs(l, "lengths")?,
        ))
    }

    /// The call to `session` with these ranges.
    fn transfer<'a>(&'a self, session: &'a str, opcode: Opcode) -> Transfer<'a> {
        let (locals, remotes, lens) = match self {
            Ranges::One([b, p, l]) => (
                std::slice::from_ref(b),
                std::slice::from_ref(p),
                std::slice::from_ref(l),
            ),
            Ranges::Lists(b, p, l) => (b.as_slice(), p.as_slice(), l.as_slice()),
        };
        Transfer {
            session,
            opcode,
            locals,
            remotes,
            lens,
        }
    }
}

/// `TransferOpcode.Read` / `.Write` (or 0 / 1); `TypeError` otherwise.
fn opcode(obj: &Bound<'_, PyAny>) -> PyResult<Opcode> {
    let bad = || "opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1)";
    let v: i64 = obj
        .call_method0("__int__")
        .and_then(|v| v.extract())
        .map_err(|_| PyTypeError::new_err(bad()))?;
    Opcode::try_from(v).map_err(|_| PyTypeError::new_err(format!("{}, got {v}", bad())))
}

/// `(name, msg)` bytes of a `TransferNotify`-like object (str or bytes fields); `None`
/// stays `None`. Longer than a notification can be: `ValueError`.
fn notification(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<(Vec<u8>, Vec<u8>)>> {
    let Some(obj) = obj.filter(|n| !n.is_none()) else {
        return Ok(None);
    };
    let field = |f: &str| -> PyResult<Vec<u8>> {
        let v = obj.getattr(f).map_err(|_| {
            PyTypeError::new_err(format!(
                "notify must have .name and .msg (TransferNotify), missing .{f}"
            ))
        })?;
        if let Ok(s) = v.extract::<String>() {
            return Ok(s.into_bytes());
        }
        v.extract::<Vec<u8>>()
            .map_err(|_| PyTypeError::new_err(format!("notify.{f} must be str or bytes")))
    };
    let (n, m) = (field("name")?, field("msg")?);
    if n.len() + m.len() > MAX_NOTIFY_BYTES {
        return Err(PyValueError::new_err(format!(
            "notification of {} bytes exceeds the {MAX_NOTIFY_BYTES}-byte limit",
            n.len() + m.len()
        )));
    }
    Ok(Some((n, m)))
}

/// `location` names device memory, which this build does not register.
fn device_location(location: &str) -> bool {
    ["cuda", "npu", "musa"]
        .iter()
        .any(|d| location.starts_with(d))
}

// ------------------------------------------------------------------------ return values

/// A failed call's value, from Mooncake's code (`None`: before `initialize`, or a bug).
type OnFail<T> = fn(Option<Code>) -> T;

/// Most methods: -1.
fn minus_one(_: Option<Code>) -> i32 {
    -1
}

/// Batch-id methods and `get_first_buffer_address`: 0.
fn zero(_: Option<Code>) -> u64 {
    0
}

/// Registrations: -7 for an overlap, -1 otherwise.
fn register_rc(c: Option<Code>) -> i32 {
    match c {
        Some(Code::AddressOverlapped) => Code::AddressOverlapped.err(),
        _ => -1,
    }
}

/// Unregistrations: -3 for an address no buffer starts at, -4 when it stays in use.
fn unregister_rc(c: Option<Code>) -> i32 {
    match c {
        None => -1,
        Some(Code::AddressNotRegistered) => Code::AddressNotRegistered.err(),
        Some(_) => Code::BatchBusy.err(),
    }
}

/// `send_probe`: -102 (-101 name not resolved, -200 malformed id).
fn probe_rc(c: Option<Code>) -> i32 {
    c.map_or(-1, Code::err)
}

// ------------------------------------------------------------------------ the class

/// The compat engine as a Python class (`pagewire.mooncake_compat.TransferEngine`
/// derives from its subclass `_MooncakeTransfers` and adds the methods written in
/// Python).
#[pyclass(
    module = "pagewire._native",
    name = "_MooncakeEngine",
    subclass,
    frozen
)]
pub(crate) struct MooncakeEngine {
    timeout: Duration,
    inner: RwLock<Option<Arc<TransferEngine>>>,
}

impl MooncakeEngine {
    fn get(&self) -> Option<Arc<TransferEngine>> {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The transport engine under this Mooncake engine, once initialized: what a store
    /// set up with `engine=` shares (SGLang's `SGLANG_HICACHE_MOONCAKE_REUSE_TE`).
    pub(crate) fn transport_engine(&self) -> Option<pagewire_transport::Engine> {
        self.get().map(|e| e.transport().clone())
    }

    /// Runs `f` on the initialized engine with the GIL released. Before `initialize`,
    /// on a failure (logged) or a panic, returns `on_fail` of the case.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        on_fail: OnFail<T>,
        f: impl FnOnce(&TransferEngine) -> Result<T, Error> + Send,
    ) -> T {
        let Some(e) = self.get() else {
            log(py, "error", &format!("{what}: called before initialize"));
            return on_fail(None);
        };
        match py.detach(|| no_panic(|| f(&e))) {
            Ok(Ok(v)) => v,
            Ok(Err(err)) => {
                log(py, "error", &format!("{what}: {err}"));
                on_fail(Some(err.code()))
            }
            Err(p) => {
                log(
                    py,
                    "error",
                    &format!("{what}: internal error (a bug in pagewire): {p}"),
                );
                on_fail(None)
            }
        }
    }
}

#[pymethods]
impl MooncakeEngine {
    #[new]
    fn new() -> Self {
        MooncakeEngine {
            timeout: pagewire_mooncake::env::transfer_timeout(),
            inner: RwLock::new(None),
        }
    }

    /// Starts the engine. ``metadata_server``: ``"P2PHANDSHAKE"`` (the session id is
    /// ``host:port``) or ``"etcd://h:p[;h:p]"`` (the session id is ``local_hostname``,
    /// published in etcd while the engine lives).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, /))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        if let Some(e) = self.get() {
            let msg = format!("initialize: already initialized as {}; ignored", e.name());
            log(py, "warning", &msg);
            return 0;
        }
        let opts = Options {
            protocol: Some(protocol.to_owned()),
            device: Some(device_name.to_owned()),
            listen: None,
            handshake_timeout: Some(DEFAULT_HANDSHAKE_TIMEOUT),
            transfer_timeout: self.timeout,
            unregister_wait: UNREGISTER_WAIT,
            // Host memory only: GPU memory is not wired into the Python package yet.
            host_memory_only: true,
        };
        let made = py
            .detach(|| no_panic(|| pagewire_ha::new_engine(metadata_server, local_hostname, opts)));
        let e = match made {
            Ok(Ok(e)) => Arc::new(e),
            Ok(Err(err)) => {
                log(py, "error", &format!("initialize: {err}"));
                return -1;
            }
            Err(p) => {
                let msg = format!("initialize: internal error (a bug in pagewire): {p}");
                log(py, "error", &msg);
                return -1;
            }
        };
        let mut w = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if w.is_some() {
            // Another thread won the race: keep its engine.
            drop(w);
            py.detach(|| e.close());
            return 0;
        }
        for n in e.notes() {
            let level = if n.warning { "warning" } else { "info" };
            log(py, level, &format!("{}: {}", e.name(), n.text));
        }
        *w = Some(e);
        0
    }

    /// ``initialize`` with the metadata type spelled out: an address without a scheme
    /// gets ``metadata_type://`` in front (``"etcd"``, ``"127.0.0.1:2379"``); one with a
    /// scheme, and ``"P2PHANDSHAKE"``, are used as they are.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type, /))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i32 {
        let meta = if metadata_server == "P2PHANDSHAKE"
            || metadata_server.contains("://")
            || metadata_type.is_empty()
        {
            metadata_server.to_owned()
        } else {
            format!("{metadata_type}://{metadata_server}")
        };
        self.initialize(py, local_hostname, &meta, protocol, device_name)
    }

    /// The handshake (RPC) port; in P2P mode the session id is ``f"{host}:{port}"``.
    fn get_rpc_port(&self, py: Python<'_>) -> i32 {
        match self.get() {
            Some(e) => i32::from(e.rpc_port()),
            None => {
                log(py, "error", "get_rpc_port: called before initialize");
                -1
            }
        }
    }

    /// This engine's session id (``None`` before initialize): ``"host:port"``, or
    /// ``local_hostname`` with an etcd metadata server.
    #[getter]
    fn session_id(&self) -> Option<String> {
        self.get().map(|e| e.name().to_owned())
    }

    /// The sync-transfer timeout from ``MC_TRANSFER_TIMEOUT``, in seconds (before the
    /// 1 ns per byte Mooncake adds).
    #[getter]
    fn _transfer_timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// The data path in use: ``"verbs"``, ``"tcp"``, ``"loopback"`` (``None`` before
    /// initialize).
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.get().map(|e| e.backend_kind().as_str())
    }

    #[pyo3(signature = (buffer_addr, capacity, location="*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        capacity: &Bound<'_, PyAny>,
        location: &str,
    ) -> PyResult<i32> {
        let buffer = [(
            addr(buffer_addr, "buffer_addr")?,
            addr(capacity, "capacity")?,
        )];
        Ok(self.register_all(py, "register_memory", &buffer, location))
    }

    #[pyo3(signature = (buffer_addr, /))]
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: &Bound<'_, PyAny>) -> PyResult<i32> {
        let a = addr(buffer_addr, "buffer_addr")?;
        Ok(self.call(py, "unregister_memory", unregister_rc, |e| {
            e.unregister(a).map(|()| 0)
        }))
    }

    #[pyo3(signature = (buffer_addresses, capacities, location="*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
        location: &str,
    ) -> PyResult<i32> {
        let a = addrs(buffer_addresses, "buffer_addresses")?;
        let n = addrs(capacities, "capacities")?;
        if a.len() != n.len() {
            let msg = format!("{} addresses but {} capacities", a.len(), n.len());
            log(py, "error", &format!("batch_register_memory: {msg}"));
            return Ok(-1);
        }
        let buffers: Vec<(u64, u64)> = a.into_iter().zip(n).collect();
        Ok(self.register_all(py, "batch_register_memory", &buffers, location))
    }

    #[pyo3(signature = (buffer_addresses, /))]
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let a = addrs(buffer_addresses, "buffer_addresses")?;
        Ok(
            self.call(py, "batch_unregister_memory", unregister_rc, |e| {
                e.unregister_batch(&a).map(|()| 0)
            }),
        )
    }

    #[pyo3(signature = (batch_id, /))]
    fn transfer_check_status(&self, py: Python<'_>, batch_id: &Bound<'_, PyAny>) -> PyResult<i32> {
        let id = addr(batch_id, "batch_id")?;
        Ok(self.call(py, "transfer_check_status", minus_one, |e| {
            Ok(match e.check_batch(id) {
                BatchCheck::Completed => 1,
                BatchCheck::Running => 0,
                BatchCheck::Failed => -1,
                BatchCheck::Timeout => -2,
            })
        }))
    }

    #[pyo3(signature = (batch_ids, /))]
    fn get_batch_transfer_status(
        &self,
        py: Python<'_>,
        batch_ids: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let ids = addrs(batch_ids, "batch_ids")?;
        Ok(self.call(py, "get_batch_transfer_status", minus_one, |e| {
            e.wait_batches(&ids).map(|()| 0)
        }))
    }

    /// Drains the received notifications (each returned once), as ``(name, msg)`` pairs;
    /// the Python class wraps them in ``TransferNotify``.
    fn _get_notifies(&self) -> Vec<(String, String)> {
        let lossy = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
        self.get()
            .map(|e| e.take_notifications())
            .unwrap_or_default()
            .into_iter()
            .map(|(n, m)| (lossy(n), lossy(m)))
            .collect()
    }

    #[pyo3(signature = (peer_server_name))]
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i32 {
        self.call(py, "send_probe", probe_rc, |e| {
            e.send_probe(peer_server_name).map(|()| 0)
        })
    }

    #[pyo3(signature = (segment_name, /))]
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        self.call(py, "get_first_buffer_address", zero, |e| {
            e.first_buffer_address(segment_name)
        })
    }

    /// ``id``-like integer naming the underlying engine (0 before initialize).
    fn get_engine_ptr(&self) -> u64 {
        self.get().map_or(0, |e| Arc::as_ptr(&e) as u64)
    }

    /// JSON: the devices pagewire sees and the backend in use.
    #[pyo3(signature = (device_name=None))]
    fn get_local_topology(&self, device_name: Option<&str>) -> String {
        local_topology(device_name, self.get().map(|e| e.backend_kind().as_str()))
    }

    /// Stops the engine (pagewire extension; Mooncake's engine stops when collected).
    fn close(&self, py: Python<'_>) {
        let e = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(e) = e {
            let _ = py.detach(move || no_panic(|| e.close()));
        }
    }

    /// Mooncake's managed buffer: the address of ``length`` bytes of zeroed memory this
    /// engine allocated and registered (0 on failure or before ``initialize``).
    #[pyo3(signature = (length, /))]
    fn allocate_managed_buffer(&self, py: Python<'_>, length: &Bound<'_, PyAny>) -> PyResult<u64> {
        let n = addr(length, "length")?;
        Ok(self.call(py, "allocate_managed_buffer", zero, |e| {
            e.allocate_managed(n)
        }))
    }

    /// Returns a managed buffer; ``length`` is the length it was allocated with. 0, or
    /// -1 for an address that is not a managed buffer of that length.
    #[pyo3(signature = (buffer_addr, length, /))]
    fn free_managed_buffer(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let (a, n) = (addr(buffer_addr, "buffer_addr")?, addr(length, "length")?);
        Ok(self.call(py, "free_managed_buffer", minus_one, |e| {
            e.free_managed(a, n).map(|()| 0)
        }))
    }

    /// Copies the first ``length`` bytes of ``src`` (str as UTF-8, bytes, bytearray; None
    /// is empty) to
    /// ``dest_address``, which must lie in memory registered with this engine: 0, or -1
    /// (also when ``src`` is shorter than ``length``).
    #[pyo3(signature = (dest_address, src, length, /))]
    fn write_bytes_to_buffer(
        &self,
        py: Python<'_>,
        dest_address: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let (a, n) = (addr(dest_address, "dest_address")?, addr(length, "length")?);
        // None is no bytes (Mooncake's `char*` gets a null pointer).
        let data: Vec<u8> = if src.is_none() {
            Vec::new()
        } else if let Ok(s) = src.extract::<String>() {
            s.into_bytes()
        } else if src.is_instance_of::<pyo3::types::PyBytes>()
            || src.is_instance_of::<pyo3::types::PyByteArray>()
        {
            src.extract::<Vec<u8>>()?
        } else {
            return Err(PyTypeError::new_err(
                "src must be str, bytes, bytearray or None",
            ));
        };
        let Some(data) = usize::try_from(n).ok().and_then(|n| data.get(..n)) else {
            let msg = format!(
                "write_bytes_to_buffer: length {n} exceeds the {} bytes of src",
                data.len()
            );
            log(py, "error", &msg);
            return Ok(-1);
        };
        Ok(self.call(py, "write_bytes_to_buffer", minus_one, |e| {
            e.write_local(a, data).map(|()| 0)
        }))
    }

    /// ``length`` bytes at ``source_address``, which must lie in memory registered with
    /// this engine (``ValueError`` otherwise; Mooncake reads any address).
    #[pyo3(signature = (source_address, length, /))]
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: &Bound<'py, PyAny>,
        length: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let (a, n) = (
            addr(source_address, "source_address")?,
            addr(length, "length")?,
        );
        let Some(e) = self.get() else {
            return Err(PyValueError::new_err(
                "read_bytes_from_buffer: called before initialize",
            ));
        };
        match py.detach(|| e.read_local(a, n)) {
            Ok(v) => Ok(pyo3::types::PyBytes::new(py, &v)),
            Err(err) => Err(PyValueError::new_err(format!(
                "read_bytes_from_buffer: {err}"
            ))),
        }
    }
}

impl MooncakeEngine {
    /// `register_memory` / `batch_register_memory`: 0, -1, or -7.
    fn register_all(
        &self,
        py: Python<'_>,
        what: &str,
        buffers: &[(u64, u64)],
        location: &str,
    ) -> i32 {
        if device_location(location) {
            let msg = format!(
                "{what}: location {location:?}: device memory is not supported by this build"
            );
            log(py, "error", &msg);
            return -1;
        }
        self.call(py, what, register_rc, |e| {
            // SAFETY: like Mooncake's `register_memory`, the caller keeps the memory
            // allocated until it calls `unregister_memory` (the compat engine's documented
            // contract); the engine checks it is read-write memory of this process.
            unsafe { e.register_batch(buffers, true) }.map(|()| 0)
        })
    }
}

impl Drop for MooncakeEngine {
    fn drop(&mut self) {
        let e = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(e) = e {
            let _ = Python::attach(|py| py.detach(move || no_panic(|| e.close())));
        }
    }
}

// ------------------------------------------------------------------------ transfers

/// The transfer methods, on a subclass of `_MooncakeEngine`.
///
/// Mooncake's ten transfer methods share one shape: `(target_hostname, <one range or
/// three lists>[, opcode[, notify=None]], transport_hint="")`, with a fixed direction
/// where there is no opcode. A `#[pymethods]` block cannot hold macro-generated methods,
/// so the macro below generates this class's whole block from one template.
#[pyclass(
    module = "pagewire._native",
    name = "_MooncakeTransfers",
    extends = MooncakeEngine,
    subclass,
    frozen
)]
pub(crate) struct MooncakeTransfers;

/// What a transfer method was called with, converted.
struct Call<'a> {
    what: &'static str,
    session: &'a str,
    op: Opcode,
    ranges: Ranges,
    notify: Option<(Vec<u8>, Vec<u8>)>,
}

impl MooncakeEngine {
    /// `transfer_sync*`, `batch_transfer_sync*`: 0 or -1.
    fn sync(&self, py: Python<'_>, c: &Call<'_>) -> i32 {
        self.call(py, c.what, minus_one, |e| {
            let n = c.notify.as_ref().map(|(n, m)| (n.as_slice(), m.as_slice()));
            e.transfer_sync(&c.ranges.transfer(c.session, c.op), n)
                .map(|()| 0)
        })
    }

    /// `batch_transfer_async*`, `transfer_submit_write`: a batch id, or 0.
    fn submit(&self, py: Python<'_>, c: &Call<'_>) -> u64 {
        self.call(py, c.what, zero, |e| {
            e.transfer_async(&c.ranges.transfer(c.session, c.op))
        })
    }
}

/// Each line: `name(range arguments)[(opcode[, notify])] -> return type = how`, where
/// `how` is `sync` or `submit` with `Write` / `Read`, or `(op)` for an opcode argument.
macro_rules! transfer_methods {
    ($(
        $name:ident($ranges:ident: $b:ident, $p:ident, $l:ident $(; $opcode:ident $(, $notify:ident)?)?)
            -> $ret:ty = $how:ident($($fixed:ident)?);
    )*) => {
        #[pymethods]
        impl MooncakeTransfers {
            #[new]
            fn new() -> PyClassInitializer<Self> {
                PyClassInitializer::from(MooncakeEngine::new()).add_subclass(MooncakeTransfers)
            }
            $(
                #[pyo3(signature = (
                    target_hostname, $b, $p, $l $(, $opcode $(, $notify = None)?)?, transport_hint = ""
                ))]
                #[allow(clippy::too_many_arguments)] // Mooncake's signatures
                fn $name(
                    slf: &Bound<'_, Self>,
                    target_hostname: &str,
                    $b: &Bound<'_, PyAny>,
                    $p: &Bound<'_, PyAny>,
                    $l: &Bound<'_, PyAny>,
                    $($opcode: &Bound<'_, PyAny>, $($notify: Option<&Bound<'_, PyAny>>,)?)?
                    transport_hint: &str,
                ) -> PyResult<$ret> {
                    let _ = transport_hint;
                    let call = Call {
                        what: stringify!($name),
                        session: target_hostname,
                        op: $(Opcode::$fixed)? $(self::opcode($opcode)?)?,
                        ranges: Ranges::$ranges($b, $p, $l)?,
                        notify: None $($(.or(notification($notify)?))?)?,
                    };
                    Ok(slf.as_super().get().$how(slf.py(), &call))
                }
            )*
        }
    };
}

transfer_methods! {
    transfer_sync_write(one: buffer, peer_buffer_address, length) -> i32 = sync(Write);
    transfer_sync_read(one: buffer, peer_buffer_address, length) -> i32 = sync(Read);
    batch_transfer_sync_write(lists: buffers, peer_buffer_addresses, lengths) -> i32 = sync(Write);
    batch_transfer_sync_read(lists: buffers, peer_buffer_addresses, lengths) -> i32 = sync(Read);
    transfer_sync(one: buffer, peer_buffer_address, length; opcode, notify) -> i32 = sync();
    batch_transfer_sync(lists: buffers, peer_buffer_addresses, lengths; opcode, notify) -> i32 = sync();
    transfer_submit_write(one: buffer, peer_buffer_address, length) -> u64 = submit(Write);
    batch_transfer_async_write(lists: buffers, peer_buffer_addresses, lengths) -> u64 = submit(Write);
    batch_transfer_async_read(lists: buffers, peer_buffer_addresses, lengths) -> u64 = submit(Read);
    batch_transfer_async(lists: buffers, peer_buffer_addresses, lengths; opcode) -> u64 = submit();
}

/// A small JSON topology: devices pagewire can open (verbs builds) and the backend.
fn local_topology(device_filter: Option<&str>, backend: Option<&str>) -> String {
    #[allow(unused_mut)]
    let mut devices: Vec<String> = Vec::new();
    #[cfg(feature = "verbs")]
    if let Ok(list) = pagewire_transport::verbs::list_devices() {
        let wanted: Vec<&str> = device_filter
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        for d in list {
            if wanted.is_empty() || wanted.contains(&d.name.as_str()) {
                devices.push(d.name.clone());
            }
        }
    }
    #[cfg(not(feature = "verbs"))]
    let _ = device_filter;
    let quoted: Vec<String> = devices
        .iter()
        .map(|d| format!("\"{}\"", d.replace('"', "")))
        .collect();
    let list = quoted.join(", ");
    match backend {
        Some(b) => format!(
            "{{\"cpu:0\": {{\"preferred_hca\": [{list}], \"avail_hca\": []}}, \"pagewire_backend\": \"{b}\"}}"
        ),
        None => format!("{{\"cpu:0\": {{\"preferred_hca\": [{list}], \"avail_hca\": []}}}}"),
    }
}

/// Whether `[addr, addr+len)` is mapped read-write memory of this process (the RPC
/// interface's `send_tensor` reads a tensor's `data_ptr()` only then).
#[pyfunction]
fn _host_rw(addr: u64, len: u64) -> bool {
    pagewire_mooncake::memcheck::check_host_rw(addr, len).is_ok()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_host_rw, m)?)?;
    m.add_class::<MooncakeEngine>()?;
    m.add_class::<MooncakeTransfers>()?;
    Ok(())
}
