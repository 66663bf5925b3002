//! Index and address arrays across the boundary, without a per-element Python loop.
//!
//! In: [`u64_source`] reads in place any one-dimensional integer array that exposes its
//! memory: the buffer protocol (numpy arrays, `array.array`, `memoryview`, `bytes`; see
//! [`crate::ffi`]), `__array_interface__`, and anything numpy can view through `__array__`
//! (torch tensors). Lists, tuples, `tolist()` results and other iterables are converted
//! element by element in Rust. [`u64_vec`] is the same as a vector.
//! Out: [`u64_array`] hands a `Vec<u64>` to Python as a read-only numpy view when numpy
//! is installed (no copy: the array's base is a [`U64Array`] that owns the vector), or as
//! a list otherwise.

use std::mem::MaybeUninit;
use std::sync::Mutex;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyList, PyTuple};

use crate::ffi::Buffer;

/// Index lists at least this long are processed with the GIL released; below it, the
/// release and re-acquisition would cost more than they free.
pub(crate) const DETACH_MIN: usize = 1 << 15;

/// Run `f` without the GIL when `work` is large (see [`DETACH_MIN`]).
pub(crate) fn compute<T, F>(py: Python<'_>, work: usize, f: F) -> T
where
    F: pyo3::marker::Ungil + FnOnce() -> T,
    T: pyo3::marker::Ungil,
{
    if work >= DETACH_MIN {
        py.detach(f)
    } else {
        f()
    }
}

// ---------------------------------------------------------------------------------------
// Recycled vectors
//
// The result arrays of a big `page_meta` are megabytes, and a caller typically drops them
// before its next call. Freed, they go back to the kernel (malloc trims its heap or unmaps
// them), and the next call's fresh ones fault in page by page: at 100,000 pages that cost
// more than reading the 51 MB of slots. So the vectors behind dropped result arrays are
// kept, a few and up to a bounded size, for the next call to fill.

/// Vectors shorter than this (256 KiB) are left to the allocator, which serves them from
/// its free lists without the kernel.
const RECYCLE_MIN: usize = 1 << 15;
/// At most this many elements (32 MiB) are kept in all, in at most `RECYCLE_COUNT` vectors.
const RECYCLE_MAX: usize = 1 << 22;
const RECYCLE_COUNT: usize = 8;

static SPARE: Mutex<Vec<Vec<u64>>> = Mutex::new(Vec::new());

/// An empty vector with room for `n` elements: the smallest kept one that fits and is not
/// more than four times too big, else a new one.
pub(crate) fn vec_for(n: usize) -> Vec<u64> {
    if n >= RECYCLE_MIN
        && let Ok(mut spare) = SPARE.lock()
        && let Some(i) = (0..spare.len())
            .filter(|&i| (n..=n.saturating_mul(4)).contains(&spare[i].capacity()))
            .min_by_key(|&i| spare[i].capacity())
    {
        let mut v = spare.swap_remove(i);
        v.clear();
        return v;
    }
    Vec::with_capacity(n)
}

/// Keeps `v`'s memory for [`vec_for`] when it is worth keeping, dropping the oldest kept
/// vectors beyond the bounds.
pub(crate) fn recycle(v: Vec<u64>) {
    if !(RECYCLE_MIN..=RECYCLE_MAX).contains(&v.capacity()) {
        return;
    }
    let mut evicted = Vec::new();
    if let Ok(mut spare) = SPARE.lock() {
        spare.push(v);
        let mut total: usize = spare.iter().map(Vec::capacity).sum();
        while spare.len() > RECYCLE_COUNT || total > RECYCLE_MAX {
            let old = spare.remove(0);
            total -= old.capacity();
            evicted.push(old);
        }
    }
    // `evicted` is freed here, after the lock.
}

/// Integer element types accepted in arrays, by numpy/`struct` size and signedness.
#[derive(Clone, Copy, Debug)]
enum Elem {
    U(usize),
    I(usize),
}

impl Elem {
    /// From a numpy `typestr` (`"<u8"`, `"|i1"`...): little-endian or byte-order-free
    /// integers only (every platform pagewire runs on is little-endian).
    fn from_typestr(t: &str) -> Option<Elem> {
        let b = t.as_bytes();
        if b.len() < 3 || !matches!(b[0], b'<' | b'|' | b'=') {
            return None;
        }
        let size: usize = t.get(2..)?.parse().ok()?;
        if !matches!(size, 1 | 2 | 4 | 8) {
            return None;
        }
        match b[1] {
            b'u' => Some(Elem::U(size)),
            b'i' => Some(Elem::I(size)),
            _ => None,
        }
    }

    /// From a `memoryview.format` (native order, `struct` codes).
    fn from_format(f: &str, itemsize: usize) -> Option<Elem> {
        if !matches!(itemsize, 1 | 2 | 4 | 8) {
            return None;
        }
        let f = f.trim_start_matches(['@', '=', '<']);
        match f {
            "B" | "H" | "I" | "L" | "Q" | "N" => Some(Elem::U(itemsize)),
            "b" | "h" | "i" | "l" | "q" | "n" => Some(Elem::I(itemsize)),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Elem::U(s) | Elem::I(s) => s,
        }
    }
}

/// Reads one element of `elem` at `p`, sign-extended for signed types (so a negative
/// value has its top bit set).
///
/// # Safety
/// `p` must point at `elem.size()` readable bytes (any alignment).
unsafe fn load(p: *const u8, elem: Elem) -> u64 {
    use std::ptr::read_unaligned as rd;
    // SAFETY: in every arm, the caller guarantees `elem.size()` readable bytes at `p`, and
    // `read_unaligned` copies them out without forming a reference.
    unsafe {
        match elem {
            Elem::U(1) => u64::from(rd(p)),
            Elem::U(2) => u64::from(u16::from_le_bytes(rd(p.cast()))),
            Elem::U(4) => u64::from(u32::from_le_bytes(rd(p.cast()))),
            Elem::U(_) => u64::from_le_bytes(rd(p.cast())),
            Elem::I(1) => i8::from_le_bytes(rd(p.cast())) as u64,
            Elem::I(2) => i16::from_le_bytes(rd(p.cast())) as u64,
            Elem::I(4) => i32::from_le_bytes(rd(p.cast())) as u64,
            Elem::I(_) => u64::from_le_bytes(rd(p.cast())),
        }
    }
}

/// Position of the first value with its top bit set (a negative input of a signed type).
fn first_negative(v: &[u64]) -> Option<usize> {
    // One branch-free pass over all values; the search runs only when one is negative.
    if v.iter().fold(0, |acc, &x| acc | x) >> 63 == 0 {
        return None;
    }
    v.iter().position(|&x| x >> 63 != 0)
}

/// What keeps a [`Raw`] array's memory alive.
enum Keep<'py> {
    /// A buffer-protocol view, released on drop.
    Buffer(#[allow(dead_code)] Buffer<'py>),
    /// The object whose `__array_interface__` gave the address.
    Owner(#[allow(dead_code)] Bound<'py, PyAny>),
}

/// An integer array in memory another object owns: `len` elements of `elem`, `stride`
/// bytes apart, from `ptr`. Read only through raw copies ([`load`], `copy_nonoverlapping`),
/// never through Rust references, so a concurrent writer cannot cause undefined behaviour
/// on our side (it can only make the values it changes inconsistent).
struct Raw<'py> {
    ptr: *const u8,
    len: usize,
    stride: isize,
    elem: Elem,
    _keep: Keep<'py>,
}

impl Raw<'_> {
    /// Elements `start, start+step, ...` into `out` (`start + (out.len()-1)*step < len`).
    fn read(&self, start: usize, step: usize, out: &mut [u64]) {
        let size = self.elem.size();
        if step == 1 && size == 8 && self.stride == 8 {
            // SAFETY: elements `start..start+out.len()` lie inside the array (caller's
            // contract, checked by `U64Source::read`), contiguous, 8 bytes each; `out` has
            // room for exactly that many u64s, and any bit pattern is a valid u64.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.wrapping_offset(start as isize * 8),
                    out.as_mut_ptr().cast::<u8>(),
                    out.len() * 8,
                );
            }
            return;
        }
        for (k, o) in out.iter_mut().enumerate() {
            let i = (start + k * step) as isize;
            // SAFETY: element `i` is inside the array (as above), so `ptr + i*stride` points
            // at `size` readable bytes of the exporter's memory.
            *o = unsafe { load(self.ptr.wrapping_offset(i * self.stride), self.elem) };
        }
    }
}

