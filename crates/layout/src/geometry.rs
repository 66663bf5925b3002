//! Pool kinds, layouts and the validated pool geometry.

use std::fmt;
use std::str::FromStr;

use crate::error::{LayoutError, MAX_POOL_BYTES, Result, product};

/// How the KV data of a pool is split into buffers.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum PoolKind {
    /// One buffer, K half then V half, `head_dim == v_head_dim`
    /// (SGLang's `MHATokenToKVPoolHost`).
    Mha,
    /// Separate K and V buffers with their own head dims
    /// (SGLang's `AsymmetricMHATokenToKVPoolHost`).
    MhaSplit,
    /// One latent buffer of `kv_dim` elements per token and layer
    /// (SGLang's `MLATokenToKVPoolHost`).
    Mla,
}

impl PoolKind {
    /// The CLI spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Mha => "mha",
            Self::MhaSplit => "mha-split",
            Self::Mla => "mla",
        }
    }

    /// The buffers ("components") of this kind, in SGLang's per-page order.
    pub const fn components(self) -> &'static [Component] {
        match self {
            Self::Mha | Self::MhaSplit => &[Component::K, Component::V],
            Self::Mla => &[Component::Latent],
        }
    }
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PoolKind {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "mha" => Ok(Self::Mha),
            "mha-split" | "mha_split" => Ok(Self::MhaSplit),
            "mla" => Ok(Self::Mla),
            _ => Err(LayoutError::UnknownPoolKind(s.to_owned())),
        }
    }
}

/// The byte order of a host pool, with SGLang's names (`--hicache-mem-layout`).
///
/// Inside one K, V or latent buffer, row-major, last axis fastest
/// (`N` pages, `S = N*P` slots, `o` = token in page):
///
/// | layout | dims |
/// |---|---|
/// | `layer_first` | (L, S, H, D) |
/// | `page_first` | (S, L, H, D) |
/// | `page_first_direct` | (N, L, P, H, D) |
/// | `page_head` | (N, H, P, L, D) |
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Layout {
    /// (L, S, H, D): every layer is one contiguous block, as on the GPU.
    LayerFirst,
    /// (S, L, H, D): all layers of a token together.
    PageFirst,
    /// (N, L, P, H, D): all layers of a page together, layer-major inside the page.
    PageFirstDirect,
    /// (N, H, P, L, D): all layers of a page together, head-major inside the page.
    PageHead,
}

impl Layout {
    /// All four layouts.
    pub const ALL: [Self; 4] = [
        Self::LayerFirst,
        Self::PageFirst,
        Self::PageFirstDirect,
        Self::PageHead,
    ];

    /// SGLang's spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
            Self::PageHead => "page_head",
        }
    }

    /// Whether one page of one buffer is a single byte run (all layouts but `layer_first`).
    pub const fn is_page_major(self) -> bool {
        !matches!(self, Self::LayerFirst)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Layout {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "layer_first" => Ok(Self::LayerFirst),
            "page_first" => Ok(Self::PageFirst),
            "page_first_direct" => Ok(Self::PageFirstDirect),
            "page_head" => Ok(Self::PageHead),
            _ => Err(LayoutError::UnknownLayout(s.to_owned())),
        }
    }
}

/// One buffer of a pool: the K part, the V part, or MLA's latent part.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Component {
    /// Keys.
    K,
    /// Values.
    V,
    /// MLA's single latent buffer.
    Latent,
}

impl Component {
    /// `k`, `v` or `kv` (the latter for MLA's latent buffer).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::K => "k",
            Self::V => "v",
            Self::Latent => "kv",
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The validated shape of a host KV pool: everything but the layout and the addresses.
///
/// Built with [`PoolGeometry::builder`]. Construction proves that the buffers together span
/// at most [`MAX_POOL_BYTES`] (2^57) bytes, so that any offset inside them can be computed
/// without overflow afterwards.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PoolGeometry {
    kind: PoolKind,
    layers: u64,
    page_size: u64,
    heads: u64,
    head_dim: u64,
    v_head_dim: u64,
    dtype_bytes: u64,
    capacity: u64,
    /// `capacity / page_size`, kept to avoid a division per page.
    pages: u64,
    /// `page_size - 1` when the page size is a power of two (alignment by mask), else 0.
    page_mask: u64,
    /// Bytes of one token of one layer: K (or latent), then V (0 for MLA).
    row: [u64; 2],
    /// Bytes of one whole buffer (`L*S*row`): K (or latent), then V.
    buffer: [u64; 2],
}

