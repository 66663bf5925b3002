//! Bindings of `pagewire-layout`: pool geometry, page segments and transfer plans.
//!
//! The classes are thin: arguments are converted once (index arrays without a Python loop,
//! see [`crate::convert`]), the crate computes, and the results go back as read-only numpy
//! views of the Rust vectors (no copy), or as lists when numpy is absent or asked for.
//! Every `pagewire_layout::LayoutError` becomes a `pagewire.LayoutError` (a `ValueError`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyRange, PyTuple, PyType};

use pagewire_layout as pl;

use crate::convert::{
    U64Array, U64Source, compute, have_numpy, recycle, u64_array, u64_source, u64_vec, u64_view,
    vec_for,
};
use crate::errors::PagewireError;

// ---------------------------------------------------------------------------------------
// LayoutError

const LAYOUT_ERROR_DOC: &str = "\
Invalid geometry, layout, base address, index list or plan request.

Mirrors ``pagewire_layout::LayoutError``: the message names the bad value, and ``code``
names the case (``\"misaligned\"``, ``\"non_consecutive\"``, ``\"slot_out_of_range\"``,
``\"split_factor\"``, ``\"unsupported_layout\"``, ...). A subclass of both
:class:`PagewireError` and :class:`ValueError`.";

/// `pagewire.LayoutError(PagewireError, ValueError)`, created once. PyO3's
/// `create_exception!` takes a single base, so the class is made with `type(...)`.
fn layout_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    TYPE.get_or_try_init(py, || {
        let bases = PyTuple::new(
            py,
            [
                py.get_type::<PagewireError>().into_any(),
                py.get_type::<PyValueError>().into_any(),
            ],
        )?;
        let ns = PyDict::new(py);
        ns.set_item("__module__", "pagewire.errors")?;
        ns.set_item("__doc__", LAYOUT_ERROR_DOC)?;
        ns.set_item("code", "invalid_argument")?;
        let ty = py
            .import("builtins")?
            .getattr("type")?
            .call1(("LayoutError", bases, ns))?;
        Ok(ty.cast_into::<PyType>()?.unbind())
    })
    .map(|t| t.bind(py))
}

/// A `LayoutError` with `message` and `code`.
fn layout_error(py: Python<'_>, message: String, code: &'static str) -> PyErr {
    let make = || -> PyResult<PyErr> {
        let exc = layout_error_type(py)?.call1((message,))?;
        exc.setattr("code", code)?;
        Ok(PyErr::from_value(exc))
    };
    make().unwrap_or_else(|e| e)
}

/// The snake-case name of a crate error's variant (`LayoutError.code`).
fn error_code(e: &pl::LayoutError) -> &'static str {
    use pl::LayoutError as E;
    match e {
        E::InvalidGeometry { .. } => "invalid_geometry",
        E::MissingField { .. } => "missing_field",
        E::ExtraField { .. } => "extra_field",
        E::UnknownPoolKind(_) => "unknown_pool_kind",
        E::UnknownLayout(_) => "unknown_layout",
        E::UnsupportedLayout { .. } => "unsupported_layout",
        E::SplitHeadsLayout { .. } => "split_heads_layout",
        E::SplitFactor { .. } => "split_factor",
        E::Base { .. } => "base",
        E::IndexCount { .. } => "index_count",
        E::Misaligned { .. } => "misaligned",
        E::NonConsecutive { .. } => "non_consecutive",
        E::SlotOutOfRange { .. } => "slot_out_of_range",
        E::PageOutOfRange { .. } => "page_out_of_range",
        E::DuplicatePage { .. } => "duplicate_page",
        E::IndexOutOfRange { .. } => "index_out_of_range",
        E::Overflow { .. } => "overflow",
        E::LengthMismatch { .. } => "length_mismatch",
        E::GeometryMismatch { .. } => "geometry_mismatch",
        E::KindMismatch { .. } => "kind_mismatch",
        E::HeadShard { .. } => "head_shard",
        E::TooLarge { .. } => "too_large",
        E::TooManyEntries { .. } => "too_many_entries",
        _ => "other",
    }
}

/// A crate error as a Python `LayoutError`.
fn to_py(py: Python<'_>, e: pl::LayoutError) -> PyErr {
    layout_error(py, e.to_string(), error_code(&e))
}

/// A bad argument value found by the bindings themselves.
fn bad_arg(py: Python<'_>, message: String) -> PyErr {
    layout_error(py, message, "invalid_argument")
}

/// `Result<T, LayoutError>` to `PyResult<T>`.
trait OrPy<T> {
    fn or_py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> OrPy<T> for pl::Result<T> {
    fn or_py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

// ---------------------------------------------------------------------------------------
// Argument conversions

/// A non-negative int argument: a `LayoutError` for an int out of `u64`'s range, a
/// `TypeError` for anything that is not an int (`bool` and floats included; numpy's
/// integers and other `__index__` types are ints).
fn arg_u64(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    let py = obj.py();
    let int_like = obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")?;
    if obj.is_instance_of::<PyBool>() || !int_like {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            obj.get_type().name()?
        )));
    }
    obj.extract::<u64>()
        .map_err(|_| bad_arg(py, format!("{name} must be in 0..2**64, got {obj}")))
}

fn opt_u64(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<u64>> {
    obj.filter(|o| !o.is_none())
        .map(|o| arg_u64(o, name))
        .transpose()
}

/// A `ValueError` from the conversions as a `LayoutError` (still a `ValueError`), so that
/// a negative index is reported like every other bad index.
fn as_layout_error(py: Python<'_>, e: PyErr) -> PyErr {
    let already = layout_error_type(py).is_ok_and(|t| e.is_instance(py, t));
    if !already && e.is_instance_of::<PyValueError>(py) {
        bad_arg(py, e.value(py).to_string())
    } else {
        e
    }
}

/// An index or address array as a vector (see [`u64_vec`]); a negative or out-of-range
/// element is a `LayoutError`, a non-integer one a `TypeError`.
fn indices(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    u64_vec(obj, what).map_err(|e| as_layout_error(obj.py(), e))
}

/// Token indices read in place when the object allows it (see [`u64_source`]).
fn index_source<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<U64Source<'py>> {
    u64_source(obj, what).map_err(|e| as_layout_error(obj.py(), e))
}

