//! A master whose right to answer comes from outside (an elected leader's lease): it
//! accepts no session and writes no reply while the authority is not valid, and
//! announces the epoch it was given.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use pagewire_store::proto::{Request, Response};
use pagewire_store::{Authority, Master, MasterConfig};

use common::{authenticated, frame, reply};

#[test]
fn no_session_and_no_reply_without_authority() -> Result<()> {
    let authority = Authority::new();
    let m = Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        epoch: Some(77),
        authority: Some(authority.clone()),
        ..MasterConfig::default()
    })?;
    ensure!(m.epoch() == 77);
    ensure!(
        authenticated(m.local_addr()).is_err(),
        "welcomed without authority"
    );

    authority.grant_until(Instant::now() + Duration::from_secs(60));
    let mut s = authenticated(m.local_addr())?;
    s.write_all(&frame(&Request::Heartbeat, 2))?;
    ensure!(matches!(reply(&mut s)?, Response::Ack));
    m.set_epoch(78);
    ensure!(m.epoch() == 78);

    authority.revoke();
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.write_all(&frame(&Request::Heartbeat, 3))?;
    let r = reply(&mut s);
    ensure!(
        r.is_err(),
        "answered after the authority was revoked: {r:?}"
    );
    m.shutdown();
    Ok(())
}