impl PoolGeometry {
    /// Start describing a pool of `kind`.
    pub fn builder(kind: PoolKind) -> GeometryBuilder {
        GeometryBuilder {
            kind,
            layers: None,
            page_size: None,
            heads: None,
            head_dim: None,
            v_head_dim: None,
            kv_dim: None,
            dtype_bytes: None,
            capacity: None,
        }
    }

    /// The pool kind.
    pub const fn kind(&self) -> PoolKind {
        self.kind
    }
    /// `L`, the number of layers.
    pub const fn layers(&self) -> u64 {
        self.layers
    }
    /// `P`, tokens per page.
    pub const fn page_size(&self) -> u64 {
        self.page_size
    }
    /// `H`, heads per token (1 for MLA).
    pub const fn heads(&self) -> u64 {
        self.heads
    }
    /// `D`, the K head dim in elements (`kv_dim` for MLA).
    pub const fn head_dim(&self) -> u64 {
        self.head_dim
    }
    /// `Dv`, the V head dim in elements (0 for MLA).
    pub const fn v_head_dim(&self) -> u64 {
        self.v_head_dim
    }
    /// `C`, the MLA latent width in elements (`None` for MHA pools).
    pub const fn kv_dim(&self) -> Option<u64> {
        match self.kind {
            PoolKind::Mla => Some(self.head_dim),
            _ => None,
        }
    }
    /// `b`, bytes per element.
    pub const fn dtype_bytes(&self) -> u64 {
        self.dtype_bytes
    }
    /// `S`, the capacity in token slots (a multiple of the page size).
    pub const fn capacity(&self) -> u64 {
        self.capacity
    }
    /// `N = S / P`, the number of pages.
    pub const fn pages(&self) -> u64 {
        self.pages
    }

    /// `P - 1` when the page size is a power of two (page starts are `t & mask == 0`).
    pub(crate) const fn page_mask(&self) -> Option<u64> {
        if self.page_mask != 0 || self.page_size == 1 {
            Some(self.page_mask)
        } else {
            None
        }
    }

    /// Whether token slot `t` starts a page (a mask test for power-of-two page sizes).
    #[inline]
    pub const fn is_page_start(&self, t: u64) -> bool {
        if self.page_mask != 0 || self.page_size == 1 {
            t & self.page_mask == 0
        } else {
            t.is_multiple_of(self.page_size)
        }
    }

    /// Heads of one buffer: `H` for K and V, 1 for the latent buffer.
    pub const fn component_heads(&self, c: Component) -> u64 {
        match c {
            Component::K | Component::V => self.heads,
            Component::Latent => 1,
        }
    }

    /// Elements per head of one buffer: `D`, `Dv` or `C`.
    pub const fn component_dim(&self, c: Component) -> u64 {
        match c {
            Component::K | Component::Latent => self.head_dim,
            Component::V => self.v_head_dim,
        }
    }

    /// Bytes of one token of one layer of one buffer (`H*D*b`, `H*Dv*b` or `C*b`).
    pub const fn row_bytes(&self, c: Component) -> u64 {
        self.row[slot(c)]
    }

    /// Bytes of one page of one layer of one buffer (`P*row`): SGLang's PD `item_len`.
    pub const fn layer_page_bytes(&self, c: Component) -> u64 {
        // Cannot overflow: it is at most `buffer_bytes`, which was checked.
        self.page_size * self.row[slot(c)]
    }

    /// Bytes of one page, all layers, of one buffer (`L*P*row`): the page-major segment length.
    pub const fn page_bytes(&self, c: Component) -> u64 {
        self.layers * self.page_size * self.row[slot(c)]
    }

