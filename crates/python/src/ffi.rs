//! The crate's one FFI module: the buffer protocol (`PyObject_GetBuffer`).
//!
//! PyO3 compiles its buffer API out under `abi3-py39`, because CPython added
//! `PyObject_GetBuffer`, `PyBuffer_Release` and `Py_buffer` to the limited API only in
//! 3.11. The functions are exported by every CPython 3 interpreter and `Py_buffer` has had
//! this layout since 3.3, so declaring them here works on 3.9 and 3.10 too. The gain over
//! going through `memoryview(obj).tobytes()` is measured in `docs/python.md`: the caller
//! reads the exporter's memory in place instead of through an intermediate `bytes` copy.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::marker::PhantomData;

use pyo3::ffi::{Py_ssize_t, PyObject};
use pyo3::prelude::*;

/// CPython's `Py_buffer` (Include/pybuffer.h), unchanged since 3.3.
#[repr(C)]
#[allow(non_camel_case_types)]
struct Py_buffer {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut Py_buffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut Py_buffer);
}

/// `PyBUF_RECORDS_RO`: strides, shape and format; read-only is fine.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

/// A one-dimensional view of an object's memory, held through the buffer protocol and
/// released on drop. Not `Send` (it holds raw pointers and a GIL lifetime), so it cannot
/// outlive the GIL-holding scope that made it or travel into a `Python::detach` closure.
pub(crate) struct Buffer<'py> {
    // Boxed: some exporters point `shape` into the `Py_buffer` itself
    // (`PyBuffer_FillInfo` sets `shape = &view->len`), so its address must not change.
    view: Box<Py_buffer>,
    _gil: PhantomData<Python<'py>>,
}

impl<'py> Buffer<'py> {
    /// The buffer of `obj`, or `None` (with the error cleared) when `obj` does not export
    /// one.
    pub(crate) fn get(obj: &Bound<'py, PyAny>) -> Option<Self> {
        let mut view = Box::new(Py_buffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object and the GIL is held (`Bound<'py, _>`); `view` is a
        // writable `Py_buffer` with CPython's layout. On failure CPython sets an exception
        // and leaves nothing to release.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_RECORDS_RO) };
        if rc != 0 {
            let _ = PyErr::take(obj.py());
            return None;
        }
        Some(Self {
            view,
            _gil: PhantomData,
        })
    }

    /// Number of dimensions.
    pub(crate) fn ndim(&self) -> usize {
        usize::try_from(self.view.ndim).unwrap_or(0)
    }

    /// Length of dimension 0 (the byte length over the item size when there is no shape).
    pub(crate) fn len(&self) -> usize {
        let v = &*self.view;
        let n = if v.shape.is_null() {
            if v.itemsize > 0 {
                v.len / v.itemsize
            } else {
                0
            }
        } else {
            // SAFETY: with PYBUF_ND requested and granted, `shape` points at `ndim` (>= 1 for
            // our callers, checked by them) lengths owned by the exporter or the view.
            unsafe { *v.shape }
        };
        usize::try_from(n).unwrap_or(0)
    }

    /// Bytes between consecutive elements of dimension 0.
    pub(crate) fn stride(&self) -> isize {
        let v = &*self.view;
        if v.strides.is_null() {
            v.itemsize
        } else {
            // SAFETY: as for `shape`, `strides` points at `ndim` strides.
            unsafe { *v.strides }
        }
    }

    /// Bytes per element.
    pub(crate) fn itemsize(&self) -> usize {
        usize::try_from(self.view.itemsize).unwrap_or(0)
    }

    /// The `struct` format string (`"B"` when the exporter gives none, as the protocol says).
    pub(crate) fn format(&self) -> String {
        if self.view.format.is_null() {
            return "B".to_owned();
        }
        // SAFETY: a non-null `format` is a NUL-terminated string that lives as long as the
        // view; it is copied out at once.
        unsafe { CStr::from_ptr(self.view.format) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether the buffer has indirections (PIL-style), which we do not follow.
    pub(crate) fn has_suboffsets(&self) -> bool {
        !self.view.suboffsets.is_null()
    }

    /// Address of element 0. The memory stays valid until this view is dropped; it is read
    /// only through raw copies, never through Rust references.
    pub(crate) fn ptr(&self) -> *const u8 {
        self.view.buf.cast::<u8>().cast_const()
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful `PyObject_GetBuffer` and is released
        // exactly once; the GIL is held for `'py`, which this value cannot outlive.
        unsafe { PyBuffer_Release(&mut *self.view) };
    }
}
