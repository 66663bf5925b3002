//! Mooncake's `transfer_engine_c.h`: its types (`#[repr(C)]`, byte-identical; checked
//! against the header by a C compiler in `tests/c_abi.rs`) and its 27 functions.
//!
//! Return conventions are Mooncake's: `int` functions return 0 or a negative `ERR_*`;
//! `submitTransfer`, `submitTransferWithNotify`, `getTransferStatus` and `freeBatchID`
//! return a positive status code (0 = OK); `allocateBatchID` returns `INVALID_BATCH` on
//! failure; `createTransferEngine` returns NULL. Where Mooncake would crash (an unknown
//! or freed handle, a null pointer), these return an error. `pw_last_error()` from
//! `pagewire.h` tells why the last call on the thread failed.
//!
//! The engine itself is `pagewire_mooncake::TransferEngine`; this module reads C's
//! arguments, keeps the engine handles, and spells `pagewire_mooncake::Code` as the
//! function's convention asks.
#![allow(non_snake_case, non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex};

use pagewire_mooncake::{
    Code, Error, MAX_BATCH_SIZE, Opcode, Options, Request, TransferEngine, TransferStatus,
};
use pagewire_transport::{BackendKind, EngineConfig};

use super::{bytes_arg, guard, slice_arg, str_arg, write_cstr};
use crate::handles::HandleTable;

/// `segment_id_t` / `segment_handle_t` (macros for `int32_t` in the header).
pub type segment_id_t = i32;
/// `batch_id_t` (a macro for `uint64_t` in the header).
pub type batch_id_t = u64;
/// `transfer_engine_t`: an opaque handle (a table token here, not a pointer).
pub type transfer_engine_t = *mut c_void;
/// `transport_t`: opaque.
pub type transport_t = *mut c_void;

/// `LOCAL_SEGMENT`.
pub const LOCAL_SEGMENT: segment_id_t = 0;
/// `INVALID_BATCH`.
pub const INVALID_BATCH: batch_id_t = u64::MAX;
/// `OPCODE_READ`.
pub const OPCODE_READ: c_int = 0;
/// `OPCODE_WRITE`.
pub const OPCODE_WRITE: c_int = 1;
/// `STATUS_WAITING`.
pub const STATUS_WAITING: c_int = 0;
/// `STATUS_PENDING`.
pub const STATUS_PENDING: c_int = 1;
/// `STATUS_INVALID`.
pub const STATUS_INVALID: c_int = 2;
/// `STATUS_CANCELED`.
pub const STATUS_CANCELED: c_int = 3;
/// `STATUS_COMPLETED`.
pub const STATUS_COMPLETED: c_int = 4;
/// `STATUS_TIMEOUT`.
pub const STATUS_TIMEOUT: c_int = 5;
/// `STATUS_FAILED`.
pub const STATUS_FAILED: c_int = 6;

/// `struct transfer_request`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct transfer_request {
    /// `OPCODE_READ` or `OPCODE_WRITE`.
    pub opcode: c_int,
    /// Local address (inside memory registered on this engine).
    pub source: *mut c_void,
    /// Target segment (from `openSegment`, or `LOCAL_SEGMENT`).
    pub target_id: segment_id_t,
    /// Remote address: the peer's virtual address, as Mooncake uses it.
    pub target_offset: u64,
    /// Bytes.
    pub length: u64,
}

/// `struct notify_msg`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct notify_msg {
    /// Sender's name (NUL-terminated).
    pub name: *mut c_char,
    /// Message (NUL-terminated).
    pub msg: *mut c_char,
}

/// `struct transfer_status`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct transfer_status {
    /// `STATUS_*`.
    pub status: c_int,
    /// Bytes moved (the task's length once completed).
    pub transferred_bytes: u64,
}

/// The `rdma` member of `segment_desc`'s union.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct segment_desc_rdma {
    /// Buffer address.
    pub addr: *mut c_void,
    /// Buffer size.
    pub size: u64,
    /// Location string.
    pub location: *const c_char,
}