    /// Bytes of one whole buffer (`L*S*row`); for `mha` this is SGLang's `V_OFF`.
    pub const fn buffer_bytes(&self, c: Component) -> u64 {
        self.buffer[slot(c)]
    }

    /// SGLang's `size_per_token`: bytes of one token over all layers and buffers.
    pub const fn bytes_per_token(&self) -> u64 {
        self.layers * (self.row[0] + self.row[1])
    }
}

const fn slot(c: Component) -> usize {
    match c {
        Component::K | Component::Latent => 0,
        Component::V => 1,
    }
}

/// Builder for [`PoolGeometry`]; [`GeometryBuilder::build`] validates.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct GeometryBuilder {
    kind: PoolKind,
    layers: Option<u64>,
    page_size: Option<u64>,
    heads: Option<u64>,
    head_dim: Option<u64>,
    v_head_dim: Option<u64>,
    kv_dim: Option<u64>,
    dtype_bytes: Option<u64>,
    capacity: Option<u64>,
}

impl GeometryBuilder {
    /// `L`, number of layers.
    pub fn layers(mut self, v: u64) -> Self {
        self.layers = Some(v);
        self
    }
    /// `P`, tokens per page.
    pub fn page_size(mut self, v: u64) -> Self {
        self.page_size = Some(v);
        self
    }
    /// `H`, heads (MHA kinds only).
    pub fn heads(mut self, v: u64) -> Self {
        self.heads = Some(v);
        self
    }
    /// `D`, K head dim (MHA kinds only).
    pub fn head_dim(mut self, v: u64) -> Self {
        self.head_dim = Some(v);
        self
    }
    /// `Dv`, V head dim; defaults to `D`. For `mha` it must equal `D`.
    pub fn v_head_dim(mut self, v: u64) -> Self {
        self.v_head_dim = Some(v);
        self
    }
    /// `C`, MLA latent width (MLA only).
    pub fn kv_dim(mut self, v: u64) -> Self {
        self.kv_dim = Some(v);
        self
    }
    /// `b`, bytes per element.
    pub fn dtype_bytes(mut self, v: u64) -> Self {
        self.dtype_bytes = Some(v);
        self
    }
    /// `S`, capacity in token slots (a multiple of the page size).
    pub fn capacity(mut self, v: u64) -> Self {
        self.capacity = Some(v);
        self
    }

