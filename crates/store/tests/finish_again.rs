//! A leader answers a `PutFinish` once the puts' reservations are in its op-log, without
//! waiting for its own `Finish` records. If it dies in between, the writer sends that
//! `PutFinish` again to the next leader, which knows the puts as reserved by the writer's
//! id from the log: the acknowledged object stays, with its bytes.
//!
//! In one process: a leader whose journal hands records to a standby (in order, as the
//! etcd log does) and stops handing anything over from the first `Finish` of one key on,
//! a locator the test switches over, a storage node and a writer on loopback TCP.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{Buf, client_cfg, fill};
use pagewire_store::{
    Authority, ClientConfig, Journal, JournalError, Master, MasterConfig, MasterLocator,
    PutOptions, Record, StoreClient,
};
use pagewire_transport::BackendKind;

const OBJ: usize = 256 << 10;

/// The log: every batch goes to the standby at once (committed), until a batch holds
/// `Finish` of the key `cut`; from then on nothing is committed (the leader "dies" with
/// those records unwritten).
#[derive(Debug)]
struct Log {
    standby: Arc<Master>,
    cut: Vec<u8>,
    st: Mutex<(u64, u64, bool)>, // (appended, committed, cut)
    cv: Condvar,
}

impl Journal for Log {
    fn append(&self, records: Vec<Record>) -> u64 {
        let mut st = self.st.lock().unwrap();
        if records.is_empty() {
            return st.0;
        }
        st.0 += 1;
        st.2 |= records
            .iter()
            .any(|r| matches!(r, Record::Finish { key } if *key == self.cut));
        if !st.2 {
            assert_eq!(self.standby.apply_log(&records), 0, "{records:?}");
            st.1 = st.0;
            self.cv.notify_all();
        }
        st.0
    }
    fn wait(&self, ticket: u64, deadline: Instant) -> Result<(), JournalError> {
        let mut st = self.st.lock().unwrap();
        while st.1 < ticket {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(JournalError::Timeout);
            }
            st = self.cv.wait_timeout(st, left).unwrap().0;
        }
        Ok(())
    }
}

/// A new leader's journal: commits at once.
#[derive(Debug, Default)]
struct AtOnce(Mutex<u64>);

impl Journal for AtOnce {
    fn append(&self, records: Vec<Record>) -> u64 {
        let mut n = self.0.lock().unwrap();
        *n += u64::from(!records.is_empty());
        *n
    }
    fn wait(&self, _: u64, _: Instant) -> Result<(), JournalError> {
        Ok(())
    }
}

/// The leader's address and epoch, as the test sets them.
#[derive(Debug)]
struct Switch(Mutex<(String, u64)>);

impl MasterLocator for Switch {
    fn locate(&self, _: Instant) -> pagewire_store::Result<(String, u64)> {
        Ok(self.0.lock().unwrap().clone())
    }
}

fn master(epoch: u64, authority: Option<Authority>) -> Result<Master> {
    Ok(Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        epoch: Some(epoch),
        authority,
        ..MasterConfig::default()
    })?)
}

fn located(cfg: ClientConfig, loc: &Arc<Switch>) -> ClientConfig {
    let mut cfg = cfg;
    cfg.locator = Some(loc.clone());
    cfg
}

#[test]
fn an_answered_put_survives_a_leader_that_died_before_its_finish_was_logged() -> Result<()> {
    let standby_authority = Authority::new();
    let standby = Arc::new(master(2, Some(standby_authority.clone()))?);
    let leader = master(1, None)?;
    leader.set_journal(Some(Arc::new(Log {
        standby: standby.clone(),
        cut: b"late".to_vec(),
        st: Mutex::new((0, 0, false)),
        cv: Condvar::new(),
    })));
    let loc = Arc::new(Switch(Mutex::new((leader.local_addr().to_string(), 1))));

    let kind = BackendKind::Tcp;
    let _node = StoreClient::connect(located(client_cfg("located", kind, 8 << 20), &loc))?;
    let writer = StoreClient::connect(located(client_cfg("located", kind, 0), &loc))?;
    let mut src = Buf::new(&writer, 2 * OBJ);
    fill("early", 1, &mut src.mem[..OBJ]);
    fill("late", 2, &mut src.mem[OBJ..]);
    let one = PutOptions::default();
    ensure!(writer.put(&["early"], &[[src.span(0, OBJ)]], &one)? == [Ok(())]);
    // Answered: its reservation is logged, its `Finish` is not (and never will be).
    ensure!(writer.put(&["late"], &[[src.span(OBJ, OBJ)]], &one)? == [Ok(())]);
    let s = standby.stats();
    ensure!(
        s.objects == 1 && s.pending == 1,
        "the standby holds one object and one reserved put: {s:?}"
    );

    // The leader dies; the standby takes over.
    leader.shutdown();
    standby.promote();
    standby.set_journal(Some(Arc::new(AtOnce::default())));
    standby_authority.grant_until(Instant::now() + Duration::from_secs(600));
    *loc.0.lock().unwrap() = (standby.local_addr().to_string(), 2);

    // The writer reads both back: its first call to the new leader finishes "late"
    // again; the node remounts through its heartbeat (reads wait for that).
    let dst = Buf::new(&writer, 2 * OBJ);
    let t0 = Instant::now();
    loop {
        let got = writer.get(
            &["early", "late"],
            &[[dst.span(0, OBJ)], [dst.span(OBJ, OBJ)]],
        )?;
        if got == [Ok(OBJ as u64), Ok(OBJ as u64)] {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(20),
            "not readable after the failover: {got:?} ({:?})",
            standby.stats()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(dst.mem == src.mem, "the bytes read back differ");
    let s = standby.stats();
    ensure!(s.objects == 2 && s.pending == 0, "{s:?}");
    standby.shutdown();
    Ok(())
}