/// The `nvmeof` member of `segment_desc`'s union.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct segment_desc_nvmeof {
    /// File path.
    pub file_path: *const c_char,
    /// Subsystem name.
    pub subsystem_name: *const c_char,
    /// Protocol.
    pub proto: *const c_char,
    /// IP.
    pub ip: *const c_char,
    /// Port.
    pub port: u64,
}

/// `segment_desc`'s anonymous union `desc_`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union segment_desc_union {
    /// RDMA form.
    pub rdma: segment_desc_rdma,
    /// NVMe-oF form.
    pub nvmeof: segment_desc_nvmeof,
}

impl std::fmt::Debug for segment_desc_union {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("segment_desc_union { .. }")
    }
}

/// `struct segment_desc` (declared by the header; no function takes it).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct segment_desc {
    /// RDMA / NVMe-oF.
    pub type_: c_int,
    /// The description.
    pub desc_: segment_desc_union,
}

/// `struct buffer_entry`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct buffer_entry {
    /// Start.
    pub addr: *mut c_void,
    /// Length.
    pub length: usize,
}

/// `struct nic_load_stat`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nic_load_stat {
    /// Device name, NUL-terminated.
    pub device_name: [c_char; 64],
    /// Bytes in flight.
    pub inflight_bytes: u64,
    /// Smoothed bandwidth.
    pub ewma_bandwidth_bps: f64,
}

/// `notify_msg_t`.
pub type notify_msg_t = notify_msg;
/// `transfer_request_t`.
pub type transfer_request_t = transfer_request;
/// `transfer_status_t`.
pub type transfer_status_t = transfer_status;
/// `buffer_entry_t`.
pub type buffer_entry_t = buffer_entry;
/// `segment_desc_t`.
pub type segment_desc_t = segment_desc;
/// `nic_load_stat_t`.
pub type nic_load_stat_t = nic_load_stat;

// ---------------------------------------------------------------------------- engines

static ENGINES: Mutex<HandleTable<Arc<TransferEngine>>> = Mutex::new(HandleTable::new(0x7077));

fn engines() -> std::sync::MutexGuard<'static, HandleTable<Arc<TransferEngine>>> {
    ENGINES.lock().unwrap_or_else(|p| p.into_inner())
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(Code::InvalidArgument, msg)
}

/// The engine behind a handle; an unknown, forged or destroyed one is an error.
fn engine(e: transfer_engine_t) -> Result<Arc<TransferEngine>, Error> {
    engines()
        .get(e as usize as u64)
        .cloned()
        .ok_or_else(|| invalid("unknown or destroyed transfer_engine_t"))
}

/// Records a failure as the thread's last error and gives its code.
fn failed(e: &Error) -> Code {
    crate::set_last_error(e);
    e.code()
}

/// An `int` function: 0, or the code as a negative `ERR_*`.
fn int_fn(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    guard(Code::Context.err(), || {
        f().map_or_else(|e| failed(&e).err(), |()| 0)
    })
}

/// A `Status` function: 0, or the code as a positive status.
fn status_fn(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    guard(Code::Context.status(), || {
        f().map_or_else(|e| failed(&e).status(), |()| 0)
    })
}

/// `Ok` when the output fitted (`write_cstr`'s answer).
fn fitted(ok: bool) -> Result<(), Error> {
    if ok {
        Ok(())
    } else {
        Err(invalid("the output buffer is null or too small"))
    }
}

/// The C API's engine options: the transport picks the backend (auto-discovery), the
/// handshake timeout is the transport's, `PAGEWIRE_LISTEN` pins the listener.
fn c_options() -> Result<Options, Error> {
    let listen = match std::env::var_os("PAGEWIRE_LISTEN") {
        Some(_) => Some(
            EngineConfig::builder()
                .with_env()
                .and_then(|b| b.build())
                .map_err(|e| Error::transport("configuration", e))?
                .listen,
        ),
        None => None,
    };
    Ok(Options {
        listen,
        handshake_timeout: None,
        ..Options::default()
    })
}

