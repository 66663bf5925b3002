//! `pagewire.h`: pagewire's own C API. Handles are opaque (table tokens behind typed
//! pointers); every function returns a [`PwStatus`] and leaves the reason of a failure in
//! `pw_last_error()`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void};

use super::{guard, slice_arg, str_arg, write_cstr};
pub use crate::native::PwStatus;
use crate::native::{self, PwResult};

/// Handle types C only ever sees pointers to (the pointer is a table token).
macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $(
            $(#[$doc])*
            #[repr(C)]
            #[derive(Debug)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque! {
    /// Opaque engine (`pw_engine`).
    pw_engine;
    /// Opaque registered region (`pw_region`).
    pw_region;
    /// Opaque connected peer (`pw_peer`).
    pw_peer;
    /// Opaque batch (`pw_batch`).
    pw_batch;
}

/// `pw_pool_desc`: a host KV pool (geometry, layout, base addresses).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct pw_pool_desc {
    /// `PW_POOL_MHA` (0), `PW_POOL_MHA_SPLIT` (1), `PW_POOL_MLA` (2).
    pub kind: u32,
    /// `PW_LAYOUT_LAYER_FIRST` (0), `_PAGE_FIRST` (1), `_PAGE_FIRST_DIRECT` (2), `_PAGE_HEAD` (3).
    pub layout: u32,
    /// Layers.
    pub layers: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Heads (MHA kinds; 0 for MLA).
    pub heads: u64,
    /// K head dim (MHA kinds; 0 for MLA).
    pub head_dim: u64,
    /// V head dim (0 = `head_dim`).
    pub v_head_dim: u64,
    /// MLA latent width (0 for MHA kinds).
    pub kv_dim: u64,
    /// Bytes per element.
    pub dtype_bytes: u64,
    /// Token slots (a multiple of `page_size`).
    pub capacity: u64,
    /// Address of the pool (of its K buffer for MHA kinds).
    pub base: u64,
    /// Address of the V buffer, when `has_v_base` is non-zero.
    pub v_base: u64,
    /// Whether `v_base` is given (required for `PW_POOL_MHA_SPLIT`).
    pub has_v_base: u32,
    /// `PW_CHECKS_STRICT` (0) or `PW_CHECKS_SGLANG` (1).
    pub checks: u32,
}

fn status(r: PwResult<()>) -> PwStatus {
    match r {
        Ok(()) => PwStatus::Ok,
        Err(s) => {
            if s != PwStatus::Pending && !crate::has_last_error() {
                crate::set_last_error(s.describe().to_string_lossy());
            }
            s
        }
    }
}

/// Runs an entry point's body: a panic is `PW_ERR_INTERNAL` (see [`guard`]), the result
/// a status.
fn run(f: impl FnOnce() -> PwResult<()>) -> PwStatus {
    guard(PwStatus::Internal, || status(f()))
}