impl Raw<'_> {
    /// Whether the memory is kept by a buffer-protocol view: the exporter must then keep it
    /// in place until the view is released, whatever other threads do meanwhile.
    fn pinned(&self) -> bool {
        matches!(self._keep, Keep::Buffer(_))
    }

    /// The first element of each run of `p` elements into `firsts` (one per whole run), and
    /// whether every run is `t, t+1, ..., t+p-1`: one pass over the array, no copy. Long
    /// contiguous 8-byte arrays in pinned memory are scanned without the GIL.
    fn consecutive_runs(&self, py: Python<'_>, p: usize, firsts: &mut [MaybeUninit<u64>]) -> bool {
        if self.elem.size() == 8 && self.stride == 8 {
            let at = SendPtr(self.ptr);
            let mut scan = move || runs_diff(at, p, firsts) == 0;
            return if self.pinned() && self.len >= DETACH_MIN {
                py.detach(scan)
            } else {
                scan()
            };
        }
        let mut diff = 0u64;
        for (k, first) in firsts.iter_mut().enumerate() {
            let at = |j: usize| {
                let i = (k * p + j) as isize;
                // SAFETY: `firsts` has one entry per whole run of the array, so element
                // `k*p + j` (`j < p`) is inside it.
                unsafe { load(self.ptr.wrapping_offset(i * self.stride), self.elem) }
            };
            let t0 = at(0);
            first.write(t0);
            for j in 1..p {
                diff |= at(j) ^ t0.wrapping_add(j as u64);
            }
        }
        diff == 0
    }
}

