//! Shared helpers for the transport integration tests: engine factories per backend,
//! device discovery for verbs (RDMA_DEVICE), patterns and checks.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use pagewire_transport::{
    Access, BackendKind, Batch, Engine, EngineConfig, EngineConfigBuilder, HostBuffer, Op, PeerId,
    ProgressMode, RegionId, TransferOp,
};

thread_local! {
    /// The progress mode [`config`] gives engines built on this thread: a suite runs
    /// once more on verbs with [`ProgressMode::Manual`] (each test has its own thread).
    pub static PROGRESS: std::cell::Cell<ProgressMode> =
        const { std::cell::Cell::new(ProgressMode::Auto) };
}

/// Bytes written around targets to detect stray writes.
pub const GUARD: u8 = 0xEE;

/// Largest single transfer the size sweep uses: `PAGEWIRE_TEST_MAX_BYTES`, else 64 MiB,
/// or 8 MiB inside the soft-RoCE guest (`SOFTROCE=1`: rxe under TCG moves ~50 MB/s and the
/// guest has 1 GiB of memory).
pub fn max_bytes() -> u64 {
    let default = if std::env::var("SOFTROCE").is_ok_and(|v| v == "1") {
        8 << 20
    } else {
        64 << 20
    };
    std::env::var("PAGEWIRE_TEST_MAX_BYTES")
        .ok()
        .and_then(|v| parse_size(&v))
        .unwrap_or(default)
}

/// Ops in the one-huge-batch test: `PAGEWIRE_TEST_MANY_OPS`, else 200,000, or 16,384
/// inside the soft-RoCE guest (`SOFTROCE=1`: rxe under TCG handles small WRs slowly; the
/// batch still dwarfs every send queue and window there).
pub fn many_ops() -> u64 {
    let default = if std::env::var("SOFTROCE").is_ok_and(|v| v == "1") {
        16_384
    } else {
        200_000
    };
    std::env::var("PAGEWIRE_TEST_MANY_OPS")
        .ok()
        .and_then(|v| parse_size(&v))
        .unwrap_or(default)
}

fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (n, m) = match v.chars().last()? {
        'K' | 'k' => (&v[..v.len() - 1], 1u64 << 10),
        'M' | 'm' => (&v[..v.len() - 1], 1 << 20),
        'G' | 'g' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    n.parse::<u64>().ok().map(|n| n * m)
}

/// Fails the test unless `kind` can run here. Verbs tests are `#[ignore]`d on a host and
/// run in the soft-RoCE VM with `--include-ignored` and `RDMA_DEVICE`: a verbs test that
/// is run without a device fails, it never passes without having run.
pub fn require(kind: BackendKind, test: &str) {
    if kind != BackendKind::Verbs {
        return;
    }
    match std::env::var("RDMA_DEVICE") {
        Ok(d) if !d.is_empty() => {}
        _ => panic!(
            "verbs::{test} needs an RDMA device: set RDMA_DEVICE, or run it in the \
             soft-RoCE VM (scripts/rdma-vm.sh test -p pagewire-transport)"
        ),
    }
}

/// A config builder for `kind` listening on localhost.
pub fn config(kind: BackendKind) -> EngineConfigBuilder {
    let mut b = EngineConfig::builder()
        .backend(kind)
        .listen("127.0.0.1:0".parse().expect("literal"))
        .batch_timeout(Duration::from_secs(30))
        .io_timeout(Duration::from_secs(10))
        .progress(PROGRESS.get());
    if kind == BackendKind::Verbs
        && let Ok(d) = std::env::var("RDMA_DEVICE")
    {
        b = b.rdma_device(d);
    }
    b
}

/// An engine of `kind` with default test settings.
pub fn engine(kind: BackendKind) -> Result<Engine> {
    engine_with(config(kind))
}

/// An engine from a builder.
pub fn engine_with(b: EngineConfigBuilder) -> Result<Engine> {
    let e = Engine::new(b.build()?).context("Engine::new")?;
    Ok(e)
}

/// `a` connects to `b`; returns (a's id for b, b's id for a).
pub fn connect(a: &Engine, b: &Engine) -> Result<(PeerId, PeerId)> {
    let ab = a.connect(b.local_addr()).context("connect")?;
    let ba = b
        .accept(Instant::now() + Duration::from_secs(10))
        .context("peer never showed up on the accepting side")?;
    Ok((ab, ba))
}

/// A registered buffer.
pub fn buffer(e: &Engine, len: usize, access: Access) -> Result<(HostBuffer, RegionId)> {
    let b = HostBuffer::new(len)?;
    let id = e.register(&b, access)?;
    Ok((b, id))
}

/// A position- and seed-dependent pattern of `len` bytes (misplaced bytes are detected).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b = (x >> (i * 8)) as u8;
    }
    buf
}

/// Fills a buffer with [`pattern`] (copied in: registered memory is never borrowed).
pub fn fill_pattern(buf: &mut HostBuffer, seed: u64) {
    fill_pattern_at(buf, 0, buf.len(), seed);
}

/// Fills `buf[off..off + len]` with [`pattern`]`(len, seed)`.
pub fn fill_pattern_at(buf: &mut HostBuffer, off: usize, len: usize, seed: u64) {
    buf.write_at(off, &pattern(len, seed));
}

/// Whether every byte equals `v` (memcmp against a block, fast in debug builds).
pub fn all_eq(s: &[u8], v: u8) -> bool {
    let block = [v; 4096];
    s.chunks(4096).all(|c| c == &block[..c.len()])
}

/// Asserts `dst[off..off+len] == src[soff..soff+len]` and guards elsewhere in `dst`
/// (both copied out: a registered buffer is never borrowed).
pub fn check_landed(
    dst: &HostBuffer,
    off: usize,
    src: &HostBuffer,
    soff: usize,
    len: usize,
) -> Result<()> {
    let (dst, src) = (dst.to_vec(), src.read_vec(soff..soff + len));
    if dst[off..off + len] != src[..] {
        let first = (0..len).find(|&i| dst[off + i] != src[i]).unwrap_or(0);
        bail!("payload mismatch: {len} bytes at offset {off}, first bad byte at +{first}");
    }
    if !all_eq(&dst[..off], GUARD) {
        bail!("guard bytes before offset {off} were overwritten");
    }
    if !all_eq(&dst[off + len..], GUARD) {
        bail!("guard bytes after offset {} were overwritten", off + len);
    }
    Ok(())
}

/// A deadline `secs` from now.
pub fn secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// `n / chunk` writes of `chunk` bytes each, from `local` to `remote` laid end to end,
/// under a 20 s batch deadline.
pub fn chunked_writes(local: u64, remote: u64, n: usize, chunk: usize) -> Batch {
    (0..n / chunk)
        .map(|i| TransferOp {
            op: Op::Write,
            local: local + (i * chunk) as u64,
            remote: remote + (i * chunk) as u64,
            len: chunk as u64,
        })
        .collect::<Batch>()
        .timeout(Duration::from_secs(20))
}