/// Token indices per chunk when an index array is read in place: 16 Ki indices (128 KiB),
/// which stay in the L2 cache while they are validated, and no big temporary allocation.
const CHUNK_INDICES: usize = 1 << 14;

/// A page position in an error of a chunk, made relative to the whole request.
fn shift_position(e: pl::LayoutError, pages_before: usize) -> pl::LayoutError {
    use pl::LayoutError as E;
    match e {
        E::Misaligned {
            position,
            slot,
            page_size,
        } => E::Misaligned {
            position: position + pages_before,
            slot,
            page_size,
        },
        E::NonConsecutive {
            position,
            offset,
            found,
            expected,
        } => E::NonConsecutive {
            position: position + pages_before,
            offset,
            found,
            expected,
        },
        other => other,
    }
}

/// Runs `f` (a per-page list builder over token indices) over `src`: in one call when the
/// indices were converted into a vector (without the GIL when long), else chunk by chunk
/// of whole pages, straight from the caller's array. `entries(pages)` is the whole
/// result's length, checked (against `pagewire_layout::MAX_ENTRIES`) before anything is
/// reserved: each chunk alone would pass the crate's own check.
fn chunked_meta<F>(
    py: Python<'_>,
    src: &U64Source<'_>,
    page_size: u64,
    entries: impl Fn(usize) -> pl::Result<usize>,
    f: F,
) -> PyResult<pl::Segments>
where
    F: Fn(&[u64], &mut pl::Segments) -> pl::Result<()> + Send + Sync,
{
    let mut out = pl::Segments::default();
    if let Some(v) = src.as_slice() {
        compute(py, v.len(), || f(v, &mut out)).or_py(py)?;
        return Ok(out);
    }
    let n = src.len();
    let p = usize::try_from(page_size).unwrap_or(usize::MAX);
    if !n.is_multiple_of(p) {
        return Err(to_py(
            py,
            pl::LayoutError::IndexCount {
                count: n,
                page_size,
            },
        ));
    }
    let total = entries(n / p).or_py(py)?;
    let per = (CHUNK_INDICES / p).max(1) * p;
    let mut buf = vec![0u64; per.min(n)];
    out.reserve(total);
    let mut part = pl::Segments::default();
    let mut start = 0;
    while start < n {
        let m = per.min(n - start);
        src.read(start, 1, &mut buf[..m])
            .map_err(|e| as_layout_error(py, e))?;
        part.clear();
        f(&buf[..m], &mut part).map_err(|e| to_py(py, shift_position(e, start / p)))?;
        out.ptrs.extend_from_slice(&part.ptrs);
        out.lens.extend_from_slice(&part.lens);
        start += m;
    }
    Ok(out)
}

/// `pool.page_meta(indices)` over indices that may be read in place.
///
/// For an array in memory, one pass collects each page's first slot and (strict checks)
/// verifies that every page is a run of consecutive slots; the crate then checks and maps
/// the first slots alone. SGLang's checks read only the first slot of each page, as SGLang
/// does. Any error goes through the crate's token-slot code (strict) or page by page
/// (SGLang's checks), which gives the exact error. Vectors come from [`vec_for`], so that
/// a caller dropping its previous result arrays gets their memory again.
fn page_meta_source(py: Python<'_>, pool: pl::Pool, src: &U64Source<'_>) -> PyResult<pl::Segments> {
    if let Some(v) = src.as_slice() {
        return compute(py, v.len(), || pool.page_meta(v)).or_py(py);
    }
    let p = pool.geometry().page_size();
    let n = src.len();
    let pu = usize::try_from(p).unwrap_or(usize::MAX);
    if !n.is_multiple_of(pu) {
        return Err(to_py(
            py,
            pl::LayoutError::IndexCount {
                count: n,
                page_size: p,
            },
        ));
    }
    let strict = pool.checks() != pl::Checks::Sglang;
    let pages = n / pu;
    // The result's length, checked before anything is reserved (an absurd layer count
    // would otherwise grow the lists until the process is killed).
    let entries = pool.meta_entries(pages).or_py(py)?;
    let mut firsts = vec_for(pages);
    let runs = src
        .run_starts_into(py, pu, strict, &mut firsts)
        .map_err(|e| as_layout_error(py, e));
    let result = match runs {
        Ok(true) => {
            // Room up front for at most 2**20 entries, as `Segments::reserve`.
            let room = entries.min(1 << 20);
            let mut seg = pl::Segments {
                ptrs: vec_for(room),
                lens: vec_for(room),
            };
            match compute(py, entries, || {
                pool.page_meta_from_starts_into(&firsts, &mut seg)
            }) {
                Ok(()) => Ok(seg),
                Err(_) => {
                    recycle(seg.ptrs);
                    recycle(seg.lens);
                    if strict {
                        exact_meta(py, pool, src)
                    } else {
                        sglang_pages(py, pool, &firsts)
                    }
                }
            }
        }
        Ok(false) => exact_meta(py, pool, src),
        Err(e) => Err(e),
    };
    recycle(firsts);
    result
}

/// `page_meta` through the crate's token-slot code, chunk by chunk: the exact error.
fn exact_meta(py: Python<'_>, pool: pl::Pool, src: &U64Source<'_>) -> PyResult<pl::Segments> {
    let p = pool.geometry().page_size();
    chunked_meta(
        py,
        src,
        p,
        |pages| pool.meta_entries(pages),
        move |idx, out| pool.page_meta_into(idx, out),
    )
}