/// An array's address, handed to code that runs without the GIL.
#[derive(Clone, Copy)]
struct SendPtr(*const u8);

// SAFETY: only the address crosses threads. The memory behind it is read through raw
// copies (never references), and only while the caller, which waits for that code, keeps
// the buffer view that pins it.
unsafe impl Send for SendPtr {}

/// For contiguous little-endian u64s at `ptr`, in runs of `p`: writes each run's first
/// element to `firsts[k]` and returns the OR over the runs of `element ^ expected`, zero
/// exactly when every run `k` is `firsts[k], firsts[k]+1, ...`. One pass over the memory,
/// branch-free inside a run (it vectorises; the run's first element compares with itself,
/// which keeps the vector loop free of a scalar head). The caller guarantees
/// `firsts.len() * p` readable u64s at `ptr`.
#[inline(always)]
fn runs_diff_body(ptr: SendPtr, p: usize, firsts: &mut [MaybeUninit<u64>]) -> u64 {
    let mut diff = 0u64;
    for (k, first) in firsts.iter_mut().enumerate() {
        let run = ptr.0.wrapping_add(k * p * 8).cast::<u64>();
        // SAFETY: element `k*p` lies within the `firsts.len() * p` readable u64s the caller
        // guarantees; read without forming a reference.
        let t0 = u64::from_le(unsafe { std::ptr::read_unaligned(run) });
        first.write(t0);
        for j in 0..p {
            // SAFETY: as above, for element `k*p + j`, `j < p`.
            let x = unsafe { std::ptr::read_unaligned(run.wrapping_add(j)) };
            diff |= u64::from_le(x) ^ t0.wrapping_add(j as u64);
        }
    }
    diff
}

