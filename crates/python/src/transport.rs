//! Bindings of `pagewire-transport`: engines, registrations, peers, batches and
//! notifications (the native API, `pagewire.Engine`).
//!
//! Everything that waits or moves data runs with the GIL released (`py.detach`); waits
//! are cut into short slices so that Ctrl-C still interrupts them. Rust errors become the
//! exception classes of [`crate::transport_errors`], and a panic inside a call becomes a
//! `PagewireError` instead of crossing into Python.
//!
//! Lock discipline: a mutex that can be held while the GIL is released is only ever
//! taken inside `py.detach`, so that a thread holding the GIL never waits on a thread
//! that needs the GIL to finish.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Engine as RsEngine, EngineConfig, Error, Op, PeerId,
    PreparedBatch as RsPrepared, RegionId, TransferHandle, TransferOp,
};

use crate::convert::u64_vec;
use crate::errors::PagewireError;
use crate::transport_errors::{new_err, to_py};

/// How long one GIL-released slice of a long wait lasts before signals are checked.
const SLICE: Duration = Duration::from_millis(100);

/// How long closing an engine (or dropping a region) waits for in-flight transfers to
/// let go of a region before it gives up and keeps the memory alive for good.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

// ------------------------------------------------------------------------ helpers

/// Runs `f`, turning a panic into an error value instead of unwinding into Python.
pub(crate) fn no_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into())
    })
}

/// A panic caught at the boundary, as a `PagewireError`.
fn panicked(what: String) -> PyErr {
    PagewireError::new_err(format!("internal error (a bug in pagewire): {what}"))
}

/// Runs `f` with the GIL released, panics caught.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| no_panic(f)).map_err(panicked)
}

/// Seconds (int or float) as a duration; `None` stays `None`.
pub(crate) fn seconds(v: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && (0.0..1e9).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "{what} must be a finite number of seconds >= 0, got {s}"
        ))),
    }
}

/// `auto`, `verbs` (`rdma`), `tcp` or `loopback`.
pub(crate) fn parse_backend(s: &str) -> PyResult<BackendKind> {
    s.parse::<BackendKind>().map_err(|_| {
        PyValueError::new_err(format!(
            "backend must be auto, verbs, tcp or loopback, got {s:?}"
        ))
    })
}

/// Access strings: `"rw"` (peers may read and write), `"r"` (peers may read), `"w"`
/// (peers may write), `""` or `"local"` (local use only). Local write access is always
/// included, so a region can also receive the data of our own READs.
fn parse_access(s: &str) -> PyResult<Access> {
    let mut a = Access::LOCAL_WRITE;
    if s == "local" {
        return Ok(a);
    }
    for c in s.chars() {
        match c {
            'r' => a |= Access::REMOTE_READ,
            'w' => a |= Access::REMOTE_WRITE,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "access must be \"rw\", \"r\", \"w\" or \"local\", got {s:?}"
                )));
            }
        }
    }
    Ok(a)
}

fn access_str(a: Access) -> &'static str {
    match (
        a.contains(Access::REMOTE_READ),
        a.contains(Access::REMOTE_WRITE),
    ) {
        (true, true) => "rw",
        (true, false) => "r",
        (false, true) => "w",
        (false, false) => "local",
    }
}

fn parse_op(s: &str) -> PyResult<Op> {
    match s {
        "write" | "WRITE" => Ok(Op::Write),
        "read" | "READ" => Ok(Op::Read),
        _ => Err(PyValueError::new_err(format!(
            "op must be \"write\" or \"read\", got {s:?}"
        ))),
    }
}

/// Resolves `host:port` (`[v6]:port` too) to socket addresses.
pub(crate) fn resolve(addr: &str) -> std::io::Result<Vec<SocketAddr>> {
    Ok(addr.to_socket_addrs()?.collect())
}

/// `(srcs, dsts, lens)` from a plan object (`.srcs`, `.dsts`, `.lens`) or three sequences.
fn plan_triples(
    plan: &Bound<'_, PyAny>,
    dsts: Option<&Bound<'_, PyAny>>,
    lens: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let (s, d, l) = match (dsts, lens) {
        (Some(d), Some(l)) => (
            u64_vec(plan, "srcs")?,
            u64_vec(d, "dsts")?,
            u64_vec(l, "lens")?,
        ),
        (None, None) => {
            if !(plan.hasattr("srcs")? && plan.hasattr("dsts")? && plan.hasattr("lens")?) {
                return Err(PyTypeError::new_err(
                    "expected a plan with .srcs, .dsts and .lens, or three sequences (srcs, dsts, lens)",
                ));
            }
            (
                u64_vec(&plan.getattr("srcs")?, "plan.srcs")?,
                u64_vec(&plan.getattr("dsts")?, "plan.dsts")?,
                u64_vec(&plan.getattr("lens")?, "plan.lens")?,
            )
        }
        _ => {
            return Err(PyTypeError::new_err(
                "pass both dsts and lens, or a plan object alone",
            ));
        }
    };
    if s.len() != d.len() || s.len() != l.len() {
        return Err(new_err(
            plan.py(),
            "UsageError",
            "Usage",
            format!(
                "srcs, dsts and lens differ in length ({}, {}, {})",
                s.len(),
                d.len(),
                l.len()
            ),
        ));
    }
    Ok((s, d, l))
}