/// The engine for a metadata address: through `pagewire-ha` when it is built in (etcd).
fn new_engine(meta: &str, local: &str, o: Options) -> Result<TransferEngine, Error> {
    #[cfg(feature = "etcd")]
    return pagewire_ha::new_engine(meta, local, o);
    #[cfg(not(feature = "etcd"))]
    return TransferEngine::new(meta, local, o);
}

/// Creates an engine. `metadata_conn_string`: `"P2PHANDSHAKE"`, where
/// `local_server_name` gives the host (an IP or a name, any `:port` is ignored as in
/// Mooncake's P2P mode) and the segment name is `host:port`; or `"etcd://h:p[;h:p]"`
/// (the `etcd` feature, on by default), where `local_server_name` is the segment name,
/// published in etcd until `destroyTransferEngine`, and its host part the listener's
/// host. `ip_or_host_name`, `rpc_port` and `auto_discover` are ignored:
/// the backend is verbs when an RDMA device is usable, TCP otherwise
/// (`PAGEWIRE_TRANSPORT` or `MC_FORCE_TCP` choose). NULL on failure.
///
/// # Safety
/// String arguments are null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn createTransferEngine(
    metadata_conn_string: *const c_char,
    local_server_name: *const c_char,
    ip_or_host_name: *const c_char,
    rpc_port: u64,
    auto_discover: c_int,
) -> transfer_engine_t {
    let _ = (ip_or_host_name, rpc_port, auto_discover);
    guard(std::ptr::null_mut(), || {
        // SAFETY: per this function's contract.
        let (Some(meta), Some(local)) = (unsafe { str_arg(metadata_conn_string) }, unsafe {
            str_arg(local_server_name)
        }) else {
            crate::set_last_error("createTransferEngine: null or non-UTF-8 string argument");
            return std::ptr::null_mut();
        };
        let made = c_options().and_then(|o| new_engine(meta, local, o));
        match made.map(|te| engines().insert(Arc::new(te))) {
            Ok(Some(token)) => token as usize as transfer_engine_t,
            // The engine was dropped, which closed it.
            Ok(None) => {
                crate::set_last_error("createTransferEngine: too many engines");
                std::ptr::null_mut()
            }
            Err(e) => {
                crate::set_last_error(format_args!("createTransferEngine: {e}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// Nothing to discover (the backend was chosen at creation): 0 for a live engine.
///
/// # Safety
/// None beyond passing what `createTransferEngine` returned (anything else is refused).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn discoverTopology(engine_: transfer_engine_t) -> c_int {
    int_fn(|| engine(engine_).map(drop))
}

/// Writes this engine's handshake address `host:port` into `buf_out` (in P2P mode also
/// its segment name, what peers pass to `openSegment`). -1 if the engine is unknown, `buf_out` is null, or the name did not
/// fit (it is then truncated, as `snprintf` would).
///
/// # Safety
/// `buf_out` is null or valid for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getLocalIpAndPort(
    engine_: transfer_engine_t,
    buf_out: *mut c_char,
    buf_len: usize,
) -> c_int {
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        fitted(unsafe { write_cstr(buf_out, buf_len, te.rpc_name()) })
    })
}

fn proto_matches(te: &TransferEngine, proto: &str) -> bool {
    matches!(
        (te.backend_kind(), proto),
        (BackendKind::Verbs, "rdma") | (BackendKind::Tcp, "tcp")
    )
}

/// The engine and `proto` when `proto` names its backend (which is fixed at creation).
///
/// # Safety
/// `proto` is null or NUL-terminated.
unsafe fn installed(engine_: transfer_engine_t, proto: *const c_char) -> Result<(), Error> {
    let te = engine(engine_)?;
    // SAFETY: per this function's contract.
    match unsafe { str_arg(proto) } {
        Some(p) if proto_matches(&te, p) => Ok(()),
        _ => Err(invalid(format!(
            "this engine runs {} (\"rdma\" names verbs, \"tcp\" TCP)",
            te.backend_kind()
        ))),
    }
}

/// The backend is fixed at creation: returns a non-null handle when `proto` names it
/// (`"rdma"` for verbs, `"tcp"`), NULL otherwise.
///
/// # Safety
/// `proto` is null or NUL-terminated; `args` is not read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn installTransport(
    engine_: transfer_engine_t,
    proto: *const c_char,
    args: *mut *mut c_void,
) -> transport_t {
    let _ = args;
    guard(std::ptr::null_mut(), || {
        // SAFETY: per this function's contract.
        match unsafe { installed(engine_, proto) } {
            Ok(()) => engine_,
            Err(e) => {
                crate::set_last_error(format_args!("installTransport: {e}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// 0 when `proto` names the engine's backend (which stays until destruction), -1
/// otherwise.
///
/// # Safety
/// `proto` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn uninstallTransport(
    engine_: transfer_engine_t,
    proto: *const c_char,
) -> c_int {
    // SAFETY: per this function's contract.
    int_fn(|| unsafe { installed(engine_, proto) })
}

/// `openSegment` and `openSegmentNoCache`.
///
/// # Safety
/// `segment_name` is null or NUL-terminated.
unsafe fn open(
    engine_: transfer_engine_t,
    segment_name: *const c_char,
    refresh: bool,
) -> segment_id_t {
    guard(Code::Context.err(), || {
        // SAFETY: per this function's contract.
        let name = unsafe { str_arg(segment_name) };
        let opened = engine(engine_).and_then(|te| {
            te.open_segment(
                name.ok_or_else(|| invalid("segment name is null or not UTF-8"))?,
                refresh,
            )
        });
        opened.unwrap_or_else(|e| failed(&e).err())
    })
}

/// Connects to the engine whose segment name is `segment_name` (`host:port`, `[v6]:port`;
/// with etcd, the name it registered) and returns its segment id (> 0; this engine's own
/// name gives `LOCAL_SEGMENT`). The same name returns the same id while the connection
/// lives. Negative `ERR_*` on failure (-1 malformed or, with etcd, not registered, -101
/// name not resolved, -102 unreachable, -104 handshake refused, -200 etcd failed),
/// within the handshake timeout (the etcd lookup has as long again).
///
/// # Safety
/// `segment_name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openSegment(
    engine_: transfer_engine_t,
    segment_name: *const c_char,
) -> segment_id_t {
    // SAFETY: per this function's contract.
    unsafe { open(engine_, segment_name, false) }
}

/// `openSegment`, fetching the peer's registered buffers again if already connected.
///
/// # Safety
/// `segment_name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openSegmentNoCache(
    engine_: transfer_engine_t,
    segment_name: *const c_char,
) -> segment_id_t {
    // SAFETY: per this function's contract.
    unsafe { open(engine_, segment_name, true) }
}

/// Disconnects from a segment; its pending transfers fail. -1 for an unknown id.
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn closeSegment(
    engine_: transfer_engine_t,
    segment_id: segment_id_t,
) -> c_int {
    int_fn(|| engine(engine_)?.close_segment(segment_id))
}

/// `Ok` for a live engine and a non-null segment name.
fn live_and_named(engine_: transfer_engine_t, segment_name: *const c_char) -> Result<(), Error> {
    engine(engine_)?;
    if segment_name.is_null() {
        return Err(invalid("segment name is null"));
    }
    Ok(())
}

/// No EFA here: 0 for a live engine and a non-null name, as Mooncake off EFA.
///
/// # Safety
/// `segment_name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warmupEfaSegment(
    engine_: transfer_engine_t,
    segment_name: *const c_char,
) -> c_int {
    int_fn(|| live_and_named(engine_, segment_name))
}

/// With etcd, withdraws this engine's own segment name from etcd (peers can no longer
/// open it; connections already open stay); any other name, and P2P mode (no metadata
/// store), do nothing. 0 for a live engine and a non-null name.
///
/// # Safety
/// `segment_name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn removeLocalSegment(
    engine_: transfer_engine_t,
    segment_name: *const c_char,
) -> c_int {
    int_fn(|| {
        live_and_named(engine_, segment_name)?;
        // SAFETY: per this function's contract (checked non-null above).
        let name =
            unsafe { str_arg(segment_name) }.ok_or_else(|| invalid("segment name is not UTF-8"))?;
        engine(engine_)?.remove_local_segment(name)
    })
}

/// Destroys an engine: lets go of every registered buffer (waiting up to 1 s for
/// transfers that still use one), closes every connection, fails pending batches. The
/// handle is dead afterwards; destroying it again does nothing.
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn destroyTransferEngine(engine_: transfer_engine_t) {
    guard((), || {
        let te = engines().remove(engine_ as usize as u64);
        if let Some(te) = te {
            te.close();
        }
    })
}

/// Registers `[addr, addr+length)`. `remote_accessible` non-zero exposes it to peers for
/// READ and WRITE. 0, -1 (null, zero length, not host memory on TCP), -7 (overlaps a
/// registered buffer, including the same one twice), or the backend's failure.
///
/// # Safety
/// The buffer stays allocated until it is unregistered or the engine destroyed.
/// `location` is null or NUL-terminated (it is not used).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn registerLocalMemory(
    engine_: transfer_engine_t,
    addr: *mut c_void,
    length: usize,
    location: *const c_char,
    remote_accessible: c_int,
) -> c_int {
    let _ = location;
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: the buffer stays allocated while registered (this function's contract).
        unsafe { te.register(addr as u64, length as u64, remote_accessible != 0) }
    })
}

/// Unregisters the buffer that starts at `addr`. -3 if none does; -4 if transfers still
/// use it after waiting 1 s for them.
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn unregisterLocalMemory(
    engine_: transfer_engine_t,
    addr: *mut c_void,
) -> c_int {
    int_fn(|| engine(engine_)?.unregister(addr as u64))
}

/// Reads a C array argument; a null (or misaligned) one with entries is an error.
///
/// # Safety
/// `p` is null or valid for `n` reads of `T`.
unsafe fn array<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Error> {
    // SAFETY: per this function's contract.
    unsafe { slice_arg(p, n) }.ok_or_else(|| invalid(format!("{what} is null or misaligned")))
}

/// Registers several buffers (remote-accessible). Mooncake's checks over the whole
/// list first (zero length, overlaps inside the list); then all or nothing: on the
/// first failure the ones registered by this call are unregistered and its code
/// returned.
///
/// # Safety
/// `buffer_list` is null or valid for `buffer_len` entries; each buffer as for
/// `registerLocalMemory`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn registerLocalMemoryBatch(
    engine_: transfer_engine_t,
    buffer_list: *mut buffer_entry_t,
    buffer_len: usize,
    location: *const c_char,
) -> c_int {
    let _ = location;
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        let list = unsafe { array(buffer_list.cast_const(), buffer_len, "buffer_list") }?;
        let pairs: Vec<(u64, u64)> = list
            .iter()
            .map(|b| (b.addr as u64, b.length as u64))
            .collect();
        // SAFETY: each buffer stays allocated while registered (this function's contract).
        unsafe { te.register_batch(&pairs, true) }
    })
}