/// [`runs_diff_body`] compiled for AVX2 (four lanes instead of SSE2's two: about 1.6 times
/// faster on the development VM).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn runs_diff_avx2(ptr: SendPtr, p: usize, firsts: &mut [MaybeUninit<u64>]) -> u64 {
    runs_diff_body(ptr, p, firsts)
}

/// [`runs_diff_body`] with the widest vectors the CPU has.
fn runs_diff(ptr: SendPtr, p: usize, firsts: &mut [MaybeUninit<u64>]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the one requirement of
        // `runs_diff_avx2`; its memory contract is `runs_diff`'s, passed on unchanged.
        return unsafe { runs_diff_avx2(ptr, p, firsts) };
    }
    runs_diff_body(ptr, p, firsts)
}

enum Source<'py> {
    Owned(Vec<u64>),
    Raw(Raw<'py>),
}

/// A one-dimensional sequence of non-negative integers from Python, read in place when the
/// object exposes its memory (numpy arrays, the buffer protocol, `__array_interface__`,
/// torch tensors through numpy), converted into a vector otherwise.
///
/// Not `Send`: it may hold a buffer view, which must be released with the GIL held.
pub(crate) struct U64Source<'py> {
    inner: Source<'py>,
    what: String,
}

impl<'py> U64Source<'py> {
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match &self.inner {
            Source::Owned(v) => v.len(),
            Source::Raw(r) => r.len,
        }
    }

    /// The elements, when they were converted into a vector (lists, tuples, iterables).
    pub(crate) fn as_slice(&self) -> Option<&[u64]> {
        match &self.inner {
            Source::Owned(v) => Some(v),
            Source::Raw(_) => None,
        }
    }

    /// Elements `start, start+step, ...` into `out`; a `ValueError` naming the element when
    /// one is negative, or when the range leaves the array.
    pub(crate) fn read(&self, start: usize, step: usize, out: &mut [u64]) -> PyResult<()> {
        let (n, step) = (out.len(), step.max(1));
        let last = n
            .checked_sub(1)
            .map(|k| k.checked_mul(step).and_then(|o| o.checked_add(start)));
        if let Some(last) = last
            && last.is_none_or(|l| l >= self.len())
        {
            return Err(PyValueError::new_err(format!(
                "{}: read beyond its {} elements",
                self.what,
                self.len()
            )));
        }
        match &self.inner {
            Source::Owned(v) => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = v[start + k * step];
                }
                Ok(())
            }
            Source::Raw(r) => {
                r.read(start, step, out);
                match (r.elem, first_negative(out)) {
                    (Elem::I(_), Some(k)) => Err(self.negative(start + k * step, out[k])),
                    _ => Ok(()),
                }
            }
        }
    }

    /// The first element of each run of `p` elements into `firsts` (cleared first; the
    /// length must be a multiple of `p`). With `consecutive`, the result says whether every
    /// run is `t, t+1, ..., t+p-1`: one pass over the caller's array, without copying it.
    /// Only the elements in `firsts` are checked for being negative.
    pub(crate) fn run_starts_into(
        &self,
        py: Python<'_>,
        p: usize,
        consecutive: bool,
        firsts: &mut Vec<u64>,
    ) -> PyResult<bool> {
        let p = p.max(1);
        let runs = self.len() / p;
        firsts.clear();
        match &self.inner {
            Source::Raw(r) if consecutive => {
                firsts.reserve(runs);
                let ok = r.consecutive_runs(py, p, &mut firsts.spare_capacity_mut()[..runs]);
                // SAFETY: `consecutive_runs` wrote each of the first `runs` spare elements.
                unsafe { firsts.set_len(runs) };
                if let (Elem::I(_), Some(k)) = (r.elem, first_negative(firsts)) {
                    return Err(self.negative(k * p, firsts[k]));
                }
                Ok(ok)
            }
            Source::Owned(v) if consecutive => {
                firsts.resize(runs, 0);
                self.read(0, p, firsts)?;
                Ok(v.chunks_exact(p)
                    .zip(firsts.iter())
                    .all(|(run, &t0)| run.iter().zip(t0..).all(|(&x, want)| x == want)))
            }
            _ => {
                firsts.resize(runs, 0);
                self.read(0, p, firsts)?;
                Ok(true)
            }
        }
    }

    fn negative(&self, i: usize, x: u64) -> PyErr {
        PyValueError::new_err(format!("{}[{i}] is negative ({})", self.what, x as i64))
    }

    /// All elements as a vector (no copy for converted sequences).
    pub(crate) fn into_vec(self) -> PyResult<Vec<u64>> {
        if let Source::Owned(v) = self.inner {
            return Ok(v);
        }
        let mut out = vec![0; self.len()];
        self.read(0, 1, &mut out)?;
        Ok(out)
    }

    fn owned(v: Vec<u64>, what: &str) -> Self {
        Self {
            inner: Source::Owned(v),
            what: what.to_owned(),
        }
    }
}