/// A batch from data-flow triples: for a WRITE `src` is local, for a READ `src` is remote.
fn batch_of(op: Op, s: &[u64], d: &[u64], l: &[u64]) -> Batch {
    let mut b = Batch::with_capacity(s.len());
    for i in 0..s.len() {
        let (local, remote) = match op {
            Op::Write => (s[i], d[i]),
            Op::Read => (d[i], s[i]),
        };
        b.push(TransferOp {
            op,
            local,
            remote,
            len: l[i],
        });
    }
    b
}

/// Waits in GIL-released slices until `done` yields or `deadline` passes, checking for
/// signals (Ctrl-C) between slices.
fn wait_sliced<T: Send>(
    py: Python<'_>,
    deadline: Instant,
    mut step: impl FnMut(Instant) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let now = Instant::now();
        let until = deadline.min(now + SLICE);
        if let Some(v) = detached(py, || step(until))? {
            return Ok(Some(v));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

// ------------------------------------------------------------------------ Engine

/// A region registered through the native API: what the engine must keep alive.
struct RegionState {
    id: RegionId,
    addr: u64,
    len: u64,
    access: Access,
    /// The Python object exporting the memory (a ctypes view holding a buffer export),
    /// kept until the engine no longer uses the region. `None` for raw pointers.
    keep: Mutex<Option<Py<PyAny>>>,
    /// Still registered (a `deregister` ends it).
    live: Mutex<bool>,
}

struct EngineShared {
    engine: RwLock<Option<RsEngine>>,
    regions: Mutex<HashMap<u64, Arc<RegionState>>>,
}

impl EngineShared {
    fn get(&self) -> Result<RsEngine, Error> {
        self.engine
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(Error::Shutdown)
    }

    /// Deregisters `r` (waiting up to `wait` for in-flight users); true when the engine
    /// no longer references it (so its memory may go).
    fn release(&self, r: &RegionState, wait: Duration) -> bool {
        let mut live = r.live.lock().unwrap_or_else(|p| p.into_inner());
        if !*live {
            return true;
        }
        let Ok(engine) = self.get() else {
            // Closed: `close` already released or leaked everything it could.
            return false;
        };
        match engine.deregister_wait(r.id, Instant::now() + wait) {
            Ok(()) | Err(Error::UnknownRegion { .. }) => {
                *live = false;
                self.regions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&r.id.get());
                true
            }
            Err(_) => false,
        }
    }

    /// Deregisters every region, then shuts the engine down. Regions still in use after
    /// [`RELEASE_WAIT`] keep their memory alive for the life of the process.
    fn close(&self) -> Vec<Py<PyAny>> {
        let regions: Vec<_> = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let mut leaked = Vec::new();
        for r in regions {
            if !self.release(&r, RELEASE_WAIT)
                && let Some(k) = r.keep.lock().unwrap_or_else(|p| p.into_inner()).take()
            {
                leaked.push(k);
            }
        }
        if let Some(e) = self
            .engine
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            e.shutdown();
        }
        leaked
    }
}

/// A transfer engine: registers memory, connects to peers and runs one-sided batches.
///
/// ``Engine(listen="127.0.0.1:0", backend="auto", device=None, timeout=30.0,
/// connect_timeout=5.0, token=None)``. ``None`` means: the ``PAGEWIRE_*`` environment
/// variable, else the default. ``backend`` is ``"auto"`` (verbs if a device opens, else
/// TCP), ``"verbs"``, ``"tcp"`` or ``"loopback"`` (engines of one process). ``timeout`` is
/// the default deadline of a batch, ``connect_timeout`` bounds a connect and its handshake.
/// Use it as a context manager, or call :meth:`close`.
#[pyclass(module = "pagewire._native", name = "Engine", frozen)]
pub(crate) struct PyEngine {
    shared: Arc<EngineShared>,
}