/// Unregisters several buffers; tries all and returns the first failure's code.
///
/// # Safety
/// `addr_list` is null or valid for `addr_len` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn unregisterLocalMemoryBatch(
    engine_: transfer_engine_t,
    addr_list: *mut *mut c_void,
    addr_len: usize,
) -> c_int {
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        let list = unsafe { array(addr_list.cast_const(), addr_len, "addr_list") }?;
        let addrs: Vec<u64> = list.iter().map(|&a| a as u64).collect();
        te.unregister_batch(&addrs)
    })
}

/// A batch id for up to `batch_size` transfer requests; `INVALID_BATCH` for an unknown
/// engine, a size of 0 or above 2^20, or too many live batches.
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn allocateBatchID(
    engine_: transfer_engine_t,
    batch_size: usize,
) -> batch_id_t {
    guard(INVALID_BATCH, || {
        match engine(engine_).and_then(|te| te.allocate_batch(batch_size)) {
            Ok(id) => id,
            Err(e) => {
                failed(&e);
                INVALID_BATCH
            }
        }
    })
}

/// Reads the requests of a submit; `Err` for null entries, a bad opcode or an absurd
/// count.
///
/// # Safety
/// `entries` is null or valid for `count` reads.
unsafe fn requests(entries: *const transfer_request, count: usize) -> Result<Vec<Request>, Error> {
    if count > MAX_BATCH_SIZE {
        return Err(Error::new(
            Code::TooManyRequests,
            format!("{count} requests (at most {MAX_BATCH_SIZE})"),
        ));
    }
    // SAFETY: per this function's contract.
    let list = unsafe { array(entries, count, "entries") }?;
    list.iter()
        .enumerate()
        .map(|(i, r)| {
            Ok(Request {
                opcode: Opcode::try_from(i64::from(r.opcode))
                    .map_err(|e| invalid(format!("request {i}: {e}")))?,
                source: r.source as u64,
                target_id: r.target_id,
                target_offset: r.target_offset,
                length: r.length,
            })
        })
        .collect()
}