/// A one-dimensional sequence of non-negative integers as `Vec<u64>`. `what` names the
/// argument in error messages.
pub(crate) fn u64_vec(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    u64_source(obj, what)?.into_vec()
}

/// [`u64_vec`] without the copy when `obj` exposes its memory: see [`U64Source`].
pub(crate) fn u64_source<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<U64Source<'py>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(U64Source::owned(from_items(list.iter(), what)?, what));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(U64Source::owned(from_items(tuple.iter(), what)?, what));
    }
    if let Some(raw) = from_memory(obj, what)? {
        return Ok(U64Source {
            inner: Source::Raw(raw),
            what: what.to_owned(),
        });
    }
    if let Some(np) = numpy(py)
        && obj.hasattr("__array__")?
    {
        // Tensors and other array-likes: numpy views their memory (no copy for a
        // contiguous CPU tensor), then read it in place.
        let arr = np.ascontiguousarray.bind(py).call1((obj,))?;
        if let Some(raw) = from_memory(&arr, what)? {
            return Ok(U64Source {
                inner: Source::Raw(raw),
                what: what.to_owned(),
            });
        }
        // A float or object array: element by element, which rejects non-integers.
        let list = arr.call_method0("tolist")?;
        let list = list.cast::<PyList>()?;
        return Ok(U64Source::owned(from_items(list.iter(), what)?, what));
    }
    // Array-likes without numpy (torch's `tolist()` builds the list in C, which beats
    // iterating over one 0-d tensor per element).
    if let Ok(tolist) = obj.getattr("tolist")
        && tolist.is_callable()
    {
        let list = tolist.call0()?;
        if let Ok(list) = list.cast::<PyList>() {
            return Ok(U64Source::owned(from_items(list.iter(), what)?, what));
        }
    }
    match obj.try_iter() {
        Ok(it) => {
            let mut out = Vec::new();
            for (i, v) in it.enumerate() {
                out.push(extract_u64(&v?, what, i)?);
            }
            Ok(U64Source::owned(out, what))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of non-negative ints (list, tuple, array), got {}",
            obj.get_type().name()?
        ))),
    }
}

fn from_items<'py>(
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    what: &str,
) -> PyResult<Vec<u64>> {
    items
        .enumerate()
        .map(|(i, v)| extract_u64(&v, what, i))
        .collect()
}

/// One element: a `ValueError` for an int outside `0..2**64`, a `TypeError` for anything
/// that is not an int (objects with `__index__`, such as numpy integers, count as ints).
fn extract_u64(v: &Bound<'_, PyAny>, what: &str, i: usize) -> PyResult<u64> {
    v.extract::<u64>().map_err(|_| {
        let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
        if v.is_instance_of::<PyInt>() || v.hasattr("__index__").unwrap_or(false) {
            PyValueError::new_err(format!(
                "{what}[{i}] must be a non-negative int below 2**64, got {shown}"
            ))
        } else {
            PyTypeError::new_err(format!("{what}[{i}] must be an int, got {shown}"))
        }
    })
}