impl PyEngine {
    fn engine(&self, py: Python<'_>) -> PyResult<RsEngine> {
        self.shared.get().map_err(|e| to_py(py, &e))
    }

    fn peer_obj(&self, py: Python<'_>, id: PeerId) -> PyResult<Py<PyPeer>> {
        Py::new(
            py,
            PyPeer {
                shared: self.shared.clone(),
                id,
            },
        )
    }

    fn register_inner(
        &self,
        py: Python<'_>,
        addr: u64,
        len: u64,
        access: Access,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyRegion>> {
        let engine = self.engine(py)?;
        let len_usize =
            usize::try_from(len).map_err(|_| PyValueError::new_err("length too large"))?;
        let id = detached(py, move || {
            // SAFETY: the caller of `Engine.register` vouches for a raw pointer (documented:
            // the memory must stay valid until the region is deregistered); for a buffer
            // object we hold its export (`keep`) until the engine has let go of the region
            // (`EngineShared::release` / `close`), so the memory outlives the registration.
            unsafe { engine.register_raw(addr as *mut u8, len_usize, access) }
        })?
        .map_err(|e| to_py(py, &e))?;
        let mut regions = self
            .shared
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = regions.get(&id.get()) {
            // Inside a region registered before with at least this access: the engine
            // counted a second registration of the same id. Undo it (the existing Region
            // object owns the registration) and refuse, so ownership stays one-to-one.
            let (ea, el) = (existing.addr, existing.len);
            drop(regions);
            let engine = self.engine(py)?;
            let _ = detached(py, move || engine.deregister(id))?;
            return Err(new_err(
                py,
                "RegionOverlap",
                "RegionOverlap",
                format!(
                    "range addr={addr:#x} len={len} is inside region {} (addr={:#x} len={}), registered already",
                    id.get(),
                    ea,
                    el
                ),
            ));
        }
        let state = Arc::new(RegionState {
            id,
            addr,
            len,
            access,
            keep: Mutex::new(keep),
            live: Mutex::new(true),
        });
        regions.insert(id.get(), state.clone());
        drop(regions);
        Py::new(
            py,
            PyRegion {
                shared: self.shared.clone(),
                state,
            },
        )
    }
}

/// The address and length of a writable, C-contiguous buffer-protocol object, and a
/// ctypes view of it that holds the buffer export (so the exporter cannot resize or free
/// the memory while the view lives).
fn buffer_view(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64, Py<PyAny>)> {
    let py = obj.py();
    let mv = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))?;
    if mv.getattr("readonly")?.extract::<bool>()? {
        return Err(PyTypeError::new_err(
            "register needs a writable buffer (the engine may write into it); got a read-only one",
        ));
    }
    if !mv.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(
            "register needs a C-contiguous buffer",
        ));
    }
    let nbytes: u64 = mv.getattr("nbytes")?.extract()?;
    let ctypes = py.import("ctypes")?;
    let arr_t = ctypes
        .getattr("c_char")?
        .call_method1("__mul__", (nbytes,))?;
    let flat = mv.call_method1("cast", ("B",))?;
    let view = arr_t.call_method1("from_buffer", (flat,))?;
    let addr: u64 = ctypes.call_method1("addressof", (&view,))?.extract()?;
    Ok((addr, nbytes, view.unbind()))
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (listen=None, backend=None, device=None, timeout=None, connect_timeout=None, token=None))]
    fn new(
        py: Python<'_>,
        listen: Option<&str>,
        backend: Option<&str>,
        device: Option<&str>,
        timeout: Option<f64>,
        connect_timeout: Option<f64>,
        token: Option<&str>,
    ) -> PyResult<Self> {
        let mut b = EngineConfig::builder()
            .with_env()
            .map_err(|e| to_py(py, &e))?;
        let env_listen = std::env::var("PAGEWIRE_LISTEN").ok();
        let listen = listen
            .map(str::to_string)
            .or(env_listen)
            .unwrap_or_else(|| "127.0.0.1:0".into());
        let addr = resolve(&listen)
            .ok()
            .and_then(|v| v.into_iter().next())
            .ok_or_else(|| {
                PyValueError::new_err(format!("listen must be \"ip:port\", got {listen:?}"))
            })?;
        b = b.listen(addr);
        if let Some(k) = backend {
            b = b.backend(parse_backend(k)?);
        }
        if let Some(d) = device {
            b = b.rdma_device(d);
        }
        if let Some(t) = seconds(timeout, "timeout")? {
            b = b.batch_timeout(t);
        }
        if let Some(t) = seconds(connect_timeout, "connect_timeout")? {
            b = b.handshake_timeout(t);
        }
        if let Some(t) = token {
            b = b.token(t);
        }
        let cfg = b.build().map_err(|e| to_py(py, &e))?;
        let engine = detached(py, move || RsEngine::new(cfg))?.map_err(|e| to_py(py, &e))?;
        Ok(PyEngine {
            shared: Arc::new(EngineShared {
                engine: RwLock::new(Some(engine)),
                regions: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The control address peers connect to, ``"ip:port"``.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.engine(py)?.local_addr().to_string())
    }

    /// The control port.
    #[getter]
    fn port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.engine(py)?.local_addr().port())
    }

    /// The data path in use: ``"verbs"``, ``"tcp"`` or ``"loopback"``.
    #[getter]
    fn backend(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.engine(py)?.backend_kind().as_str())
    }

    /// Device, link, MTU, QPs or streams per peer (`qps_or_streams`; also under its old
    /// key `lanes_per_peer`), slice size, and why this backend was chosen.
    #[getter]
    fn backend_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.engine(py)?.backend_info();
        let d = PyDict::new(py);
        d.set_item("kind", i.kind.as_str())?;
        d.set_item("device", &i.device)?;
        d.set_item("port", i.port)?;
        d.set_item("link", &i.link)?;
        d.set_item("mtu", i.mtu)?;
        d.set_item("gid_index", i.gid_index)?;
        d.set_item("qps_or_streams", i.qps_or_streams)?;
        d.set_item("lanes_per_peer", i.qps_or_streams)?;
        d.set_item("tx_depth", i.tx_depth)?;
        d.set_item("max_wr_bytes", i.max_wr_bytes)?;
        d.set_item("max_mr_bytes", i.max_mr_bytes)?;
        d.set_item("selection", &i.selection)?;
        Ok(d)
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.get().is_err()
    }

    /// Registers memory and returns a :class:`Region`.
    ///
    /// ``obj`` is an int address (then ``length`` is required and the memory must stay
    /// valid until the region is deregistered) or any writable, C-contiguous object with
    /// the buffer protocol (``bytearray``, numpy array, ``mmap``...; the engine holds it,
    /// and it cannot be resized, until the region is deregistered). ``access``: ``"rw"``
    /// (peers may read and write), ``"r"``, ``"w"`` or ``"local"``.
    #[pyo3(signature = (obj, length=None, access="rw"))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        length: Option<u64>,
        access: &str,
    ) -> PyResult<Py<PyRegion>> {
        let access = parse_access(access)?;
        if let Ok(addr) = obj.extract::<u64>() {
            if obj.is_instance_of::<pyo3::types::PyBool>() {
                return Err(PyTypeError::new_err(
                    "register takes an address or a buffer, not a bool",
                ));
            }
            let len = length.ok_or_else(|| {
                PyTypeError::new_err(
                    "register(address, length): length is required with an address",
                )
            })?;
            // A wrong integer would crash the process at the first incoming WRITE: refuse
            // anything that is not writable memory of this process.
            if let Err(m) = pagewire_mooncake::memcheck::check_host_rw(addr, len) {
                return Err(new_err(
                    py,
                    "RegistrationError",
                    "Registration",
                    format!("cannot register {addr:#x}+{len}: {m}"),
                ));
            }
            return self.register_inner(py, addr, len, access, None);
        }
        if obj.extract::<i64>().is_ok() {
            return Err(PyValueError::new_err(
                "address must be a non-negative int below 2**64",
            ));
        }
        let (addr, nbytes, view) = buffer_view(obj)?;
        let len = match length {
            None => nbytes,
            Some(l) if l <= nbytes => l,
            Some(l) => {
                return Err(PyValueError::new_err(format!(
                    "length {l} exceeds the buffer's {nbytes} bytes"
                )));
            }
        };
        self.register_inner(py, addr, len, access, Some(view))
    }

    /// Connects to a peer's control address (``"host:port"``) and runs the handshake,
    /// bounded by the engine's ``connect_timeout``. Returns a :class:`Peer`.
    fn connect(&self, py: Python<'_>, address: &str) -> PyResult<Py<PyPeer>> {
        let engine = self.engine(py)?;
        let a = address.to_string();
        let id = detached(py, move || engine.connect(a.as_str()))?.map_err(|e| to_py(py, &e))?;
        self.peer_obj(py, id)
    }

    /// Waits up to ``timeout`` seconds (``None``: forever) for a peer to connect to us;
    /// returns its :class:`Peer` or ``None``.
    #[pyo3(signature = (timeout=None))]
    fn accept(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyPeer>>> {
        let engine = self.engine(py)?;
        let deadline = deadline_of(seconds(timeout, "timeout")?);
        match wait_sliced(py, deadline, |until| engine.accept(until))? {
            Some(id) => Ok(Some(self.peer_obj(py, id)?)),
            None => Ok(None),
        }
    }

    /// The connected peers.
    fn peers(&self, py: Python<'_>) -> PyResult<Vec<Py<PyPeer>>> {
        let engine = self.engine(py)?;
        engine
            .peers()
            .into_iter()
            .map(|p| self.peer_obj(py, p))
            .collect()
    }

    /// Validates and posts a batch; returns a :class:`Handle`.
    ///
    /// The batch is a plan (any object with ``.srcs``, ``.dsts`` and ``.lens``, such as
    /// :class:`TransferPlan`) or three sequences ``srcs, dsts, lens``, in data-flow order:
    /// for ``op="write"`` sources are local and destinations remote, for ``op="read"`` the
    /// reverse. Every local range must be registered and every remote range exposed by
    /// the peer; otherwise nothing is posted and the call raises (:class:`OutOfRange`,
    /// :class:`AccessDenied`...). ``notify`` (a 32-bit tag) reaches the peer's
    /// :meth:`poll_notification` after every byte. ``timeout`` is the batch's deadline.
    #[pyo3(signature = (peer, srcs, dsts=None, lens=None, *, op="write", notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn submit(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, PyPeer>,
        srcs: &Bound<'_, PyAny>,
        dsts: Option<&Bound<'_, PyAny>>,
        lens: Option<&Bound<'_, PyAny>>,
        op: &str,
        notify: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<PyHandle> {
        let engine = self.engine(py)?;
        let batch = self.build_batch(py, srcs, dsts, lens, op, notify, timeout)?;
        let pid = peer.get().id;
        let h = detached(py, move || engine.submit(pid, batch))?.map_err(|e| to_py(py, &e))?;
        Ok(PyHandle { h })
    }

    /// Validates, pins and plans a batch once, for :meth:`PreparedBatch.start` to post
    /// any number of times (one run at a time). Arguments as :meth:`submit`; ``timeout``
    /// applies to each run.
    #[pyo3(signature = (peer, srcs, dsts=None, lens=None, *, op="write", notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn prepare(
        &self,
        py: Python<'_>,
        peer: &Bound<'_, PyPeer>,
        srcs: &Bound<'_, PyAny>,
        dsts: Option<&Bound<'_, PyAny>>,
        lens: Option<&Bound<'_, PyAny>>,
        op: &str,
        notify: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<PyPrepared> {
        let engine = self.engine(py)?;
        let t = seconds(timeout, "timeout")?.unwrap_or(engine.config().batch_timeout);
        let batch = self
            .build_batch(py, srcs, dsts, lens, op, notify, None)?
            .timeout(t);
        let pid = peer.get().id;
        let p = detached(py, move || engine.prepare(pid, batch))?.map_err(|e| to_py(py, &e))?;
        Ok(PyPrepared {
            p: Arc::new(Mutex::new(p)),
            bytes_per_run: 0,
        }
        .with_bytes())
    }

    /// Waits up to ``timeout`` seconds (``None``: forever) for a remote notification;
    /// returns a :class:`Notification` or ``None``.
    #[pyo3(signature = (timeout=None))]
    fn poll_notification(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<PyNotification>> {
        let engine = self.engine(py)?;
        let deadline = deadline_of(seconds(timeout, "timeout")?);
        let n = wait_sliced(py, deadline, |until| engine.poll_notification(until))?;
        Ok(n.map(|n| PyNotification {
            shared: self.shared.clone(),
            peer: n.peer,
            tag: n.tag,
        }))
    }

    /// The next queued notification, or ``None`` (does not wait).
    fn try_notification(&self, py: Python<'_>) -> PyResult<Option<PyNotification>> {
        let engine = self.engine(py)?;
        let n = detached(py, move || engine.try_notification())?;
        Ok(n.map(|n| PyNotification {
            shared: self.shared.clone(),
            peer: n.peer,
            tag: n.tag,
        }))
    }

    /// Reaps the verbs backend's completions once on this thread (needed only with
    /// ``PAGEWIRE_PROGRESS=manual``); returns how many were handled. 0 on TCP/loopback.
    fn progress(&self, py: Python<'_>) -> PyResult<usize> {
        let engine = self.engine(py)?;
        detached(py, move || engine.reap())
    }

    /// Local regions: a list of ``(addr, length, access)`` tuples, by address.
    fn regions(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64, &'static str)>> {
        Ok(self
            .engine(py)?
            .regions()
            .into_iter()
            .map(|r| (r.addr, r.len, access_str(r.access)))
            .collect())
    }

    /// Deregisters every region (waiting briefly for in-flight transfers), closes every
    /// connection and stops the engine. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let shared = self.shared.clone();
        let leaked = detached(py, move || shared.close())?;
        for k in leaked {
            // Still in use by a transfer that did not finish: the memory must outlive it.
            std::mem::forget(k);
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match self.shared.get() {
            Ok(e) => format!(
                "<pagewire.Engine {} on {}>",
                e.backend_kind(),
                e.local_addr()
            ),
            Err(_) => "<pagewire.Engine closed>".into(),
        }
    }
}

impl PyEngine {
    #[allow(clippy::too_many_arguments)] // mirrors `submit`
    fn build_batch(
        &self,
        py: Python<'_>,
        srcs: &Bound<'_, PyAny>,
        dsts: Option<&Bound<'_, PyAny>>,
        lens: Option<&Bound<'_, PyAny>>,
        op: &str,
        notify: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<Batch> {
        let op = parse_op(op)?;
        let (s, d, l) = plan_triples(srcs, dsts, lens)?;
        let mut batch = batch_of(op, &s, &d, &l);
        if let Some(t) = notify {
            batch = batch.notify(t);
        }
        if let Some(t) = seconds(timeout, "timeout")? {
            batch = batch.timeout(t);
        }
        let _ = py;
        Ok(batch)
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // Only the last reference to the shared state closes it (regions, peers and
        // handles keep the engine open while they live).
        if Arc::strong_count(&self.shared) == 1 {
            let shared = self.shared.clone();
            let leaked = Python::attach(|py| py.detach(|| no_panic(|| shared.close())));
            if let Ok(leaked) = leaked {
                for k in leaked {
                    std::mem::forget(k);
                }
            }
        }
    }
}

fn deadline_of(timeout: Option<Duration>) -> Instant {
    // "Forever" as a far but representable instant.
    Instant::now() + timeout.unwrap_or(Duration::from_secs(100 * 365 * 24 * 3600))
}

// ------------------------------------------------------------------------ Region

/// Memory registered with an :class:`Engine`. A context manager: leaving it deregisters.
#[pyclass(module = "pagewire._native", name = "Region", frozen)]
pub(crate) struct PyRegion {
    shared: Arc<EngineShared>,
    state: Arc<RegionState>,
}

#[pymethods]
impl PyRegion {
    /// Start address.
    #[getter]
    fn addr(&self) -> u64 {
        self.state.addr
    }

    /// Length in bytes.
    #[getter]
    fn length(&self) -> u64 {
        self.state.len
    }

    /// ``"rw"``, ``"r"``, ``"w"`` or ``"local"``.
    #[getter]
    fn access(&self) -> &'static str {
        access_str(self.state.access)
    }

    /// Whether the region is still registered.
    #[getter]
    fn registered(&self, py: Python<'_>) -> PyResult<bool> {
        let st = self.state.clone();
        detached(py, move || {
            *st.live.lock().unwrap_or_else(|p| p.into_inner())
        })
    }

    /// Deregisters, waiting up to ``timeout`` seconds (default 5) for batches that use the
    /// region to finish; raises :class:`RegionBusy` if they do not. Idempotent.
    #[pyo3(signature = (timeout=5.0))]
    fn deregister(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let wait = seconds(Some(timeout), "timeout")?.unwrap_or_default();
        let (shared, st) = (self.shared.clone(), self.state.clone());
        let released = detached(py, move || shared.release(&st, wait))?;
        if !released {
            if self.shared.get().is_err() {
                return Ok(()); // closed: the engine let go of everything it could
            }
            return Err(new_err(
                py,
                "RegionBusy",
                "RegionBusy",
                format!(
                    "region at {:#x} is still used by in-flight batches",
                    self.state.addr
                ),
            ));
        }
        // The engine no longer touches the memory: let the exporter go.
        let keep = self
            .state
            .keep
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(keep);
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.deregister(py, RELEASE_WAIT.as_secs_f64())?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<pagewire.Region addr={:#x} length={} access={}>",
            self.state.addr,
            self.state.len,
            access_str(self.state.access)
        )
    }
}

impl Drop for PyRegion {
    fn drop(&mut self) {
        // Garbage-collected while registered: deregister now if nothing uses it, else
        // keep the memory alive for good (a transfer might still write it).
        let (shared, st) = (self.shared.clone(), self.state.clone());
        let freed =
            Python::attach(|py| py.detach(|| no_panic(|| shared.release(&st, Duration::ZERO))));
        if !matches!(freed, Ok(true))
            && self.shared.get().is_ok()
            && let Some(k) = self
                .state
                .keep
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
        {
            std::mem::forget(k);
        }
    }
}

// ------------------------------------------------------------------------ Peer

/// A connected peer (from :meth:`Engine.connect`, :meth:`Engine.accept` or a
/// notification).
#[pyclass(module = "pagewire._native", name = "Peer", frozen)]
pub(crate) struct PyPeer {
    shared: Arc<EngineShared>,
    id: PeerId,
}

#[pymethods]
impl PyPeer {
    /// The peer's id on this engine.
    #[getter]
    fn id(&self) -> u64 {
        self.id.get()
    }

    /// The peer's control address.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        let e = self.shared.get().map_err(|e| to_py(py, &e))?;
        let info = e.peer_info(self.id).map_err(|e| to_py(py, &e))?;
        Ok(info.control_addr.to_string())
    }

    /// Whether the connection is still usable.
    #[getter]
    fn alive(&self, py: Python<'_>) -> PyResult<bool> {
        let e = self.shared.get().map_err(|e| to_py(py, &e))?;
        e.peer_alive(self.id).map_err(|e| to_py(py, &e))
    }

    /// The memory the peer exposes, as last described: ``(addr, length, access)`` tuples.
    #[getter]
    fn regions(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64, &'static str)>> {
        let e = self.shared.get().map_err(|e| to_py(py, &e))?;
        let r = e.peer_regions(self.id).map_err(|e| to_py(py, &e))?;
        Ok(r.into_iter()
            .map(|r| (r.addr, r.len, access_str(r.access)))
            .collect())
    }

    /// Fetches the peer's exposed regions again (after it registered more memory).
    fn redescribe(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64, &'static str)>> {
        let e = self.shared.get().map_err(|e| to_py(py, &e))?;
        let id = self.id;
        let r = detached(py, move || e.redescribe(id))?.map_err(|e| to_py(py, &e))?;
        Ok(r.into_iter()
            .map(|r| (r.addr, r.len, access_str(r.access)))
            .collect())
    }

    /// Closes the connection; its pending batches fail.
    fn disconnect(&self, py: Python<'_>) -> PyResult<()> {
        let e = self.shared.get().map_err(|e| to_py(py, &e))?;
        let id = self.id;
        detached(py, move || e.disconnect(id))?.map_err(|e| to_py(py, &e))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyPeer>()
            .is_ok_and(|o| Arc::ptr_eq(&o.get().shared, &self.shared) && o.get().id == self.id)
    }

    fn __hash__(&self) -> u64 {
        self.id.get()
    }

    fn __repr__(&self) -> String {
        format!("<pagewire.Peer {}>", self.id.get())
    }
}