/// Entry points that only hand a handle to `native`: `fn name(handle: type) = function;`.
/// Any handle value is checked, so none has a safety condition beyond the call itself.
macro_rules! handle_calls {
    ($($(#[$doc:meta])* fn $name:ident($h:ident: $ty:ty) = $f:ident;)*) => {
        $(
            $(#[$doc])*
            ///
            /// # Safety
            /// None (any value is checked).
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name($h: *mut $ty) -> PwStatus {
                run(|| native::$f(token($h)))
            }
        )*
    };
}

fn token<T>(p: *const T) -> u64 {
    p as usize as u64
}

fn null_arg<T>(what: &str) -> PwResult<T> {
    PwStatus::InvalidArgument.fail(format_args!("{what} is null"))
}

/// Writes a new handle to `out`.
///
/// # Safety
/// `out` is null (an error) or valid for a write.
unsafe fn put<T>(out: *mut *mut T, r: PwResult<u64>) -> PwResult<()> {
    if out.is_null() {
        return null_arg("out");
    }
    let t = r?;
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { out.write(t as usize as *mut T) };
    Ok(())
}

/// Runs `get` and writes its value to `out`.
///
/// # Safety
/// `out` is null (an error) or valid for a write.
unsafe fn get_into<T>(out: *mut T, what: &str, get: impl FnOnce() -> PwResult<T>) -> PwStatus {
    run(|| {
        let v = get()?;
        // SAFETY: per this function's contract.
        unsafe { put_val(out, what, v) }
    })
}

/// Writes a value to an out-pointer.
///
/// # Safety
/// `out` is null (an error) or valid for a write.
unsafe fn put_val<T>(out: *mut T, what: &str, v: T) -> PwResult<()> {
    if out.is_null() {
        return null_arg(what);
    }
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

// ------------------------------------------------------------------------- handles

handle_calls! {
    /// Shuts an engine down and frees its handle: connections close, pending batches fail,
    /// registrations are released. Handles derived from it report `PW_ERR_SHUTDOWN`.
    fn pw_engine_free(engine: pw_engine) = engine_free;
    /// Fetches the regions the peer exposes again (after it registered more memory).
    fn pw_peer_refresh(peer: pw_peer) = peer_refresh;
    /// Disconnects (the peer's pending batches fail) and frees the handle.
    fn pw_peer_close(peer: pw_peer) = peer_close;
    /// `PW_OK` (done), `PW_PENDING`, or why it failed. Never blocks.
    fn pw_batch_status(batch: pw_batch) = batch_status;
    /// Cancels a running batch (best effort: bytes in flight may still land).
    fn pw_batch_cancel(batch: pw_batch) = batch_cancel;
    /// Empties a batch that is not running (ops, notification, timeout).
    fn pw_batch_reset(batch: pw_batch) = batch_reset;
    /// Frees a batch handle. A running batch carries on to its end.
    fn pw_batch_free(batch: pw_batch) = batch_free;
}

// ------------------------------------------------------------------------- errors

/// A static description of a status (never null; "unknown status" for other values).
/// Takes an `int`, not the enum, so that any value C passes is defined behaviour.
#[unsafe(no_mangle)]
pub extern "C" fn pw_status_str(status: std::ffi::c_int) -> *const c_char {
    PwStatus::from_raw(status).map_or(c"unknown status".as_ptr(), |s| s.describe().as_ptr())
}

/// Why the last call on this thread failed: a NUL-terminated message valid until the
/// thread's next call into the library, or NULL if it succeeded.
#[unsafe(no_mangle)]
pub extern "C" fn pw_last_error() -> *const c_char {
    crate::with_last_error(|e| e.map_or(std::ptr::null(), |c| c.as_ptr()))
}

/// The library's version, e.g. `"0.1.0"`.
#[unsafe(no_mangle)]
pub extern "C" fn pw_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

// ------------------------------------------------------------------------- engines

/// Creates an engine. `backend`: `"auto"`, `"verbs"`, `"tcp"`, `"loopback"` or NULL
/// (`PAGEWIRE_TRANSPORT`, else auto); `listen`: the control listener `"ip:port"` or NULL
/// (`PAGEWIRE_LISTEN`, else `0.0.0.0:0`). Other settings come from `PAGEWIRE_*`.
///
/// # Safety
/// Strings are null or NUL-terminated; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_engine_new(
    backend: *const c_char,
    listen: *const c_char,
    out: *mut *mut pw_engine,
) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        let (b, l) = unsafe { (str_arg(backend), str_arg(listen)) };
        if (!backend.is_null() && b.is_none()) || (!listen.is_null() && l.is_none()) {
            return PwStatus::InvalidArgument.fail("string argument is not UTF-8");
        }
        // SAFETY: per this function's contract.
        unsafe { put(out, native::engine_new(b, l)) }
    })
}

/// Writes the control listener's `"ip:port"` (what peers connect to).
///
/// # Safety
/// `buf` is null or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_engine_local_addr(
    engine: *const pw_engine,
    buf: *mut c_char,
    len: usize,
) -> PwStatus {
    // SAFETY: per this function's contract.
    unsafe { engine_text(engine, buf, len, |e| e.local_addr().to_string()) }
}

/// Writes the backend in use: `"verbs"`, `"tcp"` or `"loopback"`.
///
/// # Safety
/// `buf` is null or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_engine_backend(
    engine: *const pw_engine,
    buf: *mut c_char,
    len: usize,
) -> PwStatus {
    // SAFETY: per this function's contract.
    unsafe { engine_text(engine, buf, len, |e| e.backend_kind().as_str().to_owned()) }
}