/// The integer array `obj` exposes through the buffer protocol or `__array_interface__`;
/// `None` when it exposes neither, or exposes something that is not integers (the caller
/// then converts).
fn from_memory<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Option<Raw<'py>>> {
    if let Some(buf) = Buffer::get(obj) {
        if buf.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} must be one-dimensional, got {} dimensions",
                buf.ndim()
            )));
        }
        if let Some(elem) = Elem::from_format(&buf.format(), buf.itemsize())
            && !buf.has_suboffsets()
        {
            return Ok(Some(Raw {
                ptr: buf.ptr(),
                len: buf.len(),
                stride: buf.stride(),
                elem,
                _keep: Keep::Buffer(buf),
            }));
        }
        return Ok(None);
    }
    match obj.getattr("__array_interface__") {
        Ok(iface) => from_array_interface(obj, &iface, what),
        Err(_) => Ok(None),
    }
}

/// Reads a one-dimensional integer array's address, length and stride from its
/// `__array_interface__` (version 3). `None` when it describes something else (float,
/// masked, ...), so the caller can fall back to a converting path.
fn from_array_interface<'py>(
    owner: &Bound<'py, PyAny>,
    iface: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Option<Raw<'py>>> {
    let Ok(iface) = iface.cast::<PyDict>() else {
        return Ok(None);
    };
    let get = |k: &str| iface.get_item(k);
    let shape: Vec<usize> = match get("shape")? {
        Some(s) => s.extract()?,
        None => return Ok(None),
    };
    if shape.len() != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be one-dimensional, got shape {shape:?}"
        )));
    }
    if get("mask")?.is_some_and(|m| !m.is_none()) {
        return Ok(None);
    }
    let Some(elem) = get("typestr")?
        .and_then(|t| t.extract::<String>().ok())
        .and_then(|t| Elem::from_typestr(&t))
    else {
        return Ok(None);
    };
    let stride: isize = match get("strides")? {
        Some(s) if !s.is_none() => match s.extract::<(isize,)>() {
            Ok((s,)) => s,
            Err(_) => return Ok(None),
        },
        _ => elem.size() as isize,
    };
    let Some(Ok((ptr, _readonly))) = get("data")?.map(|d| d.extract::<(usize, bool)>()) else {
        return Ok(None);
    };
    Ok(Some(Raw {
        ptr: ptr as *const u8,
        len: shape[0],
        stride,
        elem,
        _keep: Keep::Owner(owner.clone()),
    }))
}

/// Owns a `Vec<u64>` that numpy views without copying (its `__array_interface__`); also a
/// read-only sequence on its own when numpy is not installed.
#[pyclass(frozen, module = "pagewire._native")]
pub(crate) struct U64Array {
    data: Vec<u64>,
}

impl Drop for U64Array {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.data));
    }
}

impl U64Array {
    /// Takes ownership of `data`.
    pub(crate) fn new(data: Vec<u64>) -> Self {
        Self { data }
    }

    /// The elements.
    pub(crate) fn as_slice(&self) -> &[u64] {
        &self.data
    }
}

#[pymethods]
impl U64Array {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.data.len(),))?;
        d.set_item("typestr", "<u8")?;
        // Read-only: numpy must not write into the vector behind this frozen object.
        d.set_item("data", (self.data.as_ptr() as usize, true))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }

    fn __getitem__(&self, i: isize) -> PyResult<u64> {
        let n = self.data.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if (0..n).contains(&j) {
            Ok(self.data[j as usize])
        } else {
            Err(pyo3::exceptions::PyIndexError::new_err(
                "index out of range",
            ))
        }
    }

    fn tolist(&self) -> Vec<u64> {
        self.data.clone()
    }

    fn __repr__(&self) -> String {
        format!("U64Array(len={})", self.data.len())
    }
}

/// The numpy functions the conversions call, looked up once per process.
struct Numpy {
    asarray: Py<PyAny>,
    ascontiguousarray: Py<PyAny>,
}