/// Posts `count` requests into a batch. Returns a status code: 0, 1 (unknown engine or
/// batch, null entries, bad opcode, unknown segment, overflow), 2 (over the batch's
/// capacity), 3 (a local range outside registered memory, or a remote range outside the
/// peer's registered buffers), 102 (peer gone). Every request is checked before any is
/// posted; on error nothing moves and the batch is unchanged.
///
/// # Safety
/// `entries` is null or valid for `count` requests; their `source` ranges lie in memory
/// registered on this engine (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn submitTransfer(
    engine_: transfer_engine_t,
    batch_id: batch_id_t,
    entries: *mut transfer_request,
    count: usize,
) -> c_int {
    status_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        let reqs = unsafe { requests(entries, count) }?;
        te.submit(batch_id, &reqs, None)
    })
}

/// The strings of a `notify_msg` (any bytes but NUL); null ones are an error.
///
/// # Safety
/// `m`'s strings are null or NUL-terminated and outlive `'a`.
unsafe fn note<'a>(m: &notify_msg_t) -> Result<(&'a [u8], &'a [u8]), Error> {
    // SAFETY: per this function's contract.
    match (unsafe { bytes_arg(m.name) }, unsafe { bytes_arg(m.msg) }) {
        (Some(n), Some(s)) => Ok((n, s)),
        _ => Err(invalid("notify_msg: null name or msg")),
    }
}