    /// Validate and compute the derived sizes.
    ///
    /// # Errors
    /// [`LayoutError::MissingField`], [`LayoutError::ExtraField`],
    /// [`LayoutError::InvalidGeometry`] (zero sizes, `mha` with `Dv != D`, capacity not a
    /// multiple of the page size) and [`LayoutError::TooLarge`] (buffers larger than
    /// [`MAX_POOL_BYTES`] together).
    pub fn build(self) -> Result<PoolGeometry> {
        let kind = self.kind;
        let need = |field: &'static str, v: Option<u64>| -> Result<u64> {
            let v = v.ok_or(LayoutError::MissingField { field, kind })?;
            if v == 0 {
                return Err(LayoutError::InvalidGeometry {
                    field,
                    value: v,
                    reason: "must be at least 1",
                });
            }
            Ok(v)
        };
        let refuse = |field: &'static str, v: Option<u64>| -> Result<()> {
            match v {
                Some(value) => Err(LayoutError::ExtraField { field, value, kind }),
                None => Ok(()),
            }
        };
        let layers = need("layers", self.layers)?;
        let page_size = need("page_size", self.page_size)?;
        let dtype_bytes = need("dtype_bytes", self.dtype_bytes)?;
        let capacity = need("capacity", self.capacity)?;
        if !capacity.is_multiple_of(page_size) {
            return Err(LayoutError::InvalidGeometry {
                field: "capacity",
                value: capacity,
                reason: "must be a multiple of the page size",
            });
        }
        let (heads, head_dim, v_head_dim) = match kind {
            PoolKind::Mha | PoolKind::MhaSplit => {
                refuse("kv_dim", self.kv_dim)?;
                let heads = need("heads", self.heads)?;
                let d = need("head_dim", self.head_dim)?;
                let dv = match self.v_head_dim {
                    Some(_) => need("v_head_dim", self.v_head_dim)?,
                    None => d,
                };
                if kind == PoolKind::Mha && dv != d {
                    return Err(LayoutError::InvalidGeometry {
                        field: "v_head_dim",
                        value: dv,
                        reason: "an mha pool has v_head_dim == head_dim (use mha-split)",
                    });
                }
                (heads, d, dv)
            }
            PoolKind::Mla => {
                refuse("heads", self.heads)?;
                refuse("head_dim", self.head_dim)?;
                refuse("v_head_dim", self.v_head_dim)?;
                (1, need("kv_dim", self.kv_dim)?, 0)
            }
        };
        // All buffers together, in u128 (saturating at 2^128): once this is at most
        // MAX_POOL_BYTES, every size below, and every offset inside a buffer, fits in a u64.
        let per_token = product(&[heads, head_dim, dtype_bytes]).saturating_add(product(&[
            heads,
            v_head_dim,
            dtype_bytes,
        ]));
        let total = product(&[layers, capacity]).saturating_mul(per_token);
        if total > u128::from(MAX_POOL_BYTES) {
            return Err(LayoutError::TooLarge {
                what: match kind {
                    PoolKind::Mla => "layers x capacity x kv_dim x dtype_bytes",
                    _ => "layers x capacity x heads x (head_dim + v_head_dim) x dtype_bytes",
                },
                value: total,
                limit: MAX_POOL_BYTES,
            });
        }
        let k_row = heads * head_dim * dtype_bytes;
        let v_row = heads * v_head_dim * dtype_bytes;
        let k_buf = layers * capacity * k_row;
        let v_buf = layers * capacity * v_row;
        Ok(PoolGeometry {
            kind,
            layers,
            page_size,
            heads,
            head_dim,
            v_head_dim,
            dtype_bytes,
            capacity,
            pages: capacity / page_size,
            page_mask: if page_size.is_power_of_two() {
                page_size - 1
            } else {
                0
            },
            row: [k_row, v_row],
            buffer: [k_buf, v_buf],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for l in Layout::ALL {
            assert_eq!(l.as_str().parse::<Layout>().unwrap(), l);
        }
        for k in [PoolKind::Mha, PoolKind::MhaSplit, PoolKind::Mla] {
            assert_eq!(k.as_str().parse::<PoolKind>().unwrap(), k);
        }
        assert_eq!(
            "page_unified".parse::<Layout>(),
            Err(LayoutError::UnknownLayout("page_unified".into()))
        );
    }

    #[test]
    fn builder_validates() {
        let b = PoolGeometry::builder(PoolKind::Mha)
            .layers(2)
            .page_size(4)
            .heads(2)
            .head_dim(3)
            .dtype_bytes(2);
        assert_eq!(
            b.build(),
            Err(LayoutError::MissingField {
                field: "capacity",
                kind: PoolKind::Mha
            })
        );
        assert!(matches!(
            b.capacity(30).build(),
            Err(LayoutError::InvalidGeometry {
                field: "capacity",
                value: 30,
                ..
            })
        ));
        assert!(matches!(
            b.capacity(32).v_head_dim(2).build(),
            Err(LayoutError::InvalidGeometry {
                field: "v_head_dim",
                ..
            })
        ));
        let g = b.capacity(32).build().unwrap();
        assert_eq!(g.buffer_bytes(Component::K), 0x300);
        assert_eq!(g.page_bytes(Component::V), 96);
        assert_eq!(g.bytes_per_token(), 48);
        assert!(matches!(
            b.capacity(1 << 62).build(),
            Err(LayoutError::TooLarge { .. })
        ));
        assert!(matches!(
            PoolGeometry::builder(PoolKind::Mla)
                .layers(2)
                .page_size(4)
                .kv_dim(5)
                .heads(1)
                .dtype_bytes(2)
                .capacity(32)
                .build(),
            Err(LayoutError::ExtraField { field: "heads", .. })
        ));
    }
}