/// numpy's functions, or `None` when numpy cannot be imported (cached too, so a process
/// without numpy does not retry the import on every call).
fn numpy(py: Python<'_>) -> Option<&Numpy> {
    static NUMPY: PyOnceLock<Option<Numpy>> = PyOnceLock::new();
    NUMPY
        .get_or_init(py, || {
            let np = py.import("numpy").ok()?;
            Some(Numpy {
                asarray: np.getattr("asarray").ok()?.unbind(),
                ascontiguousarray: np.getattr("ascontiguousarray").ok()?.unbind(),
            })
        })
        .as_ref()
}

fn numpy_asarray(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
    numpy(py).map(|np| np.asarray.bind(py))
}

/// Whether results come back as numpy arrays (numpy importable) or as lists.
pub(crate) fn have_numpy(py: Python<'_>) -> bool {
    numpy_asarray(py).is_some()
}

/// `data` as a read-only numpy `uint64` array viewing the vector (no copy) when numpy is
/// importable, else as a list of ints.
pub(crate) fn u64_array(py: Python<'_>, data: Vec<u64>) -> PyResult<Py<PyAny>> {
    match numpy_asarray(py) {
        Some(asarray) => {
            let owner = Bound::new(py, U64Array { data })?;
            Ok(asarray.call1((owner,))?.unbind())
        }
        None => Ok(PyList::new(py, data)?.into_any().unbind()),
    }
}

/// A numpy view of an existing [`U64Array`] (no copy), or a list copy without numpy.
pub(crate) fn u64_view(owner: &Bound<'_, U64Array>) -> PyResult<Py<PyAny>> {
    let py = owner.py();
    match numpy_asarray(py) {
        Some(asarray) => Ok(asarray.call1((owner,))?.unbind()),
        None => Ok(PyList::new(py, &owner.get().data)?.into_any().unbind()),
    }
}