/// SGLang-checked `page_meta` from each page's first slot alone (the other slots are not
/// read under these checks): page by page through the crate, for pages whose first slot is
/// misaligned or out of range (the rare path, which yields SGLang's pointer or the error).
fn sglang_pages(py: Python<'_>, pool: pl::Pool, firsts: &[u64]) -> PyResult<pl::Segments> {
    let p = usize::try_from(pool.geometry().page_size()).unwrap_or(usize::MAX);
    let mut page = vec![0u64; p];
    let mut out = pl::Segments::default();
    let mut part = pl::Segments::default();
    for (k, &t0) in firsts.iter().enumerate() {
        page[0] = t0;
        pool.page_meta_into(&page, &mut part)
            .map_err(|e| to_py(py, shift_position(e, k)))?;
        out.ptrs.extend_from_slice(&part.ptrs);
        out.lens.extend_from_slice(&part.lens);
    }
    Ok(out)
}

fn parse_layout(py: Python<'_>, s: &str) -> PyResult<pl::Layout> {
    s.parse().or_py(py)
}

fn parse_checks(py: Python<'_>, s: &str) -> PyResult<pl::Checks> {
    match s {
        "strict" => Ok(pl::Checks::Strict),
        "sglang" => Ok(pl::Checks::Sglang),
        _ => Err(bad_arg(
            py,
            format!("unknown checks {s:?} (expected \"strict\" or \"sglang\")"),
        )),
    }
}

const fn checks_name(c: pl::Checks) -> &'static str {
    match c {
        pl::Checks::Sglang => "sglang",
        _ => "strict",
    }
}

/// A component name of `geometry`: `"k"`, `"v"`, or for MLA `"kv"`/`"latent"` (also `"k"`).
fn parse_component(py: Python<'_>, g: &pl::PoolGeometry, s: &str) -> PyResult<pl::Component> {
    let mla = g.kind() == pl::PoolKind::Mla;
    match (s, mla) {
        ("k", false) => Ok(pl::Component::K),
        ("v", false) => Ok(pl::Component::V),
        ("k" | "kv" | "latent", true) => Ok(pl::Component::Latent),
        _ => Err(bad_arg(
            py,
            format!(
                "unknown component {s:?} for a {} pool (expected {})",
                g.kind(),
                if mla { "\"kv\"" } else { "\"k\" or \"v\"" }
            ),
        )),
    }
}

/// A list of Python ints, made straight into the list (no vector of objects in between).
/// Runs of a repeated value (the lengths: one or two per page) share one int object, as in
/// SGLang's `[element_size] * n`.
fn int_list<'py>(py: Python<'py>, v: &[u64]) -> PyResult<Bound<'py, PyList>> {
    let mut recent: [Option<(u64, Bound<'py, PyAny>)>; 2] = [None, None];
    let items = v.iter().enumerate().map(|(i, &x)| {
        let slot = &mut recent[i % 2];
        match slot {
            Some((y, o)) if *y == x => o.clone(),
            _ => {
                // u64 to int cannot fail (the error type is `Infallible`).
                let Ok(o) = x.into_pyobject(py);
                let o = o.into_any();
                *slot = Some((x, o.clone()));
                o
            }
        }
    });
    PyList::new(py, items)
}

/// Two arrays as the tuple `(a, b)`: numpy views, or lists when `as_lists` or no numpy
/// (the vectors then go back for reuse, see [`recycle`]).
fn pair(py: Python<'_>, a: Vec<u64>, b: Vec<u64>, as_lists: bool) -> PyResult<Py<PyTuple>> {
    let (a, b) = if as_lists {
        let lists = (
            int_list(py, &a)?.into_any().unbind(),
            int_list(py, &b)?.into_any().unbind(),
        );
        recycle(a);
        recycle(b);
        lists
    } else {
        (u64_array(py, a)?, u64_array(py, b)?)
    };
    Ok(PyTuple::new(py, [a, b])?.unbind())
}

// ---------------------------------------------------------------------------------------
// Geometry

/// The shape of a host KV pool: everything but its layout and addresses.
///
/// ``Geometry("mha", layers=L, page_size=P, heads=H, head_dim=D, dtype_bytes=b,
/// capacity=S)`` describes SGLang's ``MHATokenToKVPoolHost``; add ``v_head_dim=Dv``
/// (``Dv != D``) for its ``AsymmetricMHATokenToKVPoolHost`` (kind ``"mha-split"``: K and V
/// in separate buffers). ``Geometry("mla", layers=L, page_size=P, kv_dim=C,
/// dtype_bytes=b, capacity=S)`` is its ``MLATokenToKVPoolHost`` (``C = kv_lora_rank +
/// qk_rope_head_dim``). ``capacity`` is SGLang's ``size``, in token slots, a multiple of
/// ``page_size``; ``dtype_bytes`` is ``dtype.itemsize``.
///
/// Raises :class:`LayoutError` for a missing, superfluous or zero field, a capacity that is
/// not a whole number of pages, or buffers larger than 2**57 bytes together (code
/// ``"too_large"``: more than any address space holds); ``TypeError`` for a field that is
/// not an int.
#[pyclass(frozen, eq, hash, module = "pagewire._native", name = "Geometry")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Geometry {
    inner: pl::PoolGeometry,
}

