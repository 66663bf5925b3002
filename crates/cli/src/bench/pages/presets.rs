//! Model presets with their KV geometry, element types, and where a pool's buffers
//! sit in its registered memory.
use clap::ValueEnum;
use pagewire_layout::{Component, Layout, Pool, PoolGeometry, PoolKind};

use super::PagesArgs;

/// Model presets with their real KV geometry (per TP rank = the whole model here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
pub enum Preset {
    /// Llama-3-8B: MHA (GQA), 32 layers, 8 KV heads, head_dim 128.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Llama-3-70B: MHA (GQA), 80 layers, 8 KV heads, head_dim 128.
    #[value(name = "llama3-70b")]
    Llama3_70b,
    /// DeepSeek-V3: MLA, 61 layers, latent kv_lora_rank 512 + rope 64 = 576.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// MiMo-V2-like asymmetric MHA: head_dim 192, v_head_dim 128 (48 layers, 4 KV heads).
    #[value(name = "mimo-v2")]
    MimoV2,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Llama3_8b => "llama3-8b",
            Preset::Llama3_70b => "llama3-70b",
            Preset::DeepseekV3 => "deepseek-v3",
            Preset::MimoV2 => "mimo-v2",
        }
    }

    /// (kind, layers, heads, head_dim, v_head_dim or kv_dim)
    pub(crate) fn shape(self) -> (PoolKind, u64, u64, u64, u64) {
        match self {
            Preset::Llama3_8b => (PoolKind::Mha, 32, 8, 128, 128),
            Preset::Llama3_70b => (PoolKind::Mha, 80, 8, 128, 128),
            Preset::DeepseekV3 => (PoolKind::Mla, 61, 1, 576, 576),
            Preset::MimoV2 => (PoolKind::MhaSplit, 48, 4, 192, 128),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
pub enum Dtype {
    Bf16,
    Fp16,
    Fp8,
    Fp32,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp8 => 1,
            Dtype::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Fp32 => "fp32",
        }
    }
}

/// The geometry both pools share.
pub fn geometry(a: &PagesArgs) -> anyhow::Result<PoolGeometry> {
    let (kind, layers, heads, d, dv) = a.model.shape();
    let layers = a.layers.unwrap_or(layers);
    let capacity = a.pool_pages().checked_mul(a.page_size).ok_or_else(|| {
        anyhow::anyhow!(
            "pool of {} pages x {} tokens overflows",
            a.pool_pages(),
            a.page_size
        )
    })?;
    let b = PoolGeometry::builder(kind)
        .layers(layers)
        .page_size(a.page_size)
        .dtype_bytes(a.dtype.bytes())
        .capacity(capacity);
    let b = match kind {
        PoolKind::Mla => b.kv_dim(d),
        PoolKind::MhaSplit => b.heads(heads).head_dim(d).v_head_dim(dv),
        _ => b.heads(heads).head_dim(d),
    };
    Ok(b.build()?)
}

/// Bytes of one pool, and the offset of its V buffer for `mha-split` (placed after K).
pub fn pool_bytes(g: &PoolGeometry) -> (u64, Option<u64>) {
    let k = g.buffer_bytes(Component::K);
    match g.kind() {
        PoolKind::Mla => (k, None),
        PoolKind::MhaSplit => (k + g.buffer_bytes(Component::V), Some(k)),
        // mha: one buffer holding K then V (SGLang's kv_buffer).
        _ => (k + g.buffer_bytes(Component::V), None),
    }
}

/// A pool placed at `base` (the start of its buffer).
pub fn place(g: PoolGeometry, layout: Layout, base: u64) -> anyhow::Result<Pool> {
    let (_, v_off) = pool_bytes(&g);
    Ok(Pool::new(g, layout, base, v_off.map(|o| base + o))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::pages::parse;
    #[test]
    fn presets_have_their_real_geometry() {
        let g = geometry(&parse(&["--page-size", "64", "--pool-pages", "2"])).unwrap();
        // Llama-3-8B: 2 * 32 layers * 8 heads * 128 * 2 B = 128 KiB per token.
        assert_eq!(g.bytes_per_token(), 131072);
        assert_eq!(g.page_bytes(Component::K), 32 * 64 * 8 * 128 * 2);
        let g = geometry(&parse(&["--model", "deepseek-v3", "--pool-pages", "2"])).unwrap();
        assert_eq!(g.kind(), PoolKind::Mla);
        assert_eq!(g.bytes_per_token(), 61 * 576 * 2);
        let g = geometry(&parse(&[
            "--model",
            "deepseek-v3",
            "--dtype",
            "fp8",
            "--pool-pages",
            "2",
        ]))
        .unwrap();
        assert_eq!(g.bytes_per_token(), 61 * 576);
        let g = geometry(&parse(&["--model", "mimo-v2", "--pool-pages", "2"])).unwrap();
        assert_eq!(g.kind(), PoolKind::MhaSplit);
        assert_eq!(g.bytes_per_token(), 48 * 4 * (192 + 128) * 2);
        let (bytes, v) = pool_bytes(&g);
        assert_eq!(v, Some(g.buffer_bytes(Component::K)));
        assert_eq!(
            bytes,
            g.buffer_bytes(Component::K) + g.buffer_bytes(Component::V)
        );
    }
}
