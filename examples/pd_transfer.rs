//! Prefill/decode KV page transfer over pagewire, with real pool geometry.
//!
//! A decode engine allocates free pages in its KV pool and sends their indices to the
//! prefill engine by writing a request into the prefill's exposed mailbox (a one-sided
//! WRITE with a notification: no side channel). The prefill builds a `layout` plan from
//! its `page_first` pool to the decode's `page_first_direct` pool and writes the pages
//! with one batch whose notification tells the decode side that every byte landed. The
//! decode side then verifies every byte of every page (and that no other page changed).
//!
//! ```text
//! cargo run --release -p pagewire-examples --example pd_transfer -- --same-process
//! cargo run --release -p pagewire-examples --example pd_transfer -- --role prefill --listen 0.0.0.0:7000
//! cargo run --release -p pagewire-examples --example pd_transfer -- --role decode --peer HOST:7000
//! ```
//!
//! Options: `--transport auto|tcp|loopback|verbs` (default auto; PAGEWIRE_* variables
//! apply too), `--layers 32 --heads 8 --head-dim 128 --page-size 16` (Llama-3-8B KV
//! geometry, bf16), `--pool-pages 64`, `--pages 16` per round, `--rounds 3`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_layout::{Component, Layout, Pool, PoolGeometry, PoolKind};
use pagewire_transport::{
    Access, BackendKind, Batch, Engine, EngineConfig, HostBuffer, Op, PeerId,
};

const MAGIC: u64 = 0x5044_5452_4551_0001; // "PDTREQ" v1
const MAILBOX: usize = 64 << 10;
const REQ_TAG: u32 = 0x1000_0000;
const DONE_TAG: u32 = 0x2000_0000;
const PREFILL_LAYOUT: Layout = Layout::PageFirst;
const DECODE_LAYOUT: Layout = Layout::PageFirstDirect;

#[derive(Debug, Clone)]
struct Args {
    role: Option<String>,
    listen: SocketAddr,
    peer: Option<String>,
    transport: Option<BackendKind>,
    layers: u64,
    heads: u64,
    head_dim: u64,
    page_size: u64,
    pool_pages: u64,
    pages: u64,
    rounds: u32,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        role: None,
        listen: "127.0.0.1:0".parse()?,
        peer: None,
        transport: None,
        layers: 32,
        heads: 8,
        head_dim: 128,
        page_size: 16,
        pool_pages: 64,
        pages: 16,
        rounds: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--same-process" => a.role = None,
            "--role" => a.role = Some(val()?),
            "--listen" => a.listen = val()?.parse().context("--listen ip:port")?,
            "--peer" => a.peer = Some(val()?),
            "--transport" => a.transport = Some(val()?.parse()?),
            "--layers" => a.layers = val()?.parse()?,
            "--heads" => a.heads = val()?.parse()?,
            "--head-dim" => a.head_dim = val()?.parse()?,
            "--page-size" => a.page_size = val()?.parse()?,
            "--pool-pages" => a.pool_pages = val()?.parse()?,
            "--pages" => a.pages = val()?.parse()?,
            "--rounds" => a.rounds = val()?.parse()?,
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("pd_transfer.rs")
                        .lines()
                        .take(19)
                        .map(|l| l.trim_start_matches("//!"))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    ensure!(
        a.pages >= 1 && a.pages <= a.pool_pages,
        "--pages must be 1..=--pool-pages"
    );
    ensure!(
        (4 + 2 * a.pages as usize) * 8 <= MAILBOX,
        "--pages too large for one request"
    );
    Ok(a)
}

fn geometry(a: &Args) -> Result<PoolGeometry> {
    Ok(PoolGeometry::builder(PoolKind::Mha)
        .layers(a.layers)
        .page_size(a.page_size)
        .heads(a.heads)
        .head_dim(a.head_dim)
        .dtype_bytes(2)
        .capacity(a.pool_pages * a.page_size)
        .build()?)
}

fn pool_bytes(g: &PoolGeometry) -> usize {
    (g.buffer_bytes(Component::K) + g.buffer_bytes(Component::V)) as usize
}

fn engine(a: &Args) -> Result<Engine> {
    let mut b = EngineConfig::builder().listen(a.listen).with_env()?;
    if let Some(t) = a.transport {
        b = b.backend(t);
    }
    let e = Engine::new(b.build()?)?;
    let info = e.backend_info();
    eprintln!(
        "[{}] backend {} ({}) device {} mtu {} qps or streams/peer {}; {}",
        e.local_addr(),
        info.kind,
        info.link,
        info.device,
        info.mtu,
        info.qps_or_streams,
        info.selection
    );
    Ok(e)
}