/// `submitTransfer`, then `notify_msg` is delivered to the target after all of the
/// data (every request must target one segment). `name` and `msg` together may hold up
/// to 8176 bytes.
///
/// # Safety
/// As `submitTransfer`; `notify_msg`'s strings are null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn submitTransferWithNotify(
    engine_: transfer_engine_t,
    batch_id: batch_id_t,
    entries: *mut transfer_request,
    count: usize,
    notify_msg: notify_msg_t,
) -> c_int {
    status_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        let (name, msg) = unsafe { note(&notify_msg) }?;
        // SAFETY: per this function's contract.
        let reqs = unsafe { requests(entries, count) }?;
        te.submit(batch_id, &reqs, Some((name, msg)))
    })
}

/// Notifications received since the last call: a `malloc`ed array of `*size` entries
/// with `malloc`ed strings (free with `freeNotifsMsgBuf`), or NULL with `*size == 0`.
///
/// # Safety
/// `size` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getNotifsFromEngine(
    engine_: transfer_engine_t,
    size: *mut c_int,
) -> *mut notify_msg_t {
    guard(std::ptr::null_mut(), || {
        if size.is_null() {
            crate::set_last_error("getNotifsFromEngine: size is null");
            return std::ptr::null_mut();
        }
        // SAFETY: `size` is non-null and writable per this function's contract.
        unsafe { *size = 0 };
        let te = match engine(engine_) {
            Ok(te) => te,
            Err(e) => {
                failed(&e);
                return std::ptr::null_mut();
            }
        };
        let notes = te.take_notifications();
        if notes.is_empty() {
            return std::ptr::null_mut();
        }
        let n = notes.len().min(c_int::MAX as usize);
        // SAFETY: plain allocation of `n` entries, checked for null below.
        let arr = unsafe { libc::calloc(n, size_of::<notify_msg_t>()) }.cast::<notify_msg_t>();
        if arr.is_null() {
            crate::set_last_error("getNotifsFromEngine: out of memory (notifications lost)");
            return std::ptr::null_mut();
        }
        for (i, (name, msg)) in notes.iter().take(n).enumerate() {
            let entry = notify_msg {
                name: malloc_cstr(name),
                msg: malloc_cstr(msg),
            };
            // SAFETY: `i < n`, inside the array allocated above.
            unsafe { arr.add(i).write(entry) };
        }
        // SAFETY: as above.
        unsafe { *size = n as c_int };
        arr
    })
}