#[pymethods]
impl Geometry {
    #[new]
    #[pyo3(signature = (
        kind = "mha", *, layers, page_size, dtype_bytes, capacity,
        heads = None, head_dim = None, v_head_dim = None, kv_dim = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        layers: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        dtype_bytes: &Bound<'_, PyAny>,
        capacity: &Bound<'_, PyAny>,
        heads: Option<&Bound<'_, PyAny>>,
        head_dim: Option<&Bound<'_, PyAny>>,
        v_head_dim: Option<&Bound<'_, PyAny>>,
        kv_dim: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let heads = opt_u64(heads, "heads")?;
        let head_dim = opt_u64(head_dim, "head_dim")?;
        let v_head_dim = opt_u64(v_head_dim, "v_head_dim")?;
        let kv_dim = opt_u64(kv_dim, "kv_dim")?;
        let mut kind: pl::PoolKind = kind.parse().or_py(py)?;
        // "mha" names the model family; K and V of different widths need two buffers,
        // which is SGLang's asymmetric pool ("mha-split").
        if kind == pl::PoolKind::Mha && v_head_dim.is_some() && v_head_dim != head_dim {
            kind = pl::PoolKind::MhaSplit;
        }
        let mut b = pl::PoolGeometry::builder(kind)
            .layers(arg_u64(layers, "layers")?)
            .page_size(arg_u64(page_size, "page_size")?)
            .dtype_bytes(arg_u64(dtype_bytes, "dtype_bytes")?)
            .capacity(arg_u64(capacity, "capacity")?);
        if let Some(v) = heads {
            b = b.heads(v);
        }
        if let Some(v) = head_dim {
            b = b.head_dim(v);
        }
        if let Some(v) = v_head_dim {
            b = b.v_head_dim(v);
        }
        if let Some(v) = kv_dim {
            b = b.kv_dim(v);
        }
        Ok(Self {
            inner: b.build().or_py(py)?,
        })
    }

    /// ``"mha"`` (one buffer, ``head_dim == v_head_dim``), ``"mha-split"`` (separate K and
    /// V buffers; any ``"mha"`` geometry with ``v_head_dim != head_dim``) or ``"mla"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind().as_str()
    }
    /// ``L``, layers.
    #[getter]
    fn layers(&self) -> u64 {
        self.inner.layers()
    }
    /// ``P``, tokens per page.
    #[getter]
    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }
    /// ``H``, KV heads (``None`` for MLA).
    #[getter]
    fn heads(&self) -> Option<u64> {
        self.mha().then(|| self.inner.heads())
    }
    /// ``D``, K head dim in elements (``None`` for MLA).
    #[getter]
    fn head_dim(&self) -> Option<u64> {
        self.mha().then(|| self.inner.head_dim())
    }
    /// ``Dv``, V head dim in elements (``None`` for MLA).
    #[getter]
    fn v_head_dim(&self) -> Option<u64> {
        self.mha().then(|| self.inner.v_head_dim())
    }
    /// ``C``, MLA latent width in elements (``None`` for MHA).
    #[getter]
    fn kv_dim(&self) -> Option<u64> {
        self.inner.kv_dim()
    }
    /// ``b``, bytes per element.
    #[getter]
    fn dtype_bytes(&self) -> u64 {
        self.inner.dtype_bytes()
    }
    /// ``S``, capacity in token slots.
    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }
    /// ``N = S / P``, pages.
    #[getter]
    fn pages(&self) -> u64 {
        self.inner.pages()
    }
    /// SGLang's ``size_per_token``: bytes of one token, all layers and buffers.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.inner.bytes_per_token()
    }

    /// The buffers of this kind, in SGLang's per-page order: ``("k", "v")`` or ``("kv",)``.
    #[getter]
    fn components(&self) -> Vec<&'static str> {
        self.inner
            .kind()
            .components()
            .iter()
            .map(|c| c.as_str())
            .collect()
    }

    /// Bytes of one token of one layer of a buffer (``H*D*b``, ``H*Dv*b`` or ``C*b``).
    fn row_bytes(&self, py: Python<'_>, component: &str) -> PyResult<u64> {
        Ok(self
            .inner
            .row_bytes(parse_component(py, &self.inner, component)?))
    }
    /// Bytes of one page of one layer of a buffer: SGLang's PD ``item_len``.
    fn layer_page_bytes(&self, py: Python<'_>, component: &str) -> PyResult<u64> {
        Ok(self
            .inner
            .layer_page_bytes(parse_component(py, &self.inner, component)?))
    }
    /// Bytes of one page, all layers, of a buffer: a page-major entry's length.
    fn page_bytes(&self, py: Python<'_>, component: &str) -> PyResult<u64> {
        Ok(self
            .inner
            .page_bytes(parse_component(py, &self.inner, component)?))
    }
    /// Bytes of a whole buffer (for ``"mha"``, ``"k"`` gives SGLang's ``V_OFF``).
    fn buffer_bytes(&self, py: Python<'_>, component: &str) -> PyResult<u64> {
        Ok(self
            .inner
            .buffer_bytes(parse_component(py, &self.inner, component)?))
    }

    fn __repr__(&self) -> String {
        let g = &self.inner;
        let shape = match g.kv_dim() {
            Some(c) => format!("kv_dim={c}"),
            None => format!(
                "heads={}, head_dim={}, v_head_dim={}",
                g.heads(),
                g.head_dim(),
                g.v_head_dim()
            ),
        };
        format!(
            "Geometry('{}', layers={}, page_size={}, {shape}, dtype_bytes={}, capacity={})",
            g.kind().as_str(),
            g.layers(),
            g.page_size(),
            g.dtype_bytes(),
            g.capacity()
        )
    }
}

impl Geometry {
    fn mha(&self) -> bool {
        self.inner.kind() != pl::PoolKind::Mla
    }
}

// ---------------------------------------------------------------------------------------
// Pool