// ------------------------------------------------------------------------ Handle

/// A submitted batch. Dropping it does not cancel the batch.
#[pyclass(module = "pagewire._native", name = "Handle", frozen)]
pub(crate) struct PyHandle {
    h: TransferHandle,
}

#[pymethods]
impl PyHandle {
    /// Engine-wide batch id.
    #[getter]
    fn id(&self) -> u64 {
        self.h.id()
    }

    /// Bytes completed so far (a lower bound while pending).
    #[getter]
    fn bytes_done(&self) -> u64 {
        self.h.bytes_done()
    }

    /// Waits until the batch finishes, at most ``timeout`` seconds (``None``: up to the
    /// batch's own deadline). Returns ``{"ops", "bytes", "elapsed"}`` on success; raises
    /// the batch's error, :class:`Cancelled`, or :class:`Timeout` (the wait ran out; the
    /// batch may still be running).
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let deadline = match seconds(timeout, "timeout")? {
            Some(t) => Instant::now() + t,
            None => self.h.deadline(),
        };
        let h = self.h.clone();
        let r = wait_sliced(py, deadline, |until| match h.wait(until) {
            Err(Error::Timeout { .. })
                if Instant::now() < deadline && !h.status().is_finished() =>
            {
                None
            }
            other => Some(other),
        })?;
        let r = match r {
            Some(r) => r,
            None => self.h.wait(Instant::now()),
        };
        match r {
            Ok(s) => {
                let d = PyDict::new(py);
                d.set_item("ops", s.ops)?;
                d.set_item("bytes", s.bytes)?;
                d.set_item("elapsed", s.elapsed.as_secs_f64())?;
                Ok(d)
            }
            Err(e) => Err(to_py(py, &e)),
        }
    }

    /// ``"pending"``, ``"done"``, ``"failed"`` or ``"cancelled"`` (a pending batch past
    /// its deadline is ``"failed"``).
    fn status(&self) -> &'static str {
        match self.h.status() {
            BatchStatus::Pending => "pending",
            BatchStatus::Done => "done",
            BatchStatus::Cancelled => "cancelled",
            _ => "failed",
        }
    }

    /// The failure as an exception instance (not raised), or ``None``.
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.h.status() {
            BatchStatus::Failed(e) => Some(to_py(py, &e).into_value(py).into_any()),
            BatchStatus::Cancelled => Some(to_py(py, &Error::Cancelled).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Requests cancellation (best effort: slices already on the wire may still land,
    /// inside the target range). True if the batch was still pending.
    fn cancel(&self) -> bool {
        self.h.cancel()
    }

    fn __repr__(&self) -> String {
        format!("<pagewire.Handle {} {}>", self.h.id(), self.status())
    }
}

// ------------------------------------------------------------------------ PreparedBatch

/// A batch validated, pinned and planned once (:meth:`Engine.prepare`); each
/// :meth:`start` posts it again with what the source memory holds then.
#[pyclass(module = "pagewire._native", name = "PreparedBatch", frozen)]
pub(crate) struct PyPrepared {
    p: Arc<Mutex<RsPrepared>>,
    bytes_per_run: u64,
}

impl PyPrepared {
    fn with_bytes(mut self) -> Self {
        self.bytes_per_run = self.p.lock().unwrap_or_else(|p| p.into_inner()).bytes();
        self
    }
}

#[pymethods]
impl PyPrepared {
    /// Bytes per run.
    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes_per_run
    }

    /// Starts a run (one at a time: :meth:`wait` for the previous one first). ``tag``
    /// replaces the prepared notification tag for this run.
    #[pyo3(signature = (tag=None))]
    fn start(&self, py: Python<'_>, tag: Option<u32>) -> PyResult<()> {
        let p = self.p.clone();
        detached(py, move || {
            let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
            match tag {
                Some(t) => g.start_tagged(t),
                None => g.start(),
            }
        })?
        .map_err(|e| to_py(py, &e))
    }

    /// Waits for the current run, at most ``timeout`` seconds (``None``: forever);
    /// raises its error, or :class:`Timeout` (the run carries on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_of(seconds(timeout, "timeout")?);
        let p = self.p.clone();
        let r = wait_sliced(py, deadline, |until| {
            let mut g = p.lock().unwrap_or_else(|e| e.into_inner());
            match g.wait(until) {
                Err(Error::Timeout { .. }) if Instant::now() < deadline => None,
                other => Some(other),
            }
        })?;
        match r {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(to_py(py, &e)),
            None => Err(to_py(
                py,
                &Error::Timeout {
                    after: Duration::ZERO,
                },
            )),
        }
    }

    /// The current run's outcome without blocking: ``True`` when done (or none is
    /// running), ``False`` while in flight; raises its error.
    fn try_wait(&self, py: Python<'_>) -> PyResult<bool> {
        let p = self.p.clone();
        match detached(py, move || {
            p.lock().unwrap_or_else(|e| e.into_inner()).try_wait()
        })? {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(to_py(py, &e)),
        }
    }
}

// ------------------------------------------------------------------------ Notification

/// A remote notification: ``peer`` finished a batch tagged ``tag`` into our memory, and
/// every byte of it is in place.
#[pyclass(module = "pagewire._native", name = "Notification", frozen)]
pub(crate) struct PyNotification {
    shared: Arc<EngineShared>,
    peer: PeerId,
    tag: u32,
}

#[pymethods]
impl PyNotification {
    /// The sender, as a :class:`Peer` of this engine.
    #[getter]
    fn peer(&self, py: Python<'_>) -> PyResult<Py<PyPeer>> {
        Py::new(
            py,
            PyPeer {
                shared: self.shared.clone(),
                id: self.peer,
            },
        )
    }

    /// The batch's tag.
    #[getter]
    fn tag(&self) -> u32 {
        self.tag
    }

    fn __repr__(&self) -> String {
        format!(
            "<pagewire.Notification peer={} tag={}>",
            self.peer.get(),
            self.tag
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::transport_errors::register(m)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRegion>()?;
    m.add_class::<PyPeer>()?;
    m.add_class::<PyHandle>()?;
    m.add_class::<PyPrepared>()?;
    m.add_class::<PyNotification>()?;
    Ok(())
}
