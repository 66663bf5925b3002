//! Index and address arrays across the boundary, without a per-element Python loop.
//!
//! In: [`u64_vec`] accepts lists, tuples, numpy arrays (through `__array_interface__`),
//! anything with `__array__`, any buffer-protocol object of integers (through
//! `memoryview`), and finally any iterable of ints.
//! Out: [`u64_array`] hands a `Vec<u64>` to Python as a read-only numpy view when numpy
//! is installed (no copy: the array's base is a [`U64Array`] that owns the vector), or as
//! a list otherwise.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

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
        let size: usize = t[2..].parse().ok()?;
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

/// Decodes `bytes` (little-endian elements of `elem`) into u64s; a negative value is an
/// error naming its position.
fn decode(bytes: &[u8], elem: Elem, what: &str) -> PyResult<Vec<u64>> {
    let size = elem.size();
    let mut out = Vec::with_capacity(bytes.len() / size);
    for (i, chunk) in bytes.chunks_exact(size).enumerate() {
        let mut raw = [0u8; 8];
        raw[..size].copy_from_slice(chunk);
        let v = match elem {
            Elem::U(_) => u64::from_le_bytes(raw),
            Elem::I(_) => {
                let shift = 64 - 8 * size as u32;
                let signed = (i64::from_le_bytes(raw) << shift) >> shift;
                u64::try_from(signed).map_err(|_| {
                    PyValueError::new_err(format!("{what}[{i}] is negative ({signed})"))
                })?
            }
        };
        out.push(v);
    }
    Ok(out)
}

/// A one-dimensional sequence of non-negative integers as `Vec<u64>`. `what` names the
/// argument in error messages.
pub(crate) fn u64_vec(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .enumerate()
            .map(|(i, v)| extract_u64(&v, what, i))
            .collect();
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple
            .iter()
            .enumerate()
            .map(|(i, v)| extract_u64(&v, what, i))
            .collect();
    }
    if let Ok(iface) = obj.getattr("__array_interface__")
        && let Some(v) = from_array_interface(obj, &iface, what)?
    {
        return Ok(v);
    }
    if obj.hasattr("__array__")?
        && let Ok(np) = py.import("numpy")
    {
        let arr = np.call_method1("ascontiguousarray", (obj,))?;
        let iface = arr.getattr("__array_interface__")?;
        if let Some(v) = from_array_interface(&arr, &iface, what)? {
            return Ok(v);
        }
        // A float or object array: convert element by element, which rejects
        // non-integers with the usual TypeError.
        return u64_vec(&arr.call_method0("tolist")?, what);
    }
    if let Ok(mv) = py.import("builtins")?.getattr("memoryview")?.call1((obj,)) {
        let ndim: usize = mv.getattr("ndim")?.extract()?;
        if ndim > 1 {
            return Err(PyValueError::new_err(format!(
                "{what} must be one-dimensional, got {ndim} dimensions"
            )));
        }
        let format: String = mv.getattr("format")?.extract()?;
        let itemsize: usize = mv.getattr("itemsize")?.extract()?;
        let elem = Elem::from_format(&format, itemsize).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{what}: buffer of format {format:?} is not an integer array"
            ))
        })?;
        let bytes = mv.call_method0("tobytes")?;
        let bytes = bytes.cast::<PyBytes>()?;
        return decode(bytes.as_bytes(), elem, what);
    }
    match obj.try_iter() {
        Ok(it) => it
            .enumerate()
            .map(|(i, v)| extract_u64(&v?, what, i))
            .collect(),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of non-negative ints (list, tuple, array), got {}",
            obj.get_type().name()?
        ))),
    }
}

fn extract_u64(v: &Bound<'_, PyAny>, what: &str, i: usize) -> PyResult<u64> {
    v.extract::<u64>().map_err(|_| {
        let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
        PyValueError::new_err(format!(
            "{what}[{i}] must be a non-negative int below 2**64, got {shown}"
        ))
    })
}

