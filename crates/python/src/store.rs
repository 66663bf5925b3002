//! Bindings of `pagewire-store`: `pagewire._native.StoreClient`, a client (and, with a
//! segment, a storage node) of the KV page store.
//!
//! Calls take their arguments as Python lists (or numpy arrays of addresses), convert
//! them, then release the GIL for the whole store call. Per-key outcomes are returned as
//! Mooncake-numbered codes (`0` or a size for success, negative for errors); a call that
//! fails as a whole raises `StoreError` with the code every key would get in `.code`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pagewire_store::{ClientConfig, Code, Pin, PutOptions, Span, StoreError as SErr};
use pagewire_transport::{BackendKind, EngineConfig};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::convert::u64_vec;
use crate::errors::PagewireError;

create_exception!(
    pagewire,
    StoreError,
    PagewireError,
    "A store call that failed as a whole (master unreachable, deadline passed, bad \
     arguments); `.code` is the Mooncake-numbered code every key of the call gets."
);

pub(crate) fn store_err(py: Python<'_>, e: SErr) -> PyErr {
    let err = StoreError::new_err(e.to_string());
    let _ = err.value(py).setattr("code", e.code().as_i32());
    err
}

/// Client settings for `master`: `host:port`, or `etcd://h:p;h:p` to follow the leader of
/// masters elected through etcd (their group: `PAGEWIRE_STORE_CLUSTER_ID`, default
/// `default`), looked up within `connect_timeout`.
fn client_config(py: Python<'_>, master: &str, connect_timeout: f64) -> PyResult<ClientConfig> {
    let by = std::time::Instant::now() + secs(connect_timeout, "connect_timeout")?;
    let cluster =
        std::env::var("PAGEWIRE_STORE_CLUSTER_ID").unwrap_or_else(|_| "default".to_string());
    pagewire_ha::client_config(master, &cluster, by).map_err(|e| store_err(py, e.into()))
}

fn closed() -> PyErr {
    PyRuntimeError::new_err("the store client is closed")
}

/// A key: `str` (UTF-8) or `bytes`.
pub(crate) fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!(
        "a key must be str or bytes, not {}",
        obj.get_type().name()?
    )))
}

pub(crate) fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    obj.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// `[[(ptr, len), ...], ...]` from parallel lists of pointer lists and size lists.
pub(crate) fn parts_of(
    ptrs: &Bound<'_, PyAny>,
    sizes: &Bound<'_, PyAny>,
) -> PyResult<Vec<Vec<Span>>> {
    let ptrs: Vec<Bound<'_, PyAny>> = ptrs.try_iter()?.collect::<PyResult<_>>()?;
    let sizes: Vec<Bound<'_, PyAny>> = sizes.try_iter()?.collect::<PyResult<_>>()?;
    if ptrs.len() != sizes.len() {
        return Err(PyValueError::new_err(format!(
            "{} pointer lists but {} size lists",
            ptrs.len(),
            sizes.len()
        )));
    }
    ptrs.iter()
        .zip(&sizes)
        .map(|(p, s)| {
            let p = u64_vec(p, "buffer pointers")?;
            let s = u64_vec(s, "buffer sizes")?;
            if p.len() != s.len() {
                return Err(PyValueError::new_err(format!(
                    "{} pointers but {} sizes for one object",
                    p.len(),
                    s.len()
                )));
            }
            Ok(p.into_iter().zip(s).map(|(a, n)| Span::new(a, n)).collect())
        })
        .collect()
}

/// `put`'s keyword arguments as options.
pub(crate) fn put_options(
    replicas: u8,
    pin: &str,
    preferred: Option<String>,
) -> PyResult<PutOptions> {
    Ok(PutOptions {
        replicas: replicas.max(1),
        pin: match pin {
            "none" => Pin::None,
            "soft" => Pin::Soft,
            "hard" => Pin::Hard,
            other => {
                return Err(PyValueError::new_err(format!(
                    "pin {other:?}: expected none, soft or hard"
                )));
            }
        },
        preferred: preferred.filter(|p| !p.is_empty()),
    })
}

/// Per key: `ok` of its value, or its failure's code.
pub(crate) fn per_key<T>(r: Vec<Result<T, Code>>, ok: impl Fn(T) -> i64) -> Vec<i64> {
    r.into_iter()
        .map(|x| x.map_or_else(|c| c.as_i32() as i64, &ok))
        .collect()
}

/// Per key: `0`, or its failure's code.
pub(crate) fn codes(r: Vec<Result<(), Code>>) -> Vec<i64> {
    per_key(r, |()| 0)
}