/// Writes a text about the engine into `buf` (`PW_ERR_BUFFER_TOO_SMALL` if it does not
/// fit).
///
/// # Safety
/// `buf` is null or valid for `len` bytes.
unsafe fn engine_text(
    engine: *const pw_engine,
    buf: *mut c_char,
    len: usize,
    text: impl FnOnce(&pagewire_transport::Engine) -> String,
) -> PwStatus {
    run(|| {
        let s = text(&native::engine(token(engine))?.engine);
        // SAFETY: per this function's contract.
        write_fitted(unsafe { write_cstr(buf, len, &s) }, s.len())
    })
}

fn write_fitted(fitted: bool, need: usize) -> PwResult<()> {
    if fitted {
        Ok(())
    } else {
        PwStatus::BufferTooSmall.fail(format_args!("needs {} bytes", need + 1))
    }
}

/// Waits up to `timeout_ms` for a remote notification: the peer number (see
/// `pw_peer_id`) and the tag. `PW_ERR_TIMEOUT` if none came.
///
/// # Safety
/// `peer_id` and `tag` are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_engine_poll_notification(
    engine: *mut pw_engine,
    timeout_ms: u32,
    peer_id: *mut u64,
    tag: *mut u32,
) -> PwStatus {
    run(|| {
        if peer_id.is_null() || tag.is_null() {
            return null_arg("peer_id or tag");
        }

        native::poll_notification(token(engine), timeout_ms).and_then(|(p, t)| {
            // SAFETY: both checked non-null; writable per this function's contract.
            unsafe {
                put_val(peer_id, "peer_id", p)?;
                put_val(tag, "tag", t)
            }
        })
    })
}

/// Reaps completions once on this thread (needed with `PAGEWIRE_PROGRESS=manual`);
/// `reaped` (nullable) receives how many.
///
/// # Safety
/// `reaped` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_engine_progress(
    engine: *mut pw_engine,
    reaped: *mut usize,
) -> PwStatus {
    run(|| {
        native::progress(token(engine)).and_then(|n| {
            if reaped.is_null() {
                return Ok(());
            }
            // SAFETY: non-null and writable per this function's contract.
            unsafe { put_val(reaped, "reaped", n) }
        })
    })
}

// ------------------------------------------------------------------------- regions

/// Registers `[addr, addr+len)` with `access` (`PW_ACCESS_*` bits). Registering a range
/// inside a region with no more access returns a handle to the same registration
/// (each handle is deregistered on its own).
///
/// # Safety
/// The memory stays allocated until the region is deregistered or the engine freed;
/// peers may write it at any time while it is registered with `PW_ACCESS_REMOTE_WRITE`.
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_region_register(
    engine: *mut pw_engine,
    addr: *mut c_void,
    len: usize,
    access: u32,
    out: *mut *mut pw_region,
) -> PwStatus {
    run(|| {
        if out.is_null() {
            return null_arg("out");
        }
        let r = native::region_register(token(engine), addr as u64, len as u64, access);
        // SAFETY: per this function's contract.
        unsafe { put(out, r) }
    })
}

/// Deregisters a region, waiting up to `timeout_ms` for batches that use it
/// (`PW_ERR_TIMEOUT` then, and the handle stays valid). Frees the handle on success.
///
/// # Safety
/// None (any value is checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_region_deregister(region: *mut pw_region, timeout_ms: u32) -> PwStatus {
    run(|| native::region_deregister(token(region), timeout_ms))
}

// ------------------------------------------------------------------------- peers

/// Connects to the engine listening at `addr` (`"host:port"`) and runs the handshake
/// (within `PAGEWIRE_HANDSHAKE_TIMEOUT_MS`).
///
/// # Safety
/// `addr` is null or NUL-terminated; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_peer_connect(
    engine: *mut pw_engine,
    addr: *const c_char,
    out: *mut *mut pw_peer,
) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        let Some(a) = (unsafe { str_arg(addr) }) else {
            return null_arg("addr");
        };
        if out.is_null() {
            return null_arg("out");
        }
        // SAFETY: per this function's contract.
        unsafe { put(out, native::peer_connect(token(engine), a)) }
    })
}

/// Waits up to `timeout_ms` for a peer to connect to this engine.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_peer_accept(
    engine: *mut pw_engine,
    timeout_ms: u32,
    out: *mut *mut pw_peer,
) -> PwStatus {
    run(|| {
        if out.is_null() {
            return null_arg("out");
        }
        // SAFETY: per this function's contract.
        unsafe { put(out, native::peer_accept(token(engine), timeout_ms)) }
    })
}

