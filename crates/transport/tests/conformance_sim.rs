//! The conformance suite on the simulated pair (`pagewire_transport::sim`): the portable
//! tests of `tests/conformance/suite.rs`, word for word, on engines of a deterministic
//! world over the core, with a simulated clock, one thread and no socket.
//!
//! Its own `main` (no libtest, which runs each test on a thread of its own) so that it can
//! check what it promises: the process has one thread and no socket before and after
//! every test, and the same seed gives the same trace (a hash of every event the world
//! handled) while another seed gives another.
//!
//! Not run here, with why (`tests/conformance/io.rs`, real backends only):
//! * `blocked_poster_does_not_starve_others`: its subject is a second thread blocked in
//!   `submit` while others send; the world has one thread and `submit` never blocks;
//! * `hostile_handshakes`: raw bytes and half-open connections on the control port's
//!   TCP socket (the world has no socket; hostile frames meet the same `core::wire` decoder
//!   and `core::handshake` states in their unit tests, the fuzz corpus and `tests/hostile.rs`);
//! * `handshake_flood`: the per-IP cap on half-open TCP connections (`net::admission`),
//!   which only sockets exercise.
//!
//! The tests run with `BackendKind::Loopback`, the contract the simulated data path keeps
//! (in order per connection, no fast path). Filter by name: `cargo test --test
//! conformance_sim -- prepared`.

mod common;

use std::time::Instant;

use anyhow::Result;
use pagewire_transport::BackendKind;
use pagewire_transport::sim::World;

/// What the portable tests see here: engines of the current simulated world, and its clock.
mod env {
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result};
    use pagewire_transport::sim::{SimEngine, World};
    use pagewire_transport::{
        Access, BackendKind, EngineConfigBuilder, HostBuffer, PeerId, RegionId,
    };

    pub use crate::common::{
        GUARD, all_eq, check_landed, chunked_writes, config, fill_pattern, fill_pattern_at,
        many_ops, max_bytes,
    };

    thread_local! {
        static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
    }

    /// Makes `w` the world the following calls use.
    pub fn install(w: World) {
        WORLD.with(|c| *c.borrow_mut() = Some(w));
    }

    pub fn world() -> World {
        WORLD.with(|c| c.borrow().clone().expect("a world is installed"))
    }

    pub fn engine(kind: BackendKind) -> Result<SimEngine> {
        engine_with(config(kind))
    }

    pub fn engine_with(b: EngineConfigBuilder) -> Result<SimEngine> {
        world().engine_with(b).context("SimEngine")
    }

    /// `a` connects to `b`; returns (a's id for b, b's id for a).
    pub fn connect(a: &SimEngine, b: &SimEngine) -> Result<(PeerId, PeerId)> {
        let ab = a.connect(b.local_addr()).context("connect")?;
        let ba = b
            .accept(secs(10))
            .context("peer never showed up on the accepting side")?;
        Ok((ab, ba))
    }

    pub fn buffer(e: &SimEngine, len: usize, access: Access) -> Result<(HostBuffer, RegionId)> {
        let b = HostBuffer::new(len)?;
        let id = e.register(&b, access)?;
        Ok((b, id))
    }

    pub fn now() -> Instant {
        world().now()
    }

    pub fn secs(s: u64) -> Instant {
        now() + Duration::from_secs(s)
    }

    pub fn elapsed(t: Instant) -> Duration {
        now().saturating_duration_since(t)
    }

    /// Simulated time moves on; the world delivers what arrives meanwhile.
    pub fn sleep(d: Duration) {
        world().advance(d);
    }

    /// One nap of the wait policy's first step.
    pub fn yield_now() {
        world().advance(Duration::from_micros(50));
    }

    /// The stand-in for a thread: `f` runs at the world's next step (inside the next
    /// wait of the test), to its end, its own waits stepping the world.
    pub fn spawn<T: 'static>(f: impl FnOnce() -> T + 'static) -> JoinHandle<T> {
        let slot = Rc::new(RefCell::new(None));
        let out = slot.clone();
        world().defer(Box::new(move || *out.borrow_mut() = Some(f())));
        JoinHandle(slot)
    }

    pub struct JoinHandle<T>(Rc<RefCell<Option<T>>>);

    impl<T> JoinHandle<T> {
        pub fn join(self) -> std::thread::Result<T> {
            let w = world();
            let far = w.now() + Duration::from_secs(3600);
            w.run_until(far, &mut || self.0.borrow().is_some());
            Ok(self.0.borrow_mut().take().expect("the deferred work ran"))
        }
    }
}

#[path = "conformance/suite.rs"]
mod portable;

type Test = fn(BackendKind) -> Result<()>;