/// Whether `[ptr, ptr+len)` lies in mappings of this process that are readable and
/// writable (`/proc/self/maps`): a raw address from Python is checked before the engine
/// is allowed to touch it.
fn mapped_rw(ptr: u64, len: u64) -> bool {
    let Some(end) = ptr.checked_add(len) else {
        return false;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut ranges: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (range, perms) = (w.next()?, w.next()?);
            if !perms.starts_with("rw") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect();
    ranges.sort_unstable();
    // Adjacent mappings may cover the range together.
    let mut at = ptr;
    for (a, b) in ranges {
        if a <= at && at < b {
            at = b;
            if at >= end {
                return true;
            }
        }
    }
    false
}

fn backend_of(name: &str) -> PyResult<BackendKind> {
    match name {
        "auto" | "rdma" => Ok(BackendKind::Auto),
        "verbs" => Ok(BackendKind::Verbs),
        "tcp" => Ok(BackendKind::Tcp),
        "loopback" => Ok(BackendKind::Loopback),
        other => Err(PyValueError::new_err(format!(
            "transport {other:?}: expected auto, rdma, verbs, tcp or loopback"
        ))),
    }
}

pub(crate) fn secs(v: f64, what: &str) -> PyResult<Duration> {
    if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
        return Err(PyValueError::new_err(format!(
            "{what} = {v} s is out of range"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A client of the pagewire KV page store; with ``segment_size > 0`` also a storage node.
///
/// ``StoreClient(master, *, listen="0.0.0.0:0", transport="auto", device=None,
/// segment_size=0, timeout=30.0, connect_timeout=10.0, token=None, local_copy=True)``
/// joins the store at ``master`` (``host:port``) or raises :class:`StoreError`. One token
/// guards the master link, this client's engine and its segment: ``token``, else
/// ``PAGEWIRE_TOKEN``; both set and different raise :class:`StoreError` (code -600).
#[pyclass(frozen, module = "pagewire._native", name = "StoreClient")]
pub(crate) struct StoreClient {
    inner: pagewire_store::StoreClient,
    closed: AtomicBool,
}

impl StoreClient {
    fn client(&self) -> PyResult<&pagewire_store::StoreClient> {
        if self.closed.load(Ordering::Acquire) {
            return Err(closed());
        }
        Ok(&self.inner)
    }
}

#[pymethods]
impl StoreClient {
    #[new]
    #[pyo3(signature = (master, *, listen = "0.0.0.0:0", transport = "auto", device = None,
        segment_size = 0, timeout = 30.0, connect_timeout = 10.0, token = None, local_copy = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        master: &str,
        listen: &str,
        transport: &str,
        device: Option<String>,
        segment_size: u64,
        timeout: f64,
        connect_timeout: f64,
        token: Option<String>,
        local_copy: bool,
    ) -> PyResult<Self> {
        let listen = listen
            .parse()
            .map_err(|e| PyValueError::new_err(format!("listen {listen:?}: {e}")))?;
        let mut b = EngineConfig::builder()
            .with_env()
            .map_err(|e| store_err(py, e.into()))?
            .backend(backend_of(transport)?)
            .listen(listen);
        if let Some(d) = device.filter(|d| !d.is_empty()) {
            b = b.rdma_device(d);
        }
        let mut cfg = client_config(py, master, connect_timeout)?;
        cfg.engine = b.build().map_err(|e| store_err(py, e.into()))?;
        cfg.segment_size = segment_size;
        cfg.timeout = secs(timeout, "timeout")?;
        cfg.connect_timeout = secs(connect_timeout, "connect_timeout")?;
        cfg.token = token;
        cfg.local_copy = local_copy;
        let inner = py
            .detach(move || pagewire_store::StoreClient::connect(cfg))
            .map_err(|e| store_err(py, e))?;
        Ok(StoreClient {
            inner,
            closed: AtomicBool::new(false),
        })
    }

    /// ``StoreClient.sharing(master, engine, *, segment_size=0, timeout=30.0,
    /// connect_timeout=10.0, local_copy=True)``: joins the store on the transport engine of
    /// an initialized :class:`pagewire.mooncake_compat.TransferEngine` (its port, its
    /// backend and its token, which also guards the master link) instead of opening one.
    /// The segment is registered on that engine and deregistered when this client closes;
    /// the engine stays the caller's.
    #[staticmethod]
    #[pyo3(signature = (master, engine, *, segment_size = 0, timeout = 30.0,
        connect_timeout = 10.0, local_copy = true))]
    fn sharing(
        py: Python<'_>,
        master: &str,
        engine: &Bound<'_, crate::compat::MooncakeEngine>,
        segment_size: u64,
        timeout: f64,
        connect_timeout: f64,
        local_copy: bool,
    ) -> PyResult<Self> {
        let Some(transport) = engine.get().transport_engine() else {
            return Err(PyValueError::new_err(
                "the engine is not initialized: call initialize() first",
            ));
        };
        let mut cfg = client_config(py, master, connect_timeout)?;
        cfg.engine = transport.config().clone();
        cfg.segment_size = segment_size;
        cfg.timeout = secs(timeout, "timeout")?;
        cfg.connect_timeout = secs(connect_timeout, "connect_timeout")?;
        cfg.local_copy = local_copy;
        let inner = py
            .detach(move || pagewire_store::StoreClient::with_engine(transport, cfg))
            .map_err(|e| store_err(py, e))?;
        Ok(StoreClient {
            inner,
            closed: AtomicBool::new(false),
        })
    }

    /// ``host:port`` of this client's transport engine (what other clients connect to;
    /// Mooncake's ``get_hostname``).
    #[getter]
    fn endpoint(&self) -> String {
        self.inner.endpoint().to_string()
    }

    /// The transport in use: ``"verbs"``, ``"tcp"`` or ``"loopback"``.
    #[getter]
    fn transport(&self) -> String {
        self.inner.engine().backend_kind().to_string()
    }

    /// ``(address, size)`` of the segment this client contributes, or ``None``.
    #[getter]
    fn segment(&self) -> Option<(u64, u64)> {
        self.inner.segment()
    }

    /// The read lease the master grants, in seconds.
    #[getter]
    fn lease_ttl(&self) -> Option<f64> {
        self.inner.lease_ttl().map(|d| d.as_secs_f64())
    }

    /// Registers ``[ptr, ptr+size)`` (memory of this process, readable and writable, that
    /// stays allocated until :meth:`unregister_buffer` or :meth:`close`) as memory puts
    /// read from and gets write into. Raises :class:`StoreError` (code -600) for a size
    /// of 0, unmapped memory or a buffer registered twice.
    fn register_buffer(&self, py: Python<'_>, ptr: u64, size: u64) -> PyResult<()> {
        let c = self.client()?;
        if size == 0 || !mapped_rw(ptr, size) {
            return Err(store_err(
                py,
                SErr::InvalidArgument {
                    what: format!(
                        "{ptr:#x}+{size} is empty or not mapped read-write in this process"
                    ),
                },
            ));
        }
        let c = c.clone();
        // SAFETY: the range is mapped read-write now (checked above); the caller keeps it
        // so until unregister_buffer or close (this method's documented contract, the same
        // as Mooncake's register_buffer).
        py.detach(move || unsafe { c.register_buffer(ptr as *mut u8, size as usize) })
            .map_err(|e| store_err(py, e))
    }

    /// Deregisters the buffer starting at ``ptr`` (waiting for transfers that use it).
    fn unregister_buffer(&self, py: Python<'_>, ptr: u64) -> PyResult<()> {
        let c = self.client()?.clone();
        py.detach(move || c.unregister_buffer(ptr as *mut u8))
            .map_err(|e| store_err(py, e))
    }

    /// Stores ``keys[i]`` as the concatenation of the buffers ``ptrs[i]`` / ``sizes[i]``
    /// (lists of lists). Per key: ``0``, or a negative code (``-705`` exists, ``-200``
    /// no space, ``-600`` bad or unregistered buffer, ``-800`` transfer failed).
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
        let c = self.client()?.clone();
        let keys = keys_of(keys)?;
        let parts = parts_of(ptrs, sizes)?;
        let opts = put_options(replicas, pin, preferred)?;
        let r = py
            .detach(move || c.put(&keys, &parts, &opts))
            .map_err(|e| store_err(py, e))?;
        Ok(codes(r))
    }

    /// Reads ``keys[i]`` into the buffers ``ptrs[i]`` / ``sizes[i]`` (filled in order).
    /// Per key: the object's size, or a negative code (``-704`` missing, ``-600`` buffers
    /// too small or unregistered, ``-800`` transfer failed, ``-707`` lease expired).
    fn get(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let c = self.client()?.clone();
        let keys = keys_of(keys)?;
        let parts = parts_of(ptrs, sizes)?;
        let r = py
            .detach(move || c.get(&keys, &parts))
            .map_err(|e| store_err(py, e))?;
        Ok(per_key(r, |n| n as i64))
    }

    /// Per key: ``1`` exists, ``0`` not, negative on error. Leases what it finds (as
    /// Mooncake's ``is_exist`` does).
    fn exist(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let c = self.client()?.clone();
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.exist(&keys))
            .map_err(|e| store_err(py, e))?;
        Ok(per_key(r, |b| b as i64))
    }

    /// Per key: ``(size, [(segment, endpoint, address), ...])`` or a negative code.
    #[pyo3(signature = (keys, *, lease = false))]
    fn query(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, lease: bool) -> PyResult<Py<PyList>> {
        let c = self.client()?.clone();
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.query(&keys, lease))
            .map_err(|e| store_err(py, e))?;
        let out = PyList::empty(py);
        for item in r {
            match item {
                Ok(l) => {
                    let reps: Vec<(u64, String, u64)> = l
                        .replicas
                        .iter()
                        .map(|t| (t.segment, t.endpoint.to_string(), t.addr))
                        .collect();
                    out.append((l.size, reps))?;
                }
                Err(c) => out.append(c.as_i32())?,
            }
        }
        Ok(out.unbind())
    }

    /// Per key: ``0``, ``-704`` missing, ``-706`` leased (without ``force``), ``-703``
    /// being written.
    #[pyo3(signature = (keys, force = false))]
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, force: bool) -> PyResult<Vec<i64>> {
        let c = self.client()?.clone();
        let keys = keys_of(keys)?;
        let r = py
            .detach(move || c.remove(&keys, force))
            .map_err(|e| store_err(py, e))?;
        Ok(r.into_iter().map(|c| c.as_i32() as i64).collect())
    }

    /// Removes every complete object (not leased unless ``force``); returns how many.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        let c = self.client()?.clone();
        py.detach(move || c.remove_all(force))
            .map_err(|e| store_err(py, e))
    }

    /// Removes every complete object whose key matches ``pattern`` (a regular expression
    /// searched anywhere in the key; not leased unless ``force``); returns how many.
    #[pyo3(signature = (pattern, force = false))]
    fn remove_matching(&self, py: Python<'_>, pattern: &str, force: bool) -> PyResult<u64> {
        let c = self.client()?.clone();
        let pattern = pattern.to_owned();
        py.detach(move || c.remove_matching(&pattern, force))
            .map_err(|e| store_err(py, e))
    }

    /// The master's counts, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.client()?.clone();
        let s = py.detach(move || c.stats()).map_err(|e| store_err(py, e))?;
        let d = PyDict::new(py);
        d.set_item("clients", s.clients)?;
        d.set_item("segments", s.segments)?;
        d.set_item("objects", s.objects)?;
        d.set_item("pending", s.pending)?;
        d.set_item("capacity", s.capacity)?;
        d.set_item("used", s.used)?;
        d.set_item("evicted", s.evicted)?;
        d.set_item("reclaimed", s.reclaimed)?;
        Ok(d)
    }

    /// Whether the master answers within ``timeout`` seconds.
    #[pyo3(signature = (timeout = 2.0))]
    fn ping(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let c = self.client()?.clone();
        let t = secs(timeout, "timeout")?;
        Ok(py.detach(move || c.ping(t)).is_ok())
    }

    /// Leaves the store (the master unmounts this client's segment). Idempotent.
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

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "StoreClient(master={:?}, endpoint={:?}, transport={:?}, segment={:?})",
            self.inner.master(),
            self.inner.endpoint(),
            self.inner.engine().backend_kind().to_string(),
            self.inner.segment().map(|s| s.1)
        )
    }
}