/// The peer's number on this engine (as `pw_engine_poll_notification` reports it).
///
/// # Safety
/// `id` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_peer_id(peer: *const pw_peer, id: *mut u64) -> PwStatus {
    // SAFETY: per this function's contract.
    unsafe { get_into(id, "id", || native::peer_id(token(peer))) }
}

// ------------------------------------------------------------------------- batches

/// A new, empty batch.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_new(out: *mut *mut pw_batch) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        unsafe { put(out, native::batch_new()) }
    })
}

/// Appends an op: `PW_OP_WRITE` moves `len` bytes from local `local` to the peer's
/// `remote`; `PW_OP_READ` the other way. Refused while the batch runs.
///
/// # Safety
/// None (addresses are checked at submit).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_add(
    batch: *mut pw_batch,
    op: u32,
    local: u64,
    remote: u64,
    len: u64,
) -> PwStatus {
    run(|| native::batch_add(token(batch), op, local, remote, len))
}

/// Appends a transfer plan (`pw_plan`'s output, in data-flow order): for `PW_OP_WRITE`
/// `srcs` are local and `dsts` remote, for `PW_OP_READ` the reverse.
///
/// # Safety
/// The three arrays are valid for `n` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_add_plan(
    batch: *mut pw_batch,
    op: u32,
    srcs: *const u64,
    dsts: *const u64,
    lens: *const u64,
    n: usize,
) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        let (Some(s), Some(d), Some(l)) =
            (unsafe { (slice_arg(srcs, n), slice_arg(dsts, n), slice_arg(lens, n)) })
        else {
            return null_arg("srcs, dsts or lens");
        };
        let b = token(batch);
        for i in 0..n {
            let (local, remote) = if op == 1 { (s[i], d[i]) } else { (d[i], s[i]) };
            native::batch_add(b, op, local, remote, l[i])?;
        }
        Ok(())
    })
}

/// Asks for a remote notification with `tag` once every byte of the batch landed.
///
/// # Safety
/// None.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_set_notify(batch: *mut pw_batch, tag: u32) -> PwStatus {
    run(|| native::batch_set_notify(token(batch), tag))
}

/// The batch's deadline, relative to its submission (0 = `PAGEWIRE_BATCH_TIMEOUT_MS`).
///
/// # Safety
/// None.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_set_timeout(batch: *mut pw_batch, timeout_ms: u32) -> PwStatus {
    run(|| native::batch_set_timeout(token(batch), timeout_ms))
}

/// Validates every op (local ranges registered, remote ranges exposed by the peer, with
/// the needed access) and posts the batch; on error nothing is posted. A batch can be
/// submitted again once it finished.
///
/// # Safety
/// None (any value is checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_submit(batch: *mut pw_batch, peer: *mut pw_peer) -> PwStatus {
    run(|| native::batch_submit(token(batch), token(peer)))
}

/// Waits up to `timeout_ms`: `PW_OK`, `PW_PENDING` (still running), or the failure.
///
/// # Safety
/// None.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_wait(batch: *mut pw_batch, timeout_ms: u32) -> PwStatus {
    run(|| native::batch_wait(token(batch), timeout_ms))
}

/// Bytes completed so far.
///
/// # Safety
/// `bytes` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_batch_bytes_done(batch: *mut pw_batch, bytes: *mut u64) -> PwStatus {
    // SAFETY: per this function's contract.
    unsafe { get_into(bytes, "bytes", || native::batch_bytes_done(token(batch))) }
}

// ------------------------------------------------------------------------- layout

/// Copies `(ptrs, lens)` out, or reports the size needed.
///
/// # Safety
/// Output arrays are valid for `capacity` writes; `n_out` for one.
unsafe fn put_lists(
    lists: &[&[u64]],
    outs: &[*mut u64],
    capacity: usize,
    n_out: *mut usize,
) -> PwResult<()> {
    if n_out.is_null() {
        return null_arg("n_out");
    }
    let n = lists[0].len();
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { n_out.write(n) };
    if n > capacity {
        return PwStatus::BufferTooSmall
            .fail(format_args!("needs {n} entries, capacity {capacity}"));
    }
    if n > 0 && outs.iter().any(|p| p.is_null()) {
        return null_arg("an output array");
    }
    for (list, &out) in lists.iter().zip(outs) {
        // SAFETY: `n <= capacity` elements are writable per the caller's contract, and a
        // Rust vector cannot overlap C's arrays.
        unsafe { std::ptr::copy_nonoverlapping(list.as_ptr(), out, n) };
    }
    Ok(())
}