/// A `malloc`ed NUL-terminated copy of `bytes` (cut at an interior NUL); null if out of
/// memory.
fn malloc_cstr(bytes: &[u8]) -> *mut c_char {
    let n = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    // SAFETY: plain allocation, checked for null.
    let p = unsafe { libc::malloc(n + 1) }.cast::<u8>();
    if !p.is_null() {
        // SAFETY: `p` holds `n + 1` bytes; `bytes` is a distinct Rust slice of >= n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, n);
            *p.add(n) = 0;
        }
    }
    p.cast()
}

/// Frees what `getNotifsFromEngine` returned (`free` on each string and the array).
/// NULL is fine; a negative size is -1.
///
/// # Safety
/// `msg` is null or an array returned by `getNotifsFromEngine` with its `size`, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn freeNotifsMsgBuf(msg: *mut notify_msg_t, size: c_int) -> c_int {
    int_fn(|| {
        if size < 0 {
            return Err(invalid("freeNotifsMsgBuf: negative size"));
        }
        if msg.is_null() {
            return Ok(());
        }
        for i in 0..size as usize {
            // SAFETY: `msg` has `size` entries whose strings came from `malloc` (or are
            // null), per this function's contract.
            unsafe {
                let e = msg.add(i).read();
                libc::free(e.name.cast());
                libc::free(e.msg.cast());
            }
        }
        // SAFETY: the array came from `calloc`.
        unsafe { libc::free(msg.cast()) };
        Ok(())
    })
}

/// Sends a notification alone to segment `target_id` and waits (up to 5 s) until the
/// peer's engine has it. 0 or a negative `ERR_*`.
///
/// # Safety
/// `notify_msg`'s strings are null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn genNotifyInEngine(
    engine_: transfer_engine_t,
    target_id: u64,
    notify_msg: notify_msg_t,
) -> c_int {
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        let (name, msg) = unsafe { note(&notify_msg) }?;
        let target = i32::try_from(target_id)
            .map_err(|_| invalid(format!("segment id {target_id} is out of range")))?;
        te.notify(target, name, msg)
    })
}