/// A host KV pool: a geometry, a layout and the base address of each buffer.
///
/// ``Pool(geometry, layout, k_base, v_base=None, *, checks="strict")``. ``layout`` is one
/// of ``"layer_first"``, ``"page_first"``, ``"page_first_direct"``, ``"page_head"``
/// (not ``page_head`` for MLA). ``k_base`` is the K buffer's address (the latent buffer's
/// for MLA). ``v_base`` is required for ``"mha-split"``, refused for ``"mla"``, and for
/// ``"mha"`` defaults to SGLang's ``k_base + V_OFF`` (one allocation, K half then V half).
///
/// ``checks="strict"`` verifies that every page of token slots is ``t0, t0+1, ...,
/// t0+P-1`` with ``t0`` a multiple of ``P``, inside the pool. ``checks="sglang"`` reads only
/// what SGLang reads, each page's first slot (which must still leave the page inside the
/// pool), and gives SGLang's pointer for a misaligned one where SGLang answers.
///
/// Addresses are plain ints: nothing is read or written at them.
#[pyclass(frozen, eq, hash, module = "pagewire._native", name = "Pool")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Pool {
    inner: pl::Pool,
}

#[pymethods]
impl Pool {
    #[new]
    #[pyo3(signature = (geometry, layout, k_base, v_base = None, *, checks = "strict"))]
    fn new(
        py: Python<'_>,
        geometry: &Geometry,
        layout: &str,
        k_base: &Bound<'_, PyAny>,
        v_base: Option<&Bound<'_, PyAny>>,
        checks: &str,
    ) -> PyResult<Self> {
        let layout = parse_layout(py, layout)?;
        let checks = parse_checks(py, checks)?;
        let k = arg_u64(k_base, "k_base")?;
        let v = opt_u64(v_base, "v_base")?;
        let inner = pl::Pool::new(geometry.inner, layout, k, v).or_py(py)?;
        Ok(Self {
            inner: inner.with_checks(checks),
        })
    }

    /// The :class:`Geometry`.
    #[getter]
    fn geometry(&self) -> Geometry {
        Geometry {
            inner: *self.inner.geometry(),
        }
    }
    /// SGLang's layout name.
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.layout().as_str()
    }
    /// ``"strict"`` or ``"sglang"``.
    #[getter]
    fn checks(&self) -> &'static str {
        checks_name(self.inner.checks())
    }
    /// Base address of the K buffer (the latent buffer for MLA).
    #[getter]
    fn k_base(&self) -> u64 {
        self.inner.base(self.inner.components()[0])
    }
    /// Base address of the V buffer (``k_base + V_OFF`` for ``"mha"`` unless given;
    /// ``None`` for MLA).
    #[getter]
    fn v_base(&self) -> Option<u64> {
        self.has_v().then(|| self.inner.base(pl::Component::V))
    }
    /// ``[(address, length), ...]``: each buffer whole, in component order (what to register).
    #[getter]
    fn buffers(&self) -> Vec<(u64, u64)> {
        self.inner
            .components()
            .iter()
            .map(|&c| {
                let s = self.inner.buffer(c);
                (s.addr, s.len)
            })
            .collect()
    }
    /// Entries per page of :meth:`page_meta` (``2``, ``1``, or per layer for ``layer_first``).
    #[getter]
    fn entries_per_page(&self) -> usize {
        self.inner.entries_per_page()
    }
    /// Whether SGLang's ``get_page_buffer_meta`` answers for this kind and layout (otherwise
    /// :meth:`page_meta` is pagewire's extension).
    #[getter]
    fn sglang_has_meta(&self) -> bool {
        self.inner.sglang_has_meta()
    }
    /// Whether SGLang's ``get_split_heads_page_buffer_meta`` answers (``"mha"`` ``page_head``).
    #[getter]
    fn sglang_has_split_heads(&self) -> bool {
        self.inner.sglang_has_split_heads()
    }

    /// The same pool with other index checks (``"strict"`` or ``"sglang"``).
    fn with_checks(&self, py: Python<'_>, checks: &str) -> PyResult<Self> {
        Ok(Self {
            inner: self.inner.with_checks(parse_checks(py, checks)?),
        })
    }

    /// SGLang's ``get_page_buffer_meta(indices)``: ``(ptrs, lens)``.
    ///
    /// ``indices`` are host token slots, ``page_size`` per page (a list, tuple, numpy array,
    /// torch tensor, or anything with the buffer protocol or ``__array__``; arrays are read
    /// in place). Per page, in SGLang's order: K then V (``"mha"``, ``"mha-split"``) or the
    /// latent entry (``"mla"``) for the page-major layouts, and the same per layer for
    /// ``layer_first``. Identical to SGLang's lists where SGLang answers; correct where it
    /// refuses (``"mha-split"`` in ``layer_first`` and ``page_head``).
    ///
    /// Returns two read-only ``uint64`` numpy arrays (lists without numpy), or two lists of
    /// ints, SGLang's own return type, with ``as_lists=True``. Raises :class:`LayoutError`
    /// for a count that is not a multiple of ``page_size``, a page outside the pool, a
    /// misaligned or non-consecutive page (strict checks) or a negative index, and (code
    /// ``"too_many_entries"``, before anything is allocated) for a result of more than
    /// 2**28 entries, such as one page of a ``layer_first`` pool of 2**40 layers.
    #[pyo3(signature = (indices, *, as_lists = false))]
    fn page_meta(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        as_lists: bool,
    ) -> PyResult<Py<PyTuple>> {
        let src = index_source(indices, "indices")?;
        let seg = page_meta_source(py, self.inner, &src)?;
        pair(py, seg.ptrs, seg.lens, as_lists)
    }

    /// :meth:`page_meta` for page numbers instead of token slots (page ``p`` starts at slot
    /// ``p * page_size``).
    #[pyo3(signature = (pages, *, as_lists = false))]
    fn page_meta_for_pages(
        &self,
        py: Python<'_>,
        pages: &Bound<'_, PyAny>,
        as_lists: bool,
    ) -> PyResult<Py<PyTuple>> {
        let pages = indices(pages, "pages")?;
        let pool = self.inner;
        let n = pages.len().saturating_mul(pool.entries_per_page());
        let seg = compute(py, n, || pool.page_meta_for_pages(&pages)).or_py(py)?;
        pair(py, seg.ptrs, seg.lens, as_lists)
    }

    /// SGLang's ``get_split_heads_page_buffer_meta(indices, split_factor)``: ``(ptrs, lens)``.
    ///
    /// For ``page_head`` pools, where the heads of a page are outermost: per page, per head
    /// group ``g < factor``, the K then the V entry of heads ``[g*H/factor,
    /// (g+1)*H/factor)``, each ``L*P*(H/factor)*D*b`` bytes (``Dv`` for V). SGLang answers
    /// for ``"mha"``; ``"mha-split"`` is pagewire's extension. Raises :class:`LayoutError`
    /// for any other layout, an MLA pool, or a factor that does not divide ``heads``.
    /// Returns like :meth:`page_meta`.
    #[pyo3(signature = (indices, factor, *, as_lists = false))]
    fn split_heads_meta(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        factor: &Bound<'_, PyAny>,
        as_lists: bool,
    ) -> PyResult<Py<PyTuple>> {
        let factor = arg_u64(factor, "factor")?;
        let src = index_source(indices, "indices")?;
        let pool = self.inner;
        let g = pool.geometry();
        let entries = |pages| pool.split_heads_entries(pages, factor);
        let seg = chunked_meta(py, &src, g.page_size(), entries, move |idx, out| {
            pool.for_each_split_heads_segment(idx, factor, |_, s| out.push(s))
                .map(drop)
        })?;
        pair(py, seg.ptrs, seg.lens, as_lists)
    }

    /// Address of element (``component``, token ``slot``, ``layer``, ``head``, ``dim``).
    #[pyo3(signature = (component, slot, layer, head = None, dim = None))]
    fn element_addr(
        &self,
        py: Python<'_>,
        component: &str,
        slot: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        head: Option<&Bound<'_, PyAny>>,
        dim: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let c = parse_component(py, self.inner.geometry(), component)?;
        self.inner
            .element_addr(
                c,
                arg_u64(slot, "slot")?,
                arg_u64(layer, "layer")?,
                opt_u64(head, "head")?.unwrap_or(0),
                opt_u64(dim, "dim")?.unwrap_or(0),
            )
            .or_py(py)
    }

    fn __repr__(&self) -> String {
        let v = match self.v_base() {
            Some(v) => format!(", v_base={v:#x}"),
            None => String::new(),
        };
        format!(
            "Pool({}, '{}', k_base={:#x}{v}, checks='{}')",
            self.geometry().__repr__(),
            self.layout(),
            self.k_base(),
            self.checks()
        )
    }
}

