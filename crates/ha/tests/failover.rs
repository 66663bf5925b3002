//! Masters elected through a real etcd (started by the test on 127.0.0.1), in processes of
//! their own: the leader killed with SIGKILL while a client puts and gets (bytes checked),
//! the leader stopped past its lease and resumed (it must not answer), one etcd member
//! of three killed (the leader keeps leading), and a storage node process killed and
//! started again on the same port and address during a failover (it must not get the
//! old objects' segment back). Needs the `etcd` binary (scripts/setup.sh).

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{EtcdLocator, HaConfig, HaMaster, Role, client_config};
use pagewire_store::proto::{Request, Response};
use pagewire_store::{Code, MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

use common::{Buf, fill, frame, reply, say, wait_stdin_closed};

const ROLE: &str = "PW_HA_ROLE";
/// The leader's lease in these tests: etcd's floor, so failovers stay short.
const TTL: Duration = Duration::from_secs(2);
const PAGE: usize = 64 << 10;
/// The segment a node process offers.
const NODE_SEGMENT: u64 = 8 << 20;

/// The tests measure failovers: one at a time, so that they do not slow one another
/// down on a small machine.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The child master: campaigns, says `READY addr`, then `LEADER epoch` / `STANDBY` on
/// every change, until its stdin closes.
fn run_master() -> Result<()> {
    let level = match std::env::var("PAGEWIRE_LOG").as_deref() {
        Ok("info") => tracing::Level::INFO,
        Ok("warn") => tracing::Level::WARN,
        Ok("debug") => tracing::Level::DEBUG,
        _ => tracing::Level::ERROR,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    let mut cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    cfg.core.heartbeat_ms = 200;
    cfg.core.revoke_grace_ms = 200;
    let mut ha = HaConfig::new(std::env::var("PW_ETCD")?);
    ha.cluster_id = "t".into();
    ha.lease_ttl = Duration::from_secs(std::env::var("PW_TTL_S")?.parse()?);
    ha.poll = Duration::from_millis(50);
    let m = HaMaster::start(cfg, ha)?;
    say(format!("READY {}", m.local_addr()));
    std::thread::spawn(|| {
        wait_stdin_closed();
        std::process::exit(0);
    });
    let mut last = None;
    loop {
        let r = m.role();
        if Some(r) != last {
            match r {
                Role::Leader(e) => say(format!("LEADER {e}")),
                Role::Standby => say("STANDBY"),
            }
            last = Some(r);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A storage node (a store client offering [`NODE_SEGMENT`] bytes) whose engine listens
/// on `PW_LISTEN`: says `READY <base> <size> <segment id>`, then lives until its stdin
/// closes.
fn run_node() -> Result<()> {
    let mut c = client_config(
        &std::env::var("PW_ETCD")?,
        "t",
        Instant::now() + Duration::from_secs(5),
    )?;
    c.engine = common::engine(BackendKind::Tcp);
    c.engine.listen = std::env::var("PW_LISTEN")?.parse()?;
    c.segment_size = NODE_SEGMENT;
    c.timeout = Duration::from_secs(8);
    c.connect_timeout = Duration::from_secs(8);
    // The engine's threads (and the locator's) map their signal stacks as they start:
    // let them start before the segment is allocated, so that the segment lands at the
    // same address in every run.
    let engine = pagewire_transport::Engine::new(c.engine.clone())?;
    std::thread::sleep(Duration::from_millis(300));
    let node = StoreClient::with_engine(engine, c)?;
    let (base, size) = node.segment().context("no segment")?;
    let id = node.segment_id()?.context("not mounted")?;
    say(format!("READY {base} {size} {id}"));
    wait_stdin_closed();
    std::process::exit(0);
}

/// Entry point of the child master or node; a no-op in the normal test run.
#[test]
fn role() {
    let r = match std::env::var(ROLE).as_deref() {
        Ok("master") => run_master(),
        Ok("node") => run_node(),
        _ => return,
    };
    if let Err(e) = r {
        say(format!("FATAL {e:#}"));
        std::process::exit(3);
    }
}

/// This test binary re-run as `role` (the `ROLE` variable set to `role`), its stdout's
/// tagged lines, and its first line.
fn spawn_role(
    role: &str,
    env: &[(&str, String)],
    fixed_layout: bool,
) -> Result<(Child, Option<ChildStdin>, Receiver<String>, String)> {
    let mut cmd = common::role_command(ROLE, role, env)?;
    if fixed_layout {
        use std::os::unix::process::CommandExt;
        // SAFETY: personality(2) is async-signal-safe and touches only the child's own
        // execution domain (here: no address space randomization, so that two runs of
        // the same program map their memory at the same addresses).
        unsafe {
            cmd.pre_exec(|| {
                if libc::personality(libc::ADDR_NO_RANDOMIZE as libc::c_ulong) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn()?;
    let rx = common::tagged_lines(child.stdout.take().context("stdout")?);
    let stdin = child.stdin.take();
    let first = rx
        .recv_timeout(Duration::from_secs(15))
        .with_context(|| format!("{role}: no line within 15 s"));
    let first = match first {
        Ok(l) if !l.starts_with("FATAL") => l,
        other => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{role} said {other:?}");
        }
    };
    Ok((child, stdin, rx, first))
}

/// A master in a process of its own.
struct MasterProc {
    child: Child,
    _stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    addr: SocketAddr,
}

impl MasterProc {
    fn spawn(etcd: &str, ttl: Duration) -> Result<MasterProc> {
        let env = [
            ("PW_ETCD", etcd.to_string()),
            ("PW_TTL_S", ttl.as_secs().to_string()),
        ];
        let (child, stdin, lines, l) = spawn_role("master", &env, false)?;
        let mut m = MasterProc {
            child,
            _stdin: stdin,
            lines,
            addr: "0.0.0.0:0".parse()?,
        };
        m.addr = l
            .strip_prefix("READY ")
            .with_context(|| format!("master said {l:?}"))?
            .parse()?;
        Ok(m)
    }

    fn line(&mut self, timeout: Duration) -> Result<String> {
        let l = self
            .lines
            .recv_timeout(timeout)
            .with_context(|| format!("master {}: no line within {timeout:?}", self.addr))?;
        if l.starts_with("FATAL") {
            bail!("master {}: {l}", self.addr);
        }
        Ok(l)
    }

    /// Waits for the role line `want` ("LEADER" or "STANDBY").
    fn wait_role(&mut self, want: &str, timeout: Duration) -> Result<String> {
        let by = Instant::now() + timeout;
        loop {
            let left = by.saturating_duration_since(Instant::now());
            let l = self.line(left)?;
            if l.starts_with(want) {
                return Ok(l);
            }
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on a child this test spawned and has not reaped.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }

    /// SIGSTOP, and waits until the kernel shows every thread stopped (the signal is
    /// delivered asynchronously: a request sent right after `kill` could still be
    /// served).
    fn freeze(&self) -> Result<()> {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.child.id());
        let by = Instant::now() + Duration::from_secs(5);
        // "pid (comm) S ...": the state follows the command's closing parenthesis.
        let stopped = |stat: &str| {
            stat.rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next())
                == Some('T')
        };
        loop {
            let mut all = true;
            for t in std::fs::read_dir(&tasks)? {
                let stat = std::fs::read_to_string(t?.path().join("stat")).unwrap_or_default();
                all &= stopped(&stat);
            }
            if all {
                return Ok(());
            }
            ensure!(Instant::now() < by, "master {} not stopped", self.addr);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MasterProc {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill9();
    }
}

/// Two masters on `etcd` with a lease of [`TTL`], and which of them leads:
/// `(leader, standby, epoch)`.
fn two_masters(etcd: &EtcdCluster) -> Result<(MasterProc, MasterProc, u64)> {
    two_masters_with(etcd, TTL)
}

/// As [`two_masters`], with a lease of `ttl`.
fn two_masters_with(etcd: &EtcdCluster, ttl: Duration) -> Result<(MasterProc, MasterProc, u64)> {
    let a = MasterProc::spawn(&etcd.url(), ttl)?;
    let b = MasterProc::spawn(&etcd.url(), ttl)?;
    let loc = locator(etcd)?;
    let by = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some((addr, epoch)) = loc.leader(Instant::now() + Duration::from_secs(2))? {
            let (mut l, s) = if addr == a.addr.to_string() {
                (a, b)
            } else if addr == b.addr.to_string() {
                (b, a)
            } else {
                bail!(
                    "the leader key names {addr}, neither {} nor {}",
                    a.addr,
                    b.addr
                );
            };
            l.wait_role("LEADER", Duration::from_secs(5))?;
            return Ok((l, s, epoch));
        }
        ensure!(Instant::now() < by, "no leader within 15 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn locator(etcd: &EtcdCluster) -> Result<EtcdLocator> {
    Ok(EtcdLocator::connect(
        &etcd.url(),
        "t",
        Instant::now() + Duration::from_secs(5),
    )?)
}

/// A store client that follows the leader; `segment` bytes offered (0: none).
fn client(etcd: &EtcdCluster, segment: u64) -> Result<StoreClient> {
    client_within(etcd, segment, Duration::from_secs(8))
}

/// As [`client`], with `timeout` per call.
fn client_within(etcd: &EtcdCluster, segment: u64, timeout: Duration) -> Result<StoreClient> {
    let mut c = client_config(&etcd.url(), "t", Instant::now() + Duration::from_secs(5))?;
    c.engine = common::engine(BackendKind::Tcp);
    c.segment_size = segment;
    c.timeout = timeout;
    c.connect_timeout = Duration::from_secs(8);
    Ok(StoreClient::connect(c)?)
}

/// A client's source and destination pages.
struct Pages {
    src: Buf,
    dst: Buf,
}

impl Pages {
    fn new(c: &StoreClient) -> Pages {
        Pages {
            src: Buf::new(c, PAGE),
            dst: Buf::new(c, PAGE),
        }
    }

    /// Puts `key` (its pattern) and reads it back: whether both succeeded, and an error if
    /// a get returned bytes that are not the key's.
    fn round_trip(&mut self, c: &StoreClient, key: &str) -> Result<(bool, bool)> {
        fill(key, 7, &mut self.src.mem);
        let put = c.put(&[key], &[[self.src.span(0, PAGE)]], &PutOptions::default());
        let put_ok = matches!(put.as_deref(), Ok([Ok(())]));
        if !put_ok {
            eprintln!("round trip: put {key}: {put:?}");
            return Ok((false, false));
        }
        self.dst.mem.fill(0);
        let got = c.get(&[key], &[[self.dst.span(0, PAGE)]]);
        let get_ok = matches!(got.as_deref(), Ok([Ok(n)]) if *n == PAGE as u64);
        if !get_ok {
            eprintln!("round trip: get {key}: {got:?}");
        }
        if get_ok {
            ensure!(
                self.dst.mem == self.src.mem,
                "get of {key} returned wrong bytes"
            );
        }
        Ok((true, get_ok))
    }

    /// Gets `key`, put earlier by [`Pages::round_trip`]: an error unless it reads back
    /// whole with its bytes.
    fn read_back(&mut self, c: &StoreClient, key: &str) -> Result<()> {
        fill(key, 7, &mut self.src.mem);
        self.dst.mem.fill(0);
        let r = c.get(&[key], &[[self.dst.span(0, PAGE)]])?;
        ensure!(r == [Ok(PAGE as u64)], "{key}: {r:?}");
        ensure!(self.dst.mem == self.src.mem, "{key}: other bytes");
        Ok(())
    }
}

/// Puts and gets until both succeed once: how long that took.
fn until_served(c: &StoreClient, p: &mut Pages, tag: &str, within: Duration) -> Result<Duration> {
    let start = Instant::now();
    for i in 0.. {
        if p.round_trip(c, &format!("{tag}_{i}"))? == (true, true) {
            return Ok(start.elapsed());
        }
        ensure!(
            start.elapsed() < within,
            "{tag}: not served within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    unreachable!()
}

#[test]
fn leader_killed_standby_takes_over() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let (mut leader, mut standby, epoch) = two_masters(&etcd)?;
    let node = client(&etcd, 64 << 20)?;
    let c = client(&etcd, 0)?;
    let mut p = Pages::new(&c);
    for i in 0..16 {
        ensure!(p.round_trip(&c, &format!("before_{i}"))? == (true, true));
    }

    let killed = Instant::now();
    leader.kill9();
    until_served(&c, &mut p, "after", Duration::from_secs(20))?;
    let took = killed.elapsed();
    let l = standby.wait_role("LEADER", Duration::from_secs(1))?;
    let new_epoch: u64 = l["LEADER ".len()..].parse()?;
    ensure!(new_epoch > epoch, "epoch {new_epoch} after {epoch}");
    println!(
        "failover: first put and get served {:.2} s after SIGKILL of the leader (lease {TTL:?}), \
         epoch {epoch} -> {new_epoch}",
        took.as_secs_f64()
    );
    // The op-log kept what the old leader published: the same bytes.
    for i in 0..16 {
        p.read_back(&c, &format!("before_{i}"))
            .context("after failover")?;
    }
    for i in 0..16 {
        ensure!(p.round_trip(&c, &format!("later_{i}"))? == (true, true));
    }
    c.close();
    node.close();
    Ok(())
}

/// What the writers of [`two_clients_through_a_kill9`] saw.
#[derive(Default)]
struct Seen {
    /// Keys whose put was acknowledged, and whether before the kill.
    acked: Vec<(String, bool)>,
    /// First acknowledged put and first successful get after the kill.
    first_put: Option<Instant>,
    first_get: Option<Instant>,
    /// Gets that failed (any reason) after the kill.
    failed_gets: usize,
    failed_puts: usize,
}

/// One writer: puts its own keys, and after each acknowledged put reads back one of its
/// keys acknowledged earlier (before the kill first, once one exists), bytes checked,
/// until `stop`.
fn writer(
    c: StoreClient,
    tag: &'static str,
    killed: &std::sync::Mutex<Option<Instant>>,
    stop: &std::sync::atomic::AtomicBool,
    seen: &std::sync::Mutex<Seen>,
) -> Result<()> {
    let mut p = Pages::new(&c);
    let mut mine: Vec<(String, bool)> = Vec::new();
    let mut i = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        let after = *killed.lock().unwrap();
        let key = format!("{tag}_{i}");
        i += 1;
        fill(&key, 7, &mut p.src.mem);
        let put = c.put(&[&key], &[[p.src.span(0, PAGE)]], &PutOptions::default());
        let ok = matches!(put.as_deref(), Ok([Ok(())]));
        {
            let mut s = seen.lock().unwrap();
            if ok {
                s.acked.push((key.clone(), after.is_none()));
                if after.is_some() && s.first_put.is_none() {
                    s.first_put = Some(Instant::now());
                }
            } else if after.is_some() {
                s.failed_puts += 1;
            }
        }
        if ok {
            mine.push((key, after.is_none()));
        }
        // Read back a key acknowledged before the kill when there is one, else any.
        let pre: Vec<&(String, bool)> = mine.iter().filter(|k| k.1).collect();
        let pick = if !pre.is_empty() && after.is_some() {
            pre[i % pre.len()].0.clone()
        } else if let Some(k) = mine.last() {
            k.0.clone()
        } else {
            continue;
        };
        fill(&pick, 7, &mut p.src.mem);
        p.dst.mem.fill(0);
        let got = c.get(&[&pick], &[[p.dst.span(0, PAGE)]]);
        let get_ok = matches!(got.as_deref(), Ok([Ok(n)]) if *n == PAGE as u64);
        if get_ok {
            ensure!(p.dst.mem == p.src.mem, "get of {pick} returned wrong bytes");
        }
        let mut s = seen.lock().unwrap();
        if get_ok && after.is_some() && s.first_get.is_none() {
            s.first_get = Some(Instant::now());
        } else if !get_ok && after.is_some() {
            s.failed_gets += 1;
        }
    }
    c.close();
    Ok(())
}

/// The op-log through a SIGKILL of the leader while two clients put and get: every
/// object acknowledged before the kill reads back from the new leader with its bytes,
/// so does every one acknowledged after, and no get returns other bytes.
#[test]
fn two_clients_through_a_kill9_keep_every_acknowledged_object() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let (mut leader, mut standby, epoch) = two_masters(&etcd)?;
    let node = client(&etcd, 256 << 20)?;
    let killed = std::sync::Mutex::new(None);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let seen = std::sync::Mutex::new(Seen::default());
    let clients = [client(&etcd, 0)?, client(&etcd, 0)?];
    let (took_put, took_get, stats) = std::thread::scope(|sc| -> Result<_> {
        let handles: Vec<_> = clients
            .into_iter()
            .zip(["w0", "w1"])
            .map(|(c, tag)| sc.spawn(|| writer(c, tag, &killed, &stop, &seen)))
            .collect();
        let mut run = || -> Result<_> {
            std::thread::sleep(Duration::from_millis(1500));
            let at = Instant::now();
            leader.kill9();
            *killed.lock().unwrap() = Some(at);
            let by = at + Duration::from_secs(20);
            loop {
                let s = seen.lock().unwrap();
                if let (Some(p), Some(g)) = (s.first_put, s.first_get) {
                    break Ok((p - at, g - at, (s.failed_puts, s.failed_gets)));
                }
                drop(s);
                ensure!(Instant::now() < by, "not served within 20 s of the kill");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let r = run();
        // Both writers keep going for a moment on the new leader.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::Release);
        for h in handles {
            h.join().expect("writer panicked")?;
        }
        r
    })?;
    let l = standby.wait_role("LEADER", Duration::from_secs(1))?;
    let new_epoch: u64 = l["LEADER ".len()..].parse()?;
    ensure!(new_epoch > epoch);

    // Every acknowledged object, from a fresh client of the new leader.
    let c = client(&etcd, 0)?;
    let mut p = Pages::new(&c);
    let acked = std::mem::take(&mut seen.lock().unwrap().acked);
    let before = acked.iter().filter(|k| k.1).count();
    ensure!(before > 0 && acked.len() > before, "{acked:?}");
    for (key, _) in &acked {
        fill(key, 7, &mut p.src.mem);
        p.dst.mem.fill(0);
        let r = c.get(&[key], &[[p.dst.span(0, PAGE)]])?;
        ensure!(r == [Ok(PAGE as u64)], "{key}: {r:?}");
        ensure!(p.dst.mem == p.src.mem, "{key}: other bytes");
    }
    println!(
        "op-log failover (lease {TTL:?}): SIGKILL of the leader to the first acknowledged put \
         {:.2} s, to the first get of a key put before the kill {:.2} s; {before} objects \
         acknowledged before the kill and {} after, all read back byte-exact; {} puts and {} \
         gets failed meanwhile",
        took_put.as_secs_f64(),
        took_get.as_secs_f64(),
        acked.len() - before,
        stats.0,
        stats.1
    );
    c.close();
    node.close();
    Ok(())
}

/// Sends a heartbeat on `s` and waits for an answer: `Some` if one came.
fn heartbeat_answer(s: &mut TcpStream, within: Duration) -> Option<Response> {
    s.set_read_timeout(Some(within)).ok()?;
    s.write_all(&frame(&Request::Heartbeat, 99)).ok()?;
    reply(s).ok()
}

#[test]
fn stopped_leader_does_not_answer_after_its_lease() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let (mut leader, mut standby, epoch) = two_masters(&etcd)?;
    let node = client(&etcd, 64 << 20)?;
    let c = client(&etcd, 0)?;
    let mut p = Pages::new(&c);
    ensure!(p.round_trip(&c, "before")? == (true, true));
    // A session of its own on the leader, to send it a request while it is stopped.
    let mut raw = common::authenticated(leader.addr)?;
    ensure!(matches!(
        heartbeat_answer(&mut raw, Duration::from_secs(2)),
        Some(Response::Ack)
    ));

    leader.freeze()?;
    let stopped = Instant::now();
    // A call sent to the stopped leader: it goes on with the new one within its deadline.
    let r = c.exist(&["before"])?;
    let exist_took = stopped.elapsed();
    ensure!(
        r == [Ok(true)],
        "exist on the new leader (the op-log keeps it): {r:?}"
    );
    let l = standby.wait_role("LEADER", TTL * 4)?;
    let new_epoch: u64 = l["LEADER ".len()..].parse()?;
    ensure!(new_epoch > epoch);
    println!(
        "stopped leader: a call sent after SIGSTOP answered by the new leader {:.2} s after \
         the stop",
        exist_took.as_secs_f64()
    );
    // The request waits in the stopped leader's socket buffer.
    raw.write_all(&frame(&Request::Heartbeat, 7))?;
    std::thread::sleep(Duration::from_millis(300));
    leader.signal(libc::SIGCONT);
    raw.set_read_timeout(Some(Duration::from_secs(3)))?;
    let late = reply(&mut raw);
    ensure!(
        late.is_err(),
        "the deposed leader answered after its lease: {late:?}"
    );
    leader.wait_role("STANDBY", Duration::from_secs(5))?;
    // A new connection to it gets no Welcome either.
    let fresh = common::authenticated(leader.addr);
    ensure!(
        fresh.is_err(),
        "the deposed leader welcomed a new connection"
    );
    // The client follows the new leader.
    until_served(&c, &mut p, "after", Duration::from_secs(15))?;
    c.close();
    node.close();
    Ok(())
}

/// Two masters with a lease of `ttl` on a three-member etcd; `disrupt` takes one member
/// out (and says how); the leader must keep leading and serving for two lease periods.
fn keeps_leading_through(
    ttl: Duration,
    disrupt: impl FnOnce(&mut EtcdCluster) -> String,
) -> Result<()> {
    let _serial = serial();
    let mut etcd = EtcdCluster::start(3);
    let (leader, _standby, epoch) = two_masters_with(&etcd, ttl)?;
    let node = client(&etcd, 64 << 20)?;
    let c = client(&etcd, 0)?;
    let mut p = Pages::new(&c);
    ensure!(p.round_trip(&c, "before")? == (true, true));
    let what = disrupt(&mut etcd);
    // Two lease periods: every renewal must reach a live member.
    let until = Instant::now() + ttl * 2;
    let mut i = 0;
    while Instant::now() < until {
        ensure!(
            p.round_trip(&c, &format!("during_{i}"))? == (true, true),
            "round trip {i} failed with {what}"
        );
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    ensure!(
        leader.lines.try_iter().all(|l| !l.starts_with("STANDBY")),
        "the leader stepped down with {what}"
    );
    let loc = locator(&etcd)?;
    let now = loc.leader(Instant::now() + Duration::from_secs(3))?;
    ensure!(
        now == Some((leader.addr.to_string(), epoch)),
        "leader with {what}: {now:?}, was {} epoch {epoch}",
        leader.addr
    );
    println!("{i} round trips with {what} (lease {ttl:?}), same leader");
    c.close();
    node.close();
    Ok(())
}

#[test]
fn one_etcd_member_of_three_killed_leader_keeps_leading() -> Result<()> {
    // The default lease: it must outlast the election of a new raft leader (etcd's
    // election timeout is 1 s), during which no renewal succeeds.
    let ttl = HaConfig::new("etcd://unused:1").lease_ttl;
    keeps_leading_through(ttl, |etcd| {
        // The raft leader: the harder case (etcd elects another one meanwhile).
        let raft_leader = etcd.raft_leader();
        let victim = raft_leader.unwrap_or(0);
        etcd.kill(victim);
        format!(
            "etcd member {victim} of three killed (raft leader: {})",
            raft_leader.is_some()
        )
    })
}

#[test]
fn one_etcd_follower_of_three_frozen_leader_keeps_leading() -> Result<()> {
    // A frozen member accepts connections and answers nothing: renewals that try it
    // first must leave time for another member, even under the shortest lease.
    keeps_leading_through(TTL, |etcd| {
        // Member 0 is where every client starts, unless it is the raft leader.
        let victim = if etcd.raft_leader() == Some(0) { 1 } else { 0 };
        etcd.pause(victim);
        format!("etcd follower {victim} of three stopped (SIGSTOP)")
    })
}

/// All of etcd stopped for longer than the lease: the leader falls silent, calls fail
/// with a typed error within their deadline, and once etcd is back the store serves
/// again by itself (with a new leader term).
#[test]
fn etcd_stopped_calls_fail_typed_then_recover() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let (_leader, _standby, epoch) = two_masters(&etcd)?;
    let node = client(&etcd, 64 << 20)?;
    let timeout = Duration::from_secs(2);
    let c = client_within(&etcd, 0, timeout)?;
    let mut p = Pages::new(&c);
    ensure!(p.round_trip(&c, "before")? == (true, true));

    etcd.pause(0);
    let paused = Instant::now();
    std::thread::sleep(TTL + Duration::from_millis(500));
    fill("during", 7, &mut p.src.mem);
    let t = Instant::now();
    let r = c.put(
        &["during"],
        &[[p.src.span(0, PAGE)]],
        &PutOptions::default(),
    );
    let took = t.elapsed();
    let code = match &r {
        Err(e) => e.code(),
        Ok(v) => match v.as_slice() {
            [Err(c)] => *c,
            other => bail!("a put succeeded with etcd stopped past the lease: {other:?}"),
        },
    };
    ensure!(
        matches!(code, Code::Timeout | Code::MasterUnavailable),
        "put with etcd stopped: {r:?}"
    );
    ensure!(
        took < timeout + Duration::from_millis(1500),
        "the put took {took:?} (deadline {timeout:?})"
    );
    std::thread::sleep(Duration::from_secs(10).saturating_sub(paused.elapsed()));
    etcd.resume(0);
    let resumed = Instant::now();
    until_served(&c, &mut p, "after", Duration::from_secs(20))?;
    // The new term replayed the op-log: what was published before the outage is kept.
    p.read_back(&c, "before").context("after etcd's outage")?;
    let loc = locator(&etcd)?;
    let (_, now) = loc
        .leader(Instant::now() + Duration::from_secs(2))?
        .context("no leader after etcd came back")?;
    ensure!(now > epoch, "epoch {now} after {epoch}");
    println!(
        "etcd stopped {:.1} s: a put failed with {code:?} after {:.2} s; served again {:.2} s \
         after etcd resumed",
        resumed.duration_since(paused).as_secs_f64(),
        took.as_secs_f64(),
        resumed.elapsed().as_secs_f64()
    );
    c.close();
    node.close();
    Ok(())
}

/// Without a leader, a client's call fails with a typed error within its deadline.
#[test]
fn no_leader_fails_within_the_deadline() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let mut cfg = client_config(&etcd.url(), "none", Instant::now() + Duration::from_secs(5))?;
    cfg.engine = common::engine(BackendKind::Tcp);
    cfg.connect_timeout = Duration::from_millis(800);
    let start = Instant::now();
    let r = StoreClient::connect(cfg);
    let took = start.elapsed();
    let Err(e) = r else {
        bail!("connected without a leader")
    };
    ensure!(e.code() == Code::Timeout, "error {e}");
    ensure!(took < Duration::from_secs(3), "took {took:?}");
    // An etcd:// address without a locator is refused, not dialed.
    let mut bare = pagewire_store::ClientConfig::new(etcd.url());
    bare.engine = common::engine(BackendKind::Tcp);
    let r = StoreClient::connect(bare);
    ensure!(
        matches!(r, Err(pagewire_store::StoreError::Config { .. })),
        "{r:?}"
    );
    Ok(())
}

/// A storage node in a process of its own, with its memory layout fixed (no address
/// space randomization) and its engine on a fixed port: run twice, it mounts the same
/// endpoint, base and size.
struct NodeProc {
    child: Child,
    _stdin: Option<ChildStdin>,
    /// `(base, size, segment id)`.
    segment: (u64, u64, u64),
}

impl NodeProc {
    fn spawn(etcd: &str, listen: SocketAddr) -> Result<NodeProc> {
        // glibc maps allocations above a threshold that moves with the history of frees:
        // fixed at 4 MiB, only the segment and thread stacks are mapped on their own, in
        // the same order in every run, and the rest (whose sizes vary) goes to heaps.
        let env = [
            ("PW_ETCD", etcd.to_string()),
            ("PW_LISTEN", listen.to_string()),
            ("MALLOC_MMAP_THRESHOLD_", (4 << 20).to_string()),
        ];
        let (child, stdin, _, l) = spawn_role("node", &env, true)?;
        let f: Vec<u64> = l
            .strip_prefix("READY ")
            .with_context(|| format!("node said {l:?}"))?
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        ensure!(f.len() == 3, "node said {l:?}");
        Ok(NodeProc {
            child,
            _stdin: stdin,
            segment: (f[0], f[1], f[2]),
        })
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The failover hole that bounds alone leave open: a storage node process killed with
/// SIGKILL and started again on the same port, whose fresh memory lands at the same
/// address (address space randomization off), while the leader is killed too. The new
/// leader must not hand it the old segment: its memory does not hold the old objects, and
/// a get would return its bytes as theirs. Every get of an old object is `NotFound` (the
/// restarted node has a new client id; its mount gets a new segment and unmounts the one
/// it overlaps), never a success with other bytes.
#[test]
fn node_restarted_on_its_port_at_the_same_address_serves_no_old_object() -> Result<()> {
    let _serial = serial();
    let etcd = EtcdCluster::start(1);
    let (mut leader, mut standby, _) = two_masters(&etcd)?;
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let first = NodeProc::spawn(&etcd.url(), listen)?;
    let c = client(&etcd, 0)?;
    let mut p = Pages::new(&c);
    let keys: Vec<String> = (0..8).map(|i| format!("restart_{i}")).collect();
    for k in &keys {
        fill(k, 7, &mut p.src.mem);
        let r = c.put(&[k], &[[p.src.span(0, PAGE)]], &PutOptions::default())?;
        ensure!(r == [Ok(())], "{k}: {r:?}");
    }
    let old = first.segment;
    drop(first);
    leader.kill9();
    standby.wait_role("LEADER", Duration::from_secs(15))?;
    let second = NodeProc::spawn(&etcd.url(), listen)?;
    let new = second.segment;
    ensure!(
        (new.0, new.1) == (old.0, old.1),
        "the restarted node mapped its segment elsewhere ({new:x?} vs {old:x?}): the test \
         needs the same address"
    );
    ensure!(
        new.2 != old.2,
        "the restarted node took back segment {:#x}",
        old.2
    );
    for k in &keys {
        fill(k, 7, &mut p.src.mem);
        p.dst.mem.fill(0);
        let r = c.get(&[k], &[[p.dst.span(0, PAGE)]])?;
        if r == [Ok(PAGE as u64)] {
            ensure!(p.dst.mem == p.src.mem, "get of {k} returned wrong bytes");
        }
        ensure!(r == [Err(Code::NotFound)], "{k}: {r:?}");
    }
    c.close();
    Ok(())
}