/// A store master running in this process (threads; the GIL is not held).
///
/// ``StoreMaster(listen="127.0.0.1:50051", *, lease_ttl=10.0, client_ttl=10.0,
/// heartbeat=1.0, high_watermark=0.9, evict_ratio=0.05, token=None, ha=None,
/// cluster_id="default", ha_lease=5.0, shards=1, shard=0)``; port 0 picks a free one (see
/// :attr:`address`). With ``ha="etcd://h:p;h:p"`` the master campaigns through etcd with
/// the others of ``cluster_id`` and answers only while it leads (:attr:`leading`);
/// clients given the same ``etcd://`` address follow the leader. With ``shards=S,
/// shard=i`` it campaigns in leader group ``i`` of a cluster whose keys are split over
/// ``S`` groups (a different ``S`` already written in etcd is refused); clients route by
/// key. :meth:`shutdown` stops it.
#[pyclass(frozen, module = "pagewire._native", name = "StoreMaster")]
pub(crate) struct StoreMaster {
    inner: MasterKind,
}

/// A master on its own, or one elected through etcd.
enum MasterKind {
    One(pagewire_store::Master),
    Elected(pagewire_ha::HaMaster),
}

#[pymethods]
impl StoreMaster {
    #[new]
    #[pyo3(signature = (listen = "127.0.0.1:50051", *, lease_ttl = 10.0, client_ttl = 10.0,
        heartbeat = 1.0, high_watermark = 0.9, evict_ratio = 0.05, token = None, ha = None,
        cluster_id = "default", ha_lease = 5.0, shards = 1, shard = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        lease_ttl: f64,
        client_ttl: f64,
        heartbeat: f64,
        high_watermark: f64,
        evict_ratio: f64,
        token: Option<String>,
        ha: Option<String>,
        cluster_id: &str,
        ha_lease: f64,
        shards: usize,
        shard: usize,
    ) -> PyResult<Self> {
        let mut cfg = pagewire_store::MasterConfig {
            listen: listen
                .parse()
                .map_err(|e| PyValueError::new_err(format!("listen {listen:?}: {e}")))?,
            token: token.map(String::into_bytes),
            ..pagewire_store::MasterConfig::default()
        };
        let ms = |v: f64, what: &str| secs(v, what).map(|d| d.as_millis() as u64);
        cfg.core.lease_ttl_ms = ms(lease_ttl, "lease_ttl")?;
        cfg.core.client_ttl_ms = ms(client_ttl, "client_ttl")?;
        cfg.core.heartbeat_ms = ms(heartbeat, "heartbeat")?;
        cfg.core.high_watermark = high_watermark;
        cfg.core.evict_ratio = evict_ratio;
        if ha.is_none() && (shards, shard) != (1, 0) {
            return Err(PyValueError::new_err(
                "shards and shard need ha: shards are leader groups on etcd",
            ));
        }
        let inner = match ha {
            None => MasterKind::One(
                py.detach(move || pagewire_store::Master::start(cfg))
                    .map_err(|e| store_err(py, e))?,
            ),
            Some(etcd) => {
                let mut h = pagewire_ha::HaConfig::new(etcd);
                h.cluster_id = cluster_id.to_string();
                h.lease_ttl = secs(ha_lease, "ha_lease")?;
                MasterKind::Elected(
                    py.detach(move || pagewire_ha::HaMaster::start_shard(cfg, h, shards, shard))
                        .map_err(|e| store_err(py, e.into()))?,
                )
            }
        };
        Ok(StoreMaster { inner })
    }

    /// ``host:port`` clients connect to.
    #[getter]
    fn address(&self) -> String {
        match &self.inner {
            MasterKind::One(m) => m.local_addr().to_string(),
            MasterKind::Elected(m) => m.local_addr().to_string(),
        }
    }

    /// Whether this master answers clients: always on its own; with ``ha``, while it
    /// leads.
    #[getter]
    fn leading(&self) -> bool {
        match &self.inner {
            MasterKind::One(_) => true,
            MasterKind::Elected(m) => matches!(m.role(), pagewire_ha::Role::Leader(_)),
        }
    }

    /// Counts, as :meth:`StoreClient.stats` (a standby's are those of an empty master).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = match &self.inner {
            MasterKind::One(m) => m.stats(),
            MasterKind::Elected(m) => m.stats().unwrap_or_default(),
        };
        let d = PyDict::new(py);
        for (k, v) in [
            ("clients", s.clients),
            ("segments", s.segments),
            ("objects", s.objects),
            ("pending", s.pending),
            ("capacity", s.capacity),
            ("used", s.used),
            ("evicted", s.evicted),
            ("reclaimed", s.reclaimed),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Stops the master and closes its connections. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| match &self.inner {
            MasterKind::One(m) => m.shutdown(),
            MasterKind::Elected(m) => m.shutdown(),
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) {
        self.shutdown(py);
    }

    fn __repr__(&self) -> String {
        format!("StoreMaster(address={:?})", self.address())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StoreClient>()?;
    m.add_class::<StoreMaster>()?;
    let err = m.py().get_type::<StoreError>();
    // Re-exported by `pagewire.errors`, like every other pagewire exception.
    err.setattr("__module__", "pagewire.errors")?;
    m.add("StoreError", err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_check_finds_our_own_memory_only() {
        let v = vec![0u8; 1 << 20];
        assert!(mapped_rw(v.as_ptr() as u64, v.len() as u64));
        assert!(!mapped_rw(0, 4096));
        assert!(!mapped_rw(u64::MAX - 10, 100));
        assert!(!mapped_rw(0x10, 16));
    }
}
