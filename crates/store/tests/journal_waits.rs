//! What a leader's reply waits for in its journal. A reply that may show a change waits
//! until everything before it is logged; placements and reads wait only for changes that
//! freed space or changed segments (so concurrent writers do not queue behind each
//! other's publications, nor a read behind the `Finish` just before it), and a placement
//! never hands out space whose freeing is not logged yet; a `PutFinish` waits for its
//! own publications.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use pagewire_store::proto::{PutFinish, PutStart, Request, Response};
use pagewire_store::{Code, Journal, JournalError, Master, MasterConfig, Pin, Record};

use common::{authenticated, frame, reply};

/// A journal that, once holding, commits only what the test releases.
#[derive(Debug, Default)]
struct Gate {
    st: Mutex<(u64, u64, bool)>, // (appended, released, holding)
    cv: Condvar,
}

impl Gate {
    fn hold(&self) {
        let mut st = self.st.lock().unwrap();
        st.1 = st.0;
        st.2 = true;
    }
    fn release_all(&self) {
        let n = self.st.lock().unwrap().0;
        self.release(n);
    }
    fn release(&self, n: u64) {
        self.st.lock().unwrap().1 = n;
        self.cv.notify_all();
    }
    fn appended(&self) -> u64 {
        self.st.lock().unwrap().0
    }
}

impl Journal for Gate {
    fn append(&self, records: Vec<Record>) -> u64 {
        let mut st = self.st.lock().unwrap();
        if !records.is_empty() {
            st.0 += 1;
        }
        st.0
    }
    fn wait(&self, ticket: u64, deadline: Instant) -> Result<(), JournalError> {
        let mut st = self.st.lock().unwrap();
        while st.2 && st.1 < ticket {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(JournalError::Timeout);
            }
            st = self.cv.wait_timeout(st, left).unwrap().0;
        }
        Ok(())
    }
}

fn conn(addr: SocketAddr) -> Result<TcpStream> {
    let s = authenticated(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(s)
}

fn put_start(key: &str) -> Request {
    Request::PutStart(PutStart {
        replicas: 1,
        pin: Pin::None,
        preferred: String::new(),
        items: vec![(key.as_bytes().to_vec(), 4096)],
    })
}

fn finish(key: &str) -> Request {
    Request::PutFinish(PutFinish {
        done: vec![key.as_bytes().to_vec()],
        ..PutFinish::default()
    })
}

/// Sends `req` and says whether a reply came within `within` (read later otherwise).
fn answered_within(s: &mut TcpStream, req: &Request, within: Duration) -> Result<bool> {
    s.write_all(&frame(req, 9))?;
    s.set_read_timeout(Some(within))?;
    let mut b = [0u8; 1];
    let got = s.peek(&mut b).is_ok();
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(got)
}

fn placed(r: Response) -> Result<Vec<Result<(), Code>>> {
    match r {
        Response::Placed(p) => Ok(p.items.into_iter().map(|i| i.map(|_| ())).collect()),
        other => anyhow::bail!("expected a placement, got {other:?}"),
    }
}

#[test]
fn placements_wait_only_for_what_they_depend_on() -> Result<()> {
    let m = Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    })?;
    let gate = Arc::new(Gate::default());
    m.set_journal(Some(gate.clone()));
    let addr = m.local_addr();
    let quick = Duration::from_millis(300);

    // A node's segment; the mount waits for its record.
    let mut node = conn(addr)?;
    node.write_all(&frame(
        &Request::Mount {
            base: 1 << 30,
            size: 1 << 20,
            rkey: 7,
        },
        2,
    ))?;
    let r = reply(&mut node)?;
    ensure!(matches!(r, Response::Mounted { .. }), "{r:?}");
    gate.hold();

    // Writer A's placement is answered at once (nothing is logged for it); its
    // `PutFinish` waits for its publication.
    let mut a = conn(addr)?;
    let before = gate.appended();
    ensure!(
        answered_within(&mut a, &put_start("a"), quick)?,
        "a placement waited for the log"
    );
    ensure!(placed(reply(&mut a)?)? == vec![Ok(())]);
    ensure!(gate.appended() == before, "a placement was logged");
    ensure!(
        !answered_within(&mut a, &finish("a"), quick)?,
        "a PutFinish answered before its publication was logged"
    );

    // Writer B's placement depends on nothing unlogged: answered at once, while A's
    // publication is held back.
    let mut b = conn(addr)?;
    ensure!(
        answered_within(&mut b, &put_start("b"), quick)?,
        "a placement waited for another writer's publication"
    );
    ensure!(placed(reply(&mut b)?)? == vec![Ok(())]);

    // C asks for "a" and is refused at once, and a get of it is answered at once: what
    // they show of the unlogged publication a failover may only hide again (the bytes
    // are complete, and A's put is not acknowledged yet).
    let mut c = conn(addr)?;
    ensure!(
        answered_within(&mut c, &put_start("a"), quick)?,
        "a refusal waited for the publication"
    );
    ensure!(placed(reply(&mut c)?)?.iter().all(|r| r.is_err()));
    let mut d = conn(addr)?;
    ensure!(
        answered_within(
            &mut d,
            &Request::Get {
                lease: false,
                keys: vec![b"a".to_vec()],
            },
            quick
        )?,
        "a get waited for the publication"
    );
    ensure!(matches!(reply(&mut d)?, Response::Found(ref f) if f.items[0].is_ok()));
    gate.release_all();
    ensure!(matches!(reply(&mut a)?, Response::Codes(ref c) if c == &[Code::Ok]));

    // "a" removed, the removal held back: its space is not free in the logged state,
    // so no placement may hand it out before the removal is logged.
    let mut e = conn(addr)?;
    ensure!(
        !answered_within(
            &mut e,
            &Request::Remove {
                force: true,
                keys: vec![b"a".to_vec()],
            },
            quick
        )?,
        "a removal answered before its record was logged"
    );
    ensure!(
        !answered_within(&mut b, &put_start("f"), quick)?,
        "a placement answered before a removal before it was logged"
    );
    gate.release_all();
    ensure!(matches!(reply(&mut e)?, Response::Codes(_)));
    ensure!(placed(reply(&mut b)?)? == vec![Ok(())]);
    m.shutdown();
    Ok(())
}