/// Reads a contiguous one-dimensional integer array through its `__array_interface__`.
/// `None` when the interface describes something else (strided, float, ...), so the caller
/// can fall back to a converting path.
fn from_array_interface(
    owner: &Bound<'_, PyAny>,
    iface: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Option<Vec<u64>>> {
    let Ok(iface) = iface.cast::<PyDict>() else {
        return Ok(None);
    };
    let get = |k: &str| iface.get_item(k);
    let shape: Vec<usize> = match get("shape")? {
        Some(s) => s.extract()?,
        None => return Ok(None),
    };
    if shape.len() > 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be one-dimensional, got shape {shape:?}"
        )));
    }
    if get("strides")?.is_some_and(|s| !s.is_none()) || get("mask")?.is_some_and(|m| !m.is_none()) {
        return Ok(None);
    }
    let Some(elem) = get("typestr")?
        .and_then(|t| t.extract::<String>().ok())
        .and_then(|t| Elem::from_typestr(&t))
    else {
        return Ok(None);
    };
    let (ptr, _readonly): (usize, bool) = match get("data")? {
        Some(d) => match d.extract() {
            Ok(v) => v,
            Err(_) => return Ok(None),
        },
        None => return Ok(None),
    };
    let n = shape.first().copied().unwrap_or(1);
    let len = n
        .checked_mul(elem.size())
        .ok_or_else(|| PyValueError::new_err(format!("{what}: array too large")))?;
    if len == 0 {
        return Ok(Some(Vec::new()));
    }
    // Copy the bytes out while `owner` (which owns the memory) is alive and the GIL is held.
    let mut bytes = vec![0u8; len];
    // SAFETY: the array interface protocol promises that `data` points at `shape[0]`
    // contiguous elements of `typestr` (strides absent = C-contiguous) for as long as the
    // exporting object lives; `owner` is borrowed for this whole call. A raw copy (never a
    // Rust reference into that memory) tolerates concurrent writers.
    unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, bytes.as_mut_ptr(), len) };
    let _ = owner;
    decode(&bytes, elem, what).map(Some)
}

/// Owns a `Vec<u64>` that numpy views without copying (its `__array_interface__`); also a
/// read-only sequence on its own when numpy is not installed.
#[pyclass(frozen, module = "pagewire._native")]
pub(crate) struct U64Array {
    data: Vec<u64>,
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

/// `data` as a read-only numpy `uint64` array viewing the vector (no copy) when numpy is
/// importable, else as a list of ints.
pub(crate) fn u64_array(py: Python<'_>, data: Vec<u64>) -> PyResult<Py<PyAny>> {
    match py.import("numpy") {
        Ok(np) => {
            let owner = Bound::new(py, U64Array { data })?;
            Ok(np.call_method1("asarray", (owner,))?.unbind())
        }
        Err(_) => Ok(PyList::new(py, data)?.into_any().unbind()),
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

    #[test]
    fn decode_sign_extends_and_rejects_negatives() {
        let v = decode(&[1, 0, 0xff, 0x7f], Elem::I(2), "x").unwrap();
        assert_eq!(v, [1, 0x7fff]);
        assert!(decode(&[0xff, 0xff], Elem::I(2), "x").is_err());
        let v = decode(&[0xff, 0xff], Elem::U(2), "x").unwrap();
        assert_eq!(v, [0xffff]);
    }

    #[test]
    fn typestr_and_format_parsing() {
        assert!(matches!(Elem::from_typestr("<u8"), Some(Elem::U(8))));
        assert!(matches!(Elem::from_typestr("|i1"), Some(Elem::I(1))));
        assert!(Elem::from_typestr(">u8").is_none());
        assert!(Elem::from_typestr("<f8").is_none());
        assert!(matches!(Elem::from_format("q", 8), Some(Elem::I(8))));
        assert!(Elem::from_format("d", 8).is_none());
    }
}