impl Pool {
    fn has_v(&self) -> bool {
        self.inner.geometry().kind() != pl::PoolKind::Mla
    }
}

// ---------------------------------------------------------------------------------------
// TransferPlan

/// ``(src, dst, len)`` transfers as three parallel arrays: the arguments of Mooncake's
/// ``batch_transfer_sync_write(session, srcs, dsts, lens)``.
///
/// Made by :func:`plan` and :func:`pd_connector_plan`, or from three equal-length integer
/// sequences: ``TransferPlan(srcs, dsts, lens)``. ``srcs``, ``dsts`` and ``lens`` are
/// read-only ``uint64`` numpy views of the plan's own memory (no copy; lists without
/// numpy); ``len(plan)`` is the number of transfers and ``plan.bytes`` their total size.
/// Iterating gives ``(src, dst, len)`` tuples.
#[pyclass(frozen, module = "pagewire._native", name = "TransferPlan")]
pub(crate) struct TransferPlan {
    arrays: [Py<U64Array>; 3],
    /// numpy views of `arrays`, made on first access (only when numpy is importable:
    /// lists are mutable, so they are never cached).
    views: [PyOnceLock<Py<PyAny>>; 3],
    total: u64,
}

impl TransferPlan {
    fn from_parts(
        py: Python<'_>,
        srcs: Vec<u64>,
        dsts: Vec<u64>,
        lens: Vec<u64>,
    ) -> PyResult<Self> {
        let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
        Ok(Self {
            arrays: [
                Py::new(py, U64Array::new(srcs))?,
                Py::new(py, U64Array::new(dsts))?,
                Py::new(py, U64Array::new(lens))?,
            ],
            views: [PyOnceLock::new(), PyOnceLock::new(), PyOnceLock::new()],
            total,
        })
    }

    fn from_plan(py: Python<'_>, plan: pl::TransferPlan) -> PyResult<Self> {
        let (s, d, l) = plan.into_parts();
        Self::from_parts(py, s, d, l)
    }

    fn view(&self, py: Python<'_>, i: usize) -> PyResult<Py<PyAny>> {
        let owner = self.arrays[i].bind(py);
        if !have_numpy(py) {
            return u64_view(owner);
        }
        self.views[i]
            .get_or_try_init(py, || u64_view(owner))
            .map(|v| v.clone_ref(py))
    }

    /// The three arrays `(srcs, dsts, lens)`, borrowed (for the transport bindings, which
    /// can post a native plan without converting its arrays back from Python).
    pub(crate) fn parts(&self) -> (&[u64], &[u64], &[u64]) {
        let [s, d, l] = &self.arrays;
        (s.get().as_slice(), d.get().as_slice(), l.get().as_slice())
    }
}