/// `_u64_roundtrip(obj)`: `obj` through [`u64_vec`] and back through [`u64_array`], for
/// the tests of the conversions.
#[pyfunction]
fn _u64_roundtrip(obj: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    u64_array(obj.py(), u64_vec(obj, "obj")?)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<U64Array>()?;
    m.add_function(wrap_pyfunction!(_u64_roundtrip, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_all(bytes: &[u8], elem: Elem) -> Vec<u64> {
        bytes
            .chunks_exact(elem.size())
            // SAFETY: each chunk holds `elem.size()` bytes.
            .map(|c| unsafe { load(c.as_ptr(), elem) })
            .collect()
    }

    #[test]
    fn load_sign_extends() {
        assert_eq!(load_all(&[1, 0, 0xff, 0x7f], Elem::I(2)), [1, 0x7fff]);
        let neg = load_all(&[0xff, 0xff], Elem::I(2));
        assert_eq!(neg, [u64::MAX]);
        assert_eq!(first_negative(&neg), Some(0));
        assert_eq!(load_all(&[0xff, 0xff], Elem::U(2)), [0xffff]);
        assert_eq!(load_all(&[0x80], Elem::I(1)), [(-128i64) as u64]);
        assert_eq!(first_negative(&[1, 2, 3]), None);
    }

    /// Brute force: each run of `p` is `t0, t0+1, ...`, one slot at a time.
    fn runs_are_consecutive(v: &[u64], p: usize) -> bool {
        // Modulo 2**64, as the kernel compares: a run that wraps is then refused by the
        // range check of the first slot.
        v.chunks_exact(p)
            .all(|run| (0..p).all(|j| run[j] == run[0].wrapping_add(j as u64)))
    }

    /// `runs_diff` (each kernel the CPU has) on `v`: (consecutive, first slots).
    fn scan(v: &[u64], p: usize, avx2: bool) -> (bool, Vec<u64>) {
        let runs = v.len() / p;
        let mut firsts = Vec::with_capacity(runs);
        let spare = &mut firsts.spare_capacity_mut()[..runs];
        let at = SendPtr(v.as_ptr().cast());
        #[cfg(target_arch = "x86_64")]
        let diff = if avx2 {
            // SAFETY: only called when the CPU has AVX2; `v` holds `runs * p` u64s.
            unsafe { runs_diff_avx2(at, p, spare) }
        } else {
            runs_diff_body(at, p, spare)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let diff = runs_diff_body(at, p, spare);
        // SAFETY: the kernel wrote each of the first `runs` spare elements.
        unsafe { firsts.set_len(runs) };
        (diff == 0, firsts)
    }

    proptest::proptest! {
        /// The vectorised check accepts exactly the arrays whose every run is consecutive,
        /// slot by slot: valid pages (aligned or not, near `u64::MAX`, negative as i64),
        /// and one wrong slot anywhere (the middle of a page, the last slot of the last
        /// page, a first slot).
        #[test]
        fn runs_diff_is_the_per_slot_check(
            p in 1..=70usize,
            starts in proptest::collection::vec(proptest::prelude::any::<u64>(), 0..12),
            wrong in proptest::option::of((proptest::prelude::any::<proptest::sample::Index>(), 0..4u8, proptest::prelude::any::<u64>())),
        ) {
            let mut v: Vec<u64> = starts
                .iter()
                .flat_map(|&t| (0..p as u64).map(move |j| t.wrapping_add(j)))
                .collect();
            if let Some((at, how, x)) = wrong
                && !v.is_empty()
            {
                let i = match how {
                    0 => v.len() - 1,        // the last slot of the last page
                    1 => v.len() / 2,        // the middle
                    _ => at.index(v.len()),  // anywhere
                };
                v[i] = match how {
                    3 => (x as i64).wrapping_neg() as u64 | 1 << 63, // a negative value
                    _ => x,
                };
            }
            let want = runs_are_consecutive(&v, p);
            let firsts: Vec<u64> = v.chunks_exact(p).map(|r| r[0]).collect();
            proptest::prop_assert_eq!(scan(&v, p, false), (want, firsts.clone()));
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                proptest::prop_assert_eq!(scan(&v, p, true), (want, firsts));
            }
        }
    }

    #[test]
    fn recycled_vectors_are_bounded_and_reused() {
        let big = RECYCLE_MIN * 8;
        let v = Vec::<u64>::with_capacity(big);
        let at = v.as_ptr();
        recycle(v);
        // Not handed out for a request it would overshoot more than 4x.
        let small = vec_for(RECYCLE_MIN);
        assert_ne!(small.as_ptr(), at);
        let again = vec_for(big - 1);
        assert!(again.is_empty() && again.capacity() >= big - 1);
        assert_eq!(again.as_ptr(), at, "the kept vector is handed out again");
        for _ in 0..3 * RECYCLE_COUNT {
            recycle(Vec::with_capacity(RECYCLE_MAX / 2));
        }
        recycle(Vec::with_capacity(RECYCLE_MAX + 1));
        recycle(Vec::with_capacity(RECYCLE_MIN - 1));
        let spare = SPARE.lock().unwrap();
        assert!(spare.len() <= RECYCLE_COUNT);
        assert!(spare.iter().map(Vec::capacity).sum::<usize>() <= RECYCLE_MAX);
        assert!(spare.iter().all(|v| v.capacity() >= RECYCLE_MIN));
    }

    #[test]
    fn typestr_and_format_parsing() {
        assert!(matches!(Elem::from_typestr("<u8"), Some(Elem::U(8))));
        assert!(matches!(Elem::from_typestr("|i1"), Some(Elem::I(1))));
        assert!(Elem::from_typestr(">u8").is_none());
        assert!(Elem::from_typestr("<f8").is_none());
        assert!(Elem::from_typestr("<\u{e9}8").is_none());
        assert!(matches!(Elem::from_format("q", 8), Some(Elem::I(8))));
        assert!(matches!(Elem::from_format("l", 8), Some(Elem::I(8))));
        assert!(Elem::from_format("d", 8).is_none());
        assert!(Elem::from_format("q", 16).is_none());
    }
}