/// Every portable test of the suite (all of `tests/conformance/suite.rs`).
const TESTS: &[(&str, Test)] = &[
    ("write_read_sizes", portable::write_read_sizes),
    ("layout_plan_pages", portable::layout_plan_pages),
    ("notifications_in_order", portable::notifications_in_order),
    ("notify_only", portable::notify_only),
    (
        "refused_write_is_not_notified",
        portable::refused_write_is_not_notified,
    ),
    ("prepared", portable::prepared),
    ("concurrency", portable::concurrency),
    ("cancellation", portable::cancellation),
    ("deadlines", portable::deadlines),
    ("peer_dies_mid_batch", portable::peer_dies_mid_batch),
    ("permissions", portable::permissions),
    (
        "registration_and_mr_split",
        portable::registration_and_mr_split,
    ),
    ("redescribe", portable::redescribe),
    (
        "known_on_both_sides_when_connect_returns",
        portable::known_on_both_sides_when_connect_returns,
    ),
    ("many_small_ops", portable::many_small_ops),
    ("tokens_and_mismatch", portable::tokens_and_mismatch),
];

const SEED: u64 = 0x5EED;

/// Threads of this process (Linux).
fn threads() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Sockets this process has open (Linux).
fn sockets() -> Option<usize> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    Some(
        dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_string_lossy().starts_with("socket:"))
            .count(),
    )
}

/// Runs one test in a fresh world: its outcome, the trace hash and the events handled.
fn run(test: Test, seed: u64, epoch: Instant) -> (Result<()>, u64, u64) {
    let w = World::new(seed, epoch);
    env::install(w.clone());
    let r = std::panic::catch_unwind(|| test(BackendKind::Loopback))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")));
    (r, w.trace_hash(), w.steps())
}

fn main() {
    // Filters as libtest's: plain words match test names; libtest's flags (and the values
    // of those that take one) are ignored, so `cargo test -- --include-ignored` works here.
    let mut filters: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    let mut list = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--test-threads" | "--skip" | "--format" | "--color" | "--logfile" | "-Z" => {
                args.next();
            }
            "--list" => list = true,
            f if f.starts_with('-') => {}
            _ => filters.push(a),
        }
    }
    if list {
        for (n, _) in TESTS {
            println!("sim::{n}: test");
        }
        return;
    }
    let chosen: Vec<_> = TESTS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    // The one clock read: simulated time starts here.
    let epoch = Instant::now();
    let (threads0, sockets0) = (threads(), sockets());
    println!("\nrunning {} tests on the simulated pair", chosen.len());
    let mut failed = Vec::new();
    for (name, test) in &chosen {
        let (r, hash, steps) = run(*test, SEED, epoch);
        let mut r = r;
        if r.is_ok() && (threads(), sockets()) != (threads0, sockets0) {
            r = Err(anyhow::anyhow!(
                "threads/sockets {:?} -> {:?}",
                (threads0, sockets0),
                (threads(), sockets())
            ));
        }
        match r {
            Ok(()) => println!("test sim::{name} ... ok ({steps} events, trace {hash:016x})"),
            Err(e) => {
                println!("test sim::{name} ... FAILED: {e:#}");
                failed.push(*name);
            }
        }
    }
    // Determinism: the same seed replays the same trace; another seed moves the timings.
    if filters.is_empty() {
        for (name, test) in TESTS.iter().filter(|(n, _)| {
            ["notifications_in_order", "prepared", "peer_dies_mid_batch"].contains(n)
        }) {
            let (a, ha, _) = run(*test, SEED, epoch);
            let (b, hb, _) = run(*test, SEED, epoch);
            let (c, hc, _) = run(*test, SEED + 1, epoch);
            let ok = a.is_ok() && b.is_ok() && c.is_ok() && ha == hb && ha != hc;
            println!(
                "test sim::deterministic::{name} ... {} (seed {SEED:#x}: {ha:016x}, {hb:016x}; seed {:#x}: {hc:016x})",
                if ok { "ok" } else { "FAILED" },
                SEED + 1
            );
            if !ok {
                failed.push(name);
            }
        }
    }
    println!(
        "one thread, no socket: threads {:?} -> {:?}, sockets {:?} -> {:?}",
        threads0,
        threads(),
        sockets0,
        sockets()
    );
    // (Where /proc cannot say, as off Linux, there is nothing to check.)
    if [threads0, threads()]
        .iter()
        .any(|t| t.is_some_and(|n| n != 1))
    {
        println!("FAILED: the simulated suite must run on one thread");
        failed.push("one thread");
    }
    if failed.is_empty() {
        println!("\ntest result: ok. {} passed\n", chosen.len());
    } else {
        println!("\ntest result: FAILED. failed: {failed:?}\n");
        std::process::exit(1);
    }
}