#[pymethods]
impl TransferPlan {
    #[new]
    #[pyo3(signature = (srcs = None, dsts = None, lens = None))]
    fn new(
        py: Python<'_>,
        srcs: Option<&Bound<'_, PyAny>>,
        dsts: Option<&Bound<'_, PyAny>>,
        lens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let get = |o: Option<&Bound<'_, PyAny>>, what| match o {
            Some(o) => indices(o, what),
            None => Ok(Vec::new()),
        };
        let (s, d, l) = (get(srcs, "srcs")?, get(dsts, "dsts")?, get(lens, "lens")?);
        if s.len() != d.len() || s.len() != l.len() {
            return Err(bad_arg(
                py,
                format!(
                    "srcs, dsts and lens must have the same length, got {}, {} and {}",
                    s.len(),
                    d.len(),
                    l.len()
                ),
            ));
        }
        Self::from_parts(py, s, d, l)
    }

    /// Source addresses: a read-only ``uint64`` numpy view (a list without numpy).
    #[getter]
    fn srcs(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.view(py, 0)
    }
    /// Destination addresses: a read-only ``uint64`` numpy view (a list without numpy).
    #[getter]
    fn dsts(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.view(py, 1)
    }
    /// Lengths in bytes: a read-only ``uint64`` numpy view (a list without numpy).
    #[getter]
    fn lens(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.view(py, 2)
    }
    /// Total bytes moved (the sum of ``lens``).
    #[getter]
    fn bytes(&self) -> u64 {
        self.total
    }

    fn __len__(&self) -> usize {
        self.arrays[0].get().as_slice().len()
    }

    /// Iterates over ``(src, dst, len)`` tuples.
    fn __iter__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (s, d, l) = self.parts();
        let items: Vec<(u64, u64, u64)> = s
            .iter()
            .zip(d)
            .zip(l)
            .map(|((&s, &d), &l)| (s, d, l))
            .collect();
        Ok(PyList::new(py, items)?.try_iter()?.into_any().unbind())
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<TransferPlan>()
            .is_ok_and(|o| o.get().parts() == self.parts())
    }

    fn __repr__(&self) -> String {
        format!("TransferPlan(len={}, bytes={})", self.__len__(), self.total)
    }
}

/// `(start, stop)` from a `range` with step 1 or a 2-tuple.
fn layer_range(obj: &Bound<'_, PyAny>) -> PyResult<std::ops::Range<u64>> {
    let py = obj.py();
    if let Ok((a, b)) = obj.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>() {
        return Ok(arg_u64(&a, "layers[0]")?..arg_u64(&b, "layers[1]")?);
    }
    if obj.is_instance_of::<PyRange>() {
        let step = arg_u64(&obj.getattr("step")?, "layers.step")?;
        if step != 1 {
            return Err(bad_arg(py, format!("layers must have step 1, got {step}")));
        }
        return Ok(arg_u64(&obj.getattr("start")?, "layers.start")?
            ..arg_u64(&obj.getattr("stop")?, "layers.stop")?);
    }
    Err(PyTypeError::new_err(
        "layers must be a range or a (start, stop) tuple",
    ))
}

/// A plan that copies page ``src_pages[i]`` of pool ``src`` to page ``dst_pages[i]`` of
/// pool ``dst``.
///
/// The pools need the same layers, page size, head dims (or ``kv_dim``) and element size;
/// their layouts, capacities, addresses and kinds may differ (``"mha"`` with
/// ``"mha-split"``, not MLA with MHA). Pages are page numbers, not token slots. Each run is
/// maximal: neighbouring blocks merge when both sides are contiguous, never across K and V.
///
/// ``heads=(src_first_head, dst_first_head)`` plans between different TP degrees: a pool
/// with ``H`` heads at TP rank ``r`` holds the model's heads ``[r*H, (r+1)*H)``; only the
/// heads both hold move. ``layers=range(a, b)`` (or ``(a, b)``) plans only those layers.
///
/// Raises :class:`LayoutError` for mismatched geometries or kinds, lists of different
/// lengths, a page outside a pool, a destination page listed twice, or shards that share
/// no head.
#[pyfunction]
#[pyo3(signature = (src, dst, src_pages, dst_pages, *, heads = None, layers = None))]
fn plan(
    py: Python<'_>,
    src: &Pool,
    dst: &Pool,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: &Bound<'_, PyAny>,
    heads: Option<&Bound<'_, PyAny>>,
    layers: Option<&Bound<'_, PyAny>>,
) -> PyResult<TransferPlan> {
    let sp = indices(src_pages, "src_pages")?;
    let dp = indices(dst_pages, "dst_pages")?;
    let shards = match heads.filter(|h| !h.is_none()) {
        None => None,
        Some(h) => {
            let (a, b) = h
                .extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()
                .map_err(|_| {
                    PyTypeError::new_err("heads must be a (src_first_head, dst_first_head) tuple")
                })?;
            Some(pl::HeadShards {
                src_first_head: arg_u64(&a, "heads[0]")?,
                dst_first_head: arg_u64(&b, "heads[1]")?,
            })
        }
    };
    let range = layers
        .filter(|l| !l.is_none())
        .map(layer_range)
        .transpose()?;
    let (s, d) = (src.inner, dst.inner);
    let work = sp
        .len()
        .saturating_mul(s.geometry().layers() as usize)
        .saturating_mul(2);
    let out = compute(py, work, || -> pl::Result<pl::TransferPlan> {
        match (shards, range) {
            (None, None) => pl::plan(&s, &d, &sp, &dp),
            (shards, range) => {
                let shards = shards.unwrap_or_default();
                let range = range.unwrap_or(0..s.geometry().layers());
                let mut out = pl::TransferPlan::new();
                pl::plan_layers_into(&s, &d, &sp, &dp, shards, range, &mut out)?;
                Ok(out)
            }
        }
    })
    .or_py(py)?;
    TransferPlan::from_plan(py, out)
}