/// The status of task `task_id` (the index of a request among all submitted to the
/// batch): `STATUS_WAITING` while pending, `STATUS_COMPLETED`, `STATUS_FAILED` (including
/// a timeout), `STATUS_CANCELED`. Returns 0 and fills `status`, or 1 (unknown engine or
/// batch, freed batch, `INVALID_BATCH`, task out of range, null `status`), leaving
/// `status` untouched. Never blocks.
///
/// # Safety
/// `status` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getTransferStatus(
    engine_: transfer_engine_t,
    batch_id: batch_id_t,
    task_id: usize,
    status: *mut transfer_status,
) -> c_int {
    status_fn(|| {
        let te = engine(engine_)?;
        if status.is_null() {
            return Err(invalid("getTransferStatus: status is null"));
        }
        let t = te.task_status(batch_id, task_id)?;
        let code = match t.status {
            // NIXL's Mooncake backend takes any status other than WAITING, PENDING and
            // FAILED for success: a timeout is reported as a failure.
            TransferStatus::Timeout => STATUS_FAILED,
            s => s as c_int,
        };
        // SAFETY: non-null and writable per this function's contract.
        unsafe {
            status.write(transfer_status {
                status: code,
                transferred_bytes: t.transferred_bytes,
            })
        };
        Ok(())
    })
}

/// Frees a batch id. 0, 1 (unknown, freed or `INVALID_BATCH`), 4 (a task still pending).
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn freeBatchID(engine_: transfer_engine_t, batch_id: batch_id_t) -> c_int {
    status_fn(|| engine(engine_)?.free_batch(batch_id))
}

/// Fetches every open segment's registered buffers again. 0 or the first failure.
///
/// # Safety
/// None beyond passing an engine handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn syncSegmentCache(engine_: transfer_engine_t) -> c_int {
    int_fn(|| engine(engine_)?.sync_segments())
}

/// pagewire keeps no per-NIC load figures: `*count` becomes 0 and nothing is written.
/// -1 for null arguments or an unknown engine.
///
/// # Safety
/// `count` is null or valid for a read and a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getNicLoadStats(
    engine_: transfer_engine_t,
    stats: *mut nic_load_stat_t,
    count: *mut usize,
) -> c_int {
    int_fn(|| {
        engine(engine_)?;
        if stats.is_null() || count.is_null() {
            return Err(invalid("getNicLoadStats: null argument"));
        }
        // SAFETY: non-null and writable per this function's contract.
        unsafe { *count = 0 };
        Ok(())
    })
}

/// Destruction is always graceful here (buffers are released only once no transfer
/// uses them): nothing to enable.
///
/// # Safety
/// None.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn enableGracefulShutdown(engine_: transfer_engine_t) {
    guard((), || {
        if let Err(e) = engine(engine_) {
            failed(&e);
        }
    })
}

/// Describes the engine and its open segments (text, or JSON when `json` is non-zero)
/// into `buf_out`. 0, or -1 for null arguments, an unknown engine, or truncation.
///
/// # Safety
/// `buf_out` is null or valid for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn showLinks(
    engine_: transfer_engine_t,
    buf_out: *mut c_char,
    buf_len: usize,
    json: c_int,
) -> c_int {
    int_fn(|| {
        let te = engine(engine_)?;
        // SAFETY: per this function's contract.
        fitted(unsafe { write_cstr(buf_out, buf_len, &links_text(&te, json != 0)) })
    })
}

fn links_text(te: &TransferEngine, json: bool) -> String {
    let segs = te.segments();
    if json {
        let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        let links: Vec<String> = segs
            .iter()
            .map(|s| {
                format!(
                    "{{\"segment_id\":{},\"name\":\"{}\",\"connected\":{}}}",
                    s.id,
                    esc(&s.name),
                    s.connected
                )
            })
            .collect();
        format!(
            "{{\"local\":\"{}\",\"backend\":\"{}\",\"links\":[{}]}}",
            esc(te.name()),
            te.backend_kind(),
            links.join(",")
        )
    } else {
        let mut s = format!("local {} backend {}\n", te.name(), te.backend_kind());
        for l in &segs {
            s += &format!(
                "segment {} {} {}\n",
                l.id,
                l.name,
                if l.connected { "connected" } else { "idle" }
            );
        }
        s
    }
}