/// `pw_page_meta` and `pw_page_meta_for_pages`.
///
/// # Safety
/// As `pw_page_meta`.
#[allow(clippy::too_many_arguments)] // the C signature's, plus the flavour
unsafe fn page_meta_impl(
    pool: *const pw_pool_desc,
    indices: *const u64,
    n_indices: usize,
    ptrs: *mut u64,
    lens: *mut u64,
    capacity: usize,
    n_out: *mut usize,
    pages: bool,
) -> PwResult<()> {
    if pool.is_null() {
        return null_arg("pool");
    }
    // SAFETY: non-null; readable per the caller's contract (the struct is plain data).
    let desc = unsafe { pool.read() };
    // SAFETY: per the caller's contract.
    let Some(idx) = (unsafe { slice_arg(indices, n_indices) }) else {
        return null_arg("indices");
    };
    native::page_meta(&desc, idx, pages).and_then(|(p, l)| {
        // SAFETY: per the caller's contract.
        unsafe { put_lists(&[&p, &l], &[ptrs, lens], capacity, n_out) }
    })
}

/// SGLang's `get_page_buffer_meta`: for token slot `indices` (whole pages, `page_size`
/// consecutive slots each), the `(ptr, len)` of every page's K/V (or latent) bytes. On
/// success `*n_out` entries are written; `PW_ERR_BUFFER_TOO_SMALL` sets `*n_out` to the
/// entries needed and writes nothing.
///
/// # Safety
/// `pool` is valid for a read; `indices` for `n_indices` reads; `ptrs` and `lens` for
/// `capacity` writes; `n_out` for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_page_meta(
    pool: *const pw_pool_desc,
    indices: *const u64,
    n_indices: usize,
    ptrs: *mut u64,
    lens: *mut u64,
    capacity: usize,
    n_out: *mut usize,
) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        unsafe { page_meta_impl(pool, indices, n_indices, ptrs, lens, capacity, n_out, false) }
    })
}

/// `pw_page_meta` for page indices (page `p` is token slots `p*page_size ..`).
///
/// # Safety
/// As `pw_page_meta`, with `pages` for `n_pages` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_page_meta_for_pages(
    pool: *const pw_pool_desc,
    pages: *const u64,
    n_pages: usize,
    ptrs: *mut u64,
    lens: *mut u64,
    capacity: usize,
    n_out: *mut usize,
) -> PwStatus {
    run(|| {
        // SAFETY: per this function's contract.
        unsafe { page_meta_impl(pool, pages, n_pages, ptrs, lens, capacity, n_out, true) }
    })
}

/// The transfer plan moving `src_pages` of pool `src` to `dst_pages` of pool `dst`:
/// coalesced `(srcs[i], dsts[i], lens[i])` copies. Buffer handling as `pw_page_meta`.
///
/// # Safety
/// `src`, `dst` valid for reads; the page arrays for `n_pages` reads; outputs for
/// `capacity` writes; `n_out` for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pw_plan(
    src: *const pw_pool_desc,
    dst: *const pw_pool_desc,
    src_pages: *const u64,
    dst_pages: *const u64,
    n_pages: usize,
    srcs: *mut u64,
    dsts: *mut u64,
    lens: *mut u64,
    capacity: usize,
    n_out: *mut usize,
) -> PwStatus {
    run(|| {
        if src.is_null() || dst.is_null() {
            return null_arg("src or dst");
        }
        // SAFETY: non-null; readable per this function's contract.
        let (s, d) = unsafe { (src.read(), dst.read()) };
        // SAFETY: per this function's contract.
        let (Some(sp), Some(dp)) =
            (unsafe { (slice_arg(src_pages, n_pages), slice_arg(dst_pages, n_pages)) })
        else {
            return null_arg("src_pages or dst_pages");
        };
        native::plan(&s, &d, sp, dp).and_then(|(a, b, c)| {
            // SAFETY: per this function's contract.
            unsafe { put_lists(&[&a, &b, &c], &[srcs, dsts, lens], capacity, n_out) }
        })
    })
}
