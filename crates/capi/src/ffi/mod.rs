//! Every `extern "C"` function of the library, and the helpers that read C's arguments.
//!
//! This is the only place where pointers from C are read or written. Each entry point
//! runs its body under [`guard`], which catches a panic and turns it into the function's
//! error value, so unwinding never crosses into C.

use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

pub mod mooncake;
pub mod pagewire;

/// Runs an entry point's body: clears the thread's last error, catches a panic (its
/// message becomes the last error) and returns `on_panic` in that case.
pub(crate) fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    crate::clear_last_error();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            crate::set_last_error(format_args!("internal error (caught panic): {what}"));
            on_panic
        }
    }
}

/// Reads a C string argument; `None` for a null pointer or invalid UTF-8.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null, and NUL-terminated and live per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Reads a C string argument as bytes (no UTF-8 requirement); `None` for null.
///
/// # Safety
/// As [`str_arg`].
pub(crate) unsafe fn bytes_arg<'a>(p: *const c_char) -> Option<&'a [u8]> {
    if p.is_null() {
        return None;
    }
    // SAFETY: as in `str_arg`.
    Some(unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// Copies `s` and a NUL into `buf` of `len` bytes like `snprintf`: truncated to fit.
/// Returns whether all of `s` fitted. Writes nothing when `buf` is null or `len` is 0.
///
/// # Safety
/// `buf` is null or valid for `len` bytes of writes.
pub(crate) unsafe fn write_cstr(buf: *mut c_char, len: usize, s: &str) -> bool {
    if buf.is_null() || len == 0 {
        return false;
    }
    let bytes = s.as_bytes();
    let n = bytes.len().min(len - 1);
    // SAFETY: `n + 1 <= len` bytes of `buf` are writable per the caller's contract, and
    // `bytes` is a Rust string that cannot overlap C's buffer in a valid program.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    n == bytes.len()
}

/// Reads `n` elements from a C array; `None` for null or misaligned with `n > 0`.
///
/// # Safety
/// `p` is null or valid for `n` reads of `T`.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, n: usize) -> Option<&'a [T]> {
    if n == 0 {
        return Some(&[]);
    }
    if p.is_null() || !p.is_aligned() || n > isize::MAX as usize / size_of::<T>().max(1) {
        return None;
    }
    // SAFETY: non-null, `n` elements readable per the caller's contract, size checked.
    Some(unsafe { std::slice::from_raw_parts(p, n) })
}