/// The prefill pool's content: a function of the byte offset, so the decode side can
/// compute what any byte must be.
fn expected_word(word_index: u64) -> u64 {
    let mut x = word_index.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn expected_bytes(offset: u64, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let o = offset + i as u64;
        *b = (expected_word(o / 8) >> ((o % 8) * 8)) as u8;
    }
}

fn fill_prefill_pool(buf: &mut [u8]) {
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&expected_word(i as u64).to_le_bytes());
    }
    let done = buf.len() / 8 * 8;
    expected_bytes(done as u64, &mut buf[done..]);
}

// ------------------------------------------------------------------------- prefill

fn run_prefill(
    a: &Args,
    e: &Engine,
    ready: Option<std::sync::mpsc::Sender<SocketAddr>>,
) -> Result<()> {
    let g = geometry(a)?;
    let mut pool = HostBuffer::new(pool_bytes(&g))?;
    // SAFETY: not registered yet, so nothing else reads or writes it while we fill it.
    fill_prefill_pool(unsafe { pool.as_mut_slice() });
    e.register(&pool, Access::LOCAL_WRITE)?;
    let mailbox = HostBuffer::new(MAILBOX)?;
    e.register(&mailbox, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let src_pool = Pool::new(g, PREFILL_LAYOUT, pool.addr(), None)?;
    eprintln!(
        "[prefill] pool {} pages x {} B ({} MiB, {PREFILL_LAYOUT}), listening on {}",
        a.pool_pages,
        pool_bytes(&g) as u64 / a.pool_pages,
        pool_bytes(&g) >> 20,
        e.local_addr()
    );
    if let Some(tx) = ready {
        tx.send(e.local_addr())?;
    }
    let peer = e
        .accept(Instant::now() + Duration::from_secs(300))
        .context("no decode engine connected within 300 s")?;
    loop {
        let note = e
            .poll_notification(Instant::now() + Duration::from_secs(300))
            .context("no request within 300 s")?;
        ensure!(
            note.peer == peer && note.tag & REQ_TAG != 0,
            "unexpected notification {note:?}"
        );
        // Copied out: the peer writes the mailbox, so it is never borrowed as a slice.
        let words: Vec<u64> = mailbox
            .to_vec()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        ensure!(words[0] == MAGIC, "bad request magic {:#x}", words[0]);
        let (round, n, dst_base) = (words[1] as u32, words[2] as usize, words[3]);
        ensure!(
            round == note.tag & !REQ_TAG,
            "request/notification round mismatch"
        );
        if n == 0 {
            eprintln!("[prefill] decode said goodbye");
            return Ok(());
        }
        ensure!(
            4 + 2 * n <= words.len(),
            "request of {n} pages does not fit"
        );
        let src_pages = &words[4..4 + n];
        let dst_pages = &words[4 + n..4 + 2 * n];
        let dst_pool = Pool::new(g, DECODE_LAYOUT, dst_base, None)?;
        let plan = pagewire_layout::plan(&src_pool, &dst_pool, src_pages, dst_pages)?;
        let t0 = Instant::now();
        let h = e.submit_plan(peer, Op::Write, &plan, Some(DONE_TAG | round))?;
        let st = h.wait(Instant::now() + Duration::from_secs(120))?;
        eprintln!(
            "[prefill] round {round}: {n} pages, {} plan entries, {} MiB written in {:.1} ms",
            plan.len(),
            st.bytes >> 20,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}

// -------------------------------------------------------------------------- decode

fn run_decode(a: &Args, e: &Engine, prefill: &str) -> Result<()> {
    let g = geometry(a)?;
    let mut pool = HostBuffer::new(pool_bytes(&g))?;
    e.register(&pool, Access::ALL)?;
    let mut req = HostBuffer::new(MAILBOX)?;
    e.register(&req, Access::LOCAL_WRITE)?;
    let dst_pool = Pool::new(g, DECODE_LAYOUT, pool.addr(), None)?;
    // The same prefill geometry at base 0: plan entries' sources are then pool offsets.
    let src_virtual = Pool::new(g, PREFILL_LAYOUT, 0, None)?;
    let peer: PeerId = e
        .connect(prefill)
        .with_context(|| format!("connect {prefill}"))?;
    let mailbox = e
        .peer_regions(peer)?
        .into_iter()
        .find(|r| r.access.contains(Access::REMOTE_WRITE) && r.len == MAILBOX as u64)
        .context("prefill exposes no mailbox")?;
    eprintln!(
        "[decode] connected to {prefill} as {peer}; pool {} pages ({DECODE_LAYOUT})",
        a.pool_pages
    );
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut total = (0u64, Duration::ZERO);
    for round in 1..=a.rounds {
        // Allocate distinct free pages on both sides (shuffled, so runs are scattered).
        let mut shuffle = |k: u64| {
            let mut v: Vec<u64> = (0..a.pool_pages).collect();
            for i in (1..v.len()).rev() {
                v.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            v.truncate(k as usize);
            v
        };
        let dst_pages = shuffle(a.pages);
        let src_pages = shuffle(a.pages);
        pool.fill(0xEE);
        let mut words = vec![MAGIC, round.into(), a.pages, pool.addr()];
        words.extend(&src_pages);
        words.extend(&dst_pages);
        for (i, w) in words.iter().enumerate() {
            req.write_at(i * 8, &w.to_le_bytes());
        }
        let t0 = Instant::now();
        e.submit(
            peer,
            Batch::new()
                .write(req.addr(), mailbox.addr, (words.len() * 8) as u64)
                .notify(REQ_TAG | round),
        )?
        .wait(Instant::now() + Duration::from_secs(60))?;
        let note = e
            .poll_notification(Instant::now() + Duration::from_secs(120))
            .context("pages never arrived")?;
        let elapsed = t0.elapsed();
        ensure!(
            note.peer == peer && note.tag == DONE_TAG | round,
            "unexpected {note:?}"
        );
        // Verify every byte of every plan entry, then that nothing else changed.
        let plan = pagewire_layout::plan(&src_virtual, &dst_pool, &src_pages, &dst_pages)?;
        let mut expect = Vec::new();
        let mut touched = 0u64;
        for t in &plan {
            let d = (t.dst - pool.addr()) as usize;
            expect.resize(t.len as usize, 0);
            expected_bytes(t.src, &mut expect);
            ensure!(
                pool.read_vec(d..d + t.len as usize) == expect,
                "round {round}: bytes differ at decode offset {d} ({} B from prefill offset {})",
                t.len,
                t.src
            );
            pool.fill_range(d..d + t.len as usize, 0xEE);
            touched += t.len;
        }
        ensure!(
            pool.to_vec().iter().all(|&b| b == 0xEE),
            "round {round}: bytes outside the pages changed"
        );
        total.0 += touched;
        total.1 += elapsed;
        println!(
            "round {round}: {} pages ({} plan entries, {:.1} MiB) landed and verified in {:.1} ms ({:.2} GB/s incl. request)",
            a.pages,
            plan.len(),
            touched as f64 / (1 << 20) as f64,
            elapsed.as_secs_f64() * 1e3,
            touched as f64 / elapsed.as_secs_f64() / 1e9
        );
    }
    // Goodbye: an empty request.
    for (i, w) in [MAGIC, u64::from(a.rounds + 1), 0, 0].iter().enumerate() {
        req.write_at(i * 8, &w.to_le_bytes());
    }
    e.submit(
        peer,
        Batch::new()
            .write(req.addr(), mailbox.addr, 32)
            .notify(REQ_TAG | (a.rounds + 1)),
    )?
    .wait(Instant::now() + Duration::from_secs(60))?;
    println!(
        "pd_transfer OK: {} rounds, {:.1} MiB verified, {:.2} GB/s average",
        a.rounds,
        total.0 as f64 / (1 << 20) as f64,
        total.0 as f64 / total.1.as_secs_f64() / 1e9
    );
    Ok(())
}

fn main() -> Result<()> {
    let a = parse_args()?;
    match a.role.as_deref() {
        None => {
            let p_engine = engine(&a)?;
            let d_engine = engine(&a)?;
            let (tx, rx) = std::sync::mpsc::channel();
            let pa = a.clone();
            let prefill = std::thread::spawn(move || run_prefill(&pa, &p_engine, Some(tx)));
            let addr = rx
                .recv_timeout(Duration::from_secs(60))
                .context("prefill did not start")?;
            // On a decode error, exit at once rather than wait for the prefill's timeout.
            run_decode(&a, &d_engine, &addr.to_string())?;
            prefill.join().expect("prefill thread panicked")
        }
        Some("prefill") => run_prefill(&a, &engine(&a)?, None),
        Some("decode") => {
            let peer = a
                .peer
                .clone()
                .context("--role decode needs --peer HOST:PORT")?;
            run_decode(&a, &engine(&a)?, &peer)
        }
        Some(r) => bail!("--role must be prefill or decode, not {r:?}"),
    }
}