/// The `(src, dst, item_len)` per-layer entries of SGLang's `_send_kvcache_generic`.
fn pd_layers(
    py: Python<'_>,
    src: &[u64],
    dst: &[u64],
    item_lens: &[u64],
    kind: &str,
    start_layer: u64,
) -> PyResult<Vec<(u64, u64, u64)>> {
    if item_lens.len() != src.len() {
        return Err(to_py(
            py,
            pl::LayoutError::LengthMismatch {
                what: "src_ptrs and item_lens",
                left: src.len(),
                right: item_lens.len(),
            },
        ));
    }
    let start = usize::try_from(start_layer).unwrap_or(usize::MAX);
    let slice = |from: usize, n: usize, what: &str| -> PyResult<&[u64]> {
        from.checked_add(n)
            .and_then(|end| dst.get(from..end))
            .ok_or_else(|| {
                bad_arg(
                    py,
                    format!(
                        "dst_ptrs has {} entries, too few for {what} [{from}, {from}+{n})",
                        dst.len()
                    ),
                )
            })
    };
    match kind {
        "mha" => {
            // `get_mha_kv_ptrs_with_pp`: both lists are [K layers..., V layers...]; the
            // decode side may hold more layers (a whole model against one PP stage, or
            // draft layers after the main ones).
            if !src.len().is_multiple_of(2) || !dst.len().is_multiple_of(2) {
                return Err(bad_arg(
                    py,
                    format!(
                        "kind=\"mha\" needs K and V halves: src_ptrs has {} and dst_ptrs {} entries",
                        src.len(),
                        dst.len()
                    ),
                ));
            }
            let n = src.len() / 2;
            let dst_total = dst.len() / 2;
            let (dk, dv) = if n == dst_total {
                (&dst[..n], &dst[n..])
            } else if n != 0 && n < dst_total && !dst_total.is_multiple_of(n) {
                // Decode has draft KV after the main K and V halves.
                let v_off = n * (dst_total / n);
                (
                    slice(start, n, "K layers")?,
                    slice(v_off.saturating_add(start), n, "V layers")?,
                )
            } else {
                (
                    slice(start, n, "K layers")?,
                    slice(dst_total.saturating_add(start), n, "V layers")?,
                )
            };
            let k = (0..n).map(|l| (src[l], dk[l], item_lens[l]));
            let v = (0..n).map(|l| (src[n + l], dv[l], item_lens[n + l]));
            Ok(k.chain(v).collect())
        }
        "flat" => {
            // `get_mla_kv_ptrs_with_pp` without compression ratios or draft entries.
            let d = if src.len() == dst.len() {
                dst
            } else {
                slice(start, src.len(), "layers")?
            };
            Ok((0..src.len())
                .map(|l| (src[l], d[l], item_lens[l]))
                .collect())
        }
        _ => Err(bad_arg(
            py,
            format!("unknown kind {kind:?} (expected \"mha\" or \"flat\")"),
        )),
    }
}

/// SGLang's PD Mooncake connector plan (``_send_kvcache_generic``), exactly.
///
/// ``src_ptrs``, ``dst_ptrs`` and ``item_lens`` are what prefill and decode publish from
/// ``get_contiguous_buf_infos()``: one base address per layer and buffer, and the bytes of
/// one page of that layer (``H*D*b*P`` for K, ``H*Dv*b*P`` for V, ``C*b*P`` for MLA).
/// ``src_pages`` and ``dst_pages`` are page numbers (``kv_to_page_indices``).
///
/// ``kind="mha"``: both address lists are ``[K layers..., V layers...]``; K layers are sent
/// first, then V, and a decode side holding more layers is sliced as SGLang does
/// (``get_mha_kv_ptrs_with_pp``, from ``start_layer``, draft layers after the main ones).
/// ``kind="flat"`` (MLA, K-only state): one list, sliced from ``start_layer`` when decode
/// holds more layers. For each layer, each run of pages consecutive on both sides becomes
/// one transfer ``(src + run_src*item_len, dst + run_dst*item_len, item_len*run_len)``.
///
/// Raises :class:`LayoutError` for lists of different lengths, a zero ``item_len``, a
/// decode list too short for the slice, or an address beyond 2**64.
#[pyfunction]
#[pyo3(signature = (src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages, *, kind = "mha", start_layer = None))]
#[allow(clippy::too_many_arguments)]
fn pd_connector_plan(
    py: Python<'_>,
    src_ptrs: &Bound<'_, PyAny>,
    dst_ptrs: &Bound<'_, PyAny>,
    item_lens: &Bound<'_, PyAny>,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: &Bound<'_, PyAny>,
    kind: &str,
    start_layer: Option<&Bound<'_, PyAny>>,
) -> PyResult<TransferPlan> {
    let src = indices(src_ptrs, "src_ptrs")?;
    let dst = indices(dst_ptrs, "dst_ptrs")?;
    let lens = indices(item_lens, "item_lens")?;
    let sp = indices(src_pages, "src_pages")?;
    let dp = indices(dst_pages, "dst_pages")?;
    let start = opt_u64(start_layer, "start_layer")?.unwrap_or(0);
    let layers = pd_layers(py, &src, &dst, &lens, kind, start)?;
    let work = sp.len().saturating_mul(layers.len());
    let out = compute(py, work, || {
        // One group per layer entry keeps SGLang's order (each entry's runs in turn) and
        // allows a different item_len per layer.
        let groups: Vec<pl::PdBuffers<'_>> = layers
            .iter()
            .map(|(s, d, l)| pl::PdBuffers {
                src: std::slice::from_ref(s),
                dst: std::slice::from_ref(d),
                item_len: *l,
            })
            .collect();
        pl::pd_connector_plan(&groups, &sp, &dp)
    })
    .or_py(py)?;
    TransferPlan::from_plan(py, out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LayoutError", layout_error_type(py)?)?;
    m.add_class::<Geometry>()?;
    m.add_class::<Pool>()?;
    m.add_class::<TransferPlan>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(pd_connector_plan, m)?)?;
    Ok(())
}
