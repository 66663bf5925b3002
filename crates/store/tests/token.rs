//! One token guards everything a store client opens: its master link, its engine and so
//! its segment. A storage node given a token in `ClientConfig` only (no `PAGEWIRE_TOKEN`:
//! the configs here never read the environment) must not let an engine without that
//! token, or with another one, reach its segment. TCP on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use common::{Buf, client_cfg, fill};
use pagewire_store::{ClientConfig, Master, MasterConfig, PutOptions, StoreClient, StoreError};
use pagewire_transport::{BackendKind, Engine, EngineConfig, Error as TError, HandshakeError};

const TOKEN: &str = "sesame";

fn master(token: Option<&str>) -> Result<Master> {
    Ok(Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        token: token.map(|t| t.as_bytes().to_vec()),
        ..MasterConfig::default()
    })?)
}

/// A TCP client config whose token is set in the store's field only.
fn store_token_cfg(m: &Master, segment: u64) -> ClientConfig {
    let mut c = client_cfg(&m.local_addr().to_string(), BackendKind::Tcp, segment);
    c.token = Some(TOKEN.into());
    c.local_copy = false;
    c
}

/// A plain engine on 127.0.0.1, with the given token or none.
fn engine_cfg(token: Option<&str>) -> EngineConfig {
    let mut c = common::engine(BackendKind::Tcp);
    c.token = token.map(str::to_string);
    c
}

/// The attack of issue 29: a node and clients with `token` in `ClientConfig` only; an
/// engine without the token, then one with a wrong token, connect to the node's
/// endpoint. Both are refused with `TokenMismatch` (and counted there), and the object
/// the node holds reads back unchanged.
#[test]
fn a_store_token_guards_the_segment() -> Result<()> {
    let m = master(Some(TOKEN))?;
    let node = StoreClient::connect(store_token_cfg(&m, 8 << 20))?;
    ensure!(node.engine().config().token.as_deref() == Some(TOKEN));
    let writer = StoreClient::connect(store_token_cfg(&m, 0))?;
    let len = 1 << 20;
    let mut src = Buf::new(&writer, len);
    fill("victim", 7, &mut src.mem);
    let r = writer.put(&["victim"], &[[src.span(0, len)]], &PutOptions::default())?;
    ensure!(r == [Ok(())], "{r:?}");

    for token in [None, Some("guess")] {
        let stranger = Engine::new(engine_cfg(token))?;
        let t0 = Instant::now();
        match stranger.connect(node.endpoint()) {
            Err(TError::Handshake(HandshakeError::TokenMismatch)) => {}
            Ok(peer) => bail!(
                "token {token:?}: connected, and sees {:?}",
                stranger.peer_regions(peer)?
            ),
            Err(e) => bail!("token {token:?}: {e:?}, not TokenMismatch"),
        }
        ensure!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        ensure!(stranger.peers().is_empty());
    }
    ensure!(
        node.engine().token_refusals() == 2,
        "{}",
        node.engine().token_refusals()
    );

    let reader = StoreClient::connect(store_token_cfg(&m, 0))?;
    let dst = Buf::new(&reader, len);
    let r = reader.get(&["victim"], &[[dst.span(0, len)]])?;
    ensure!(r == [Ok(len as u64)], "{r:?}");
    ensure!(dst.mem == src.mem, "the object changed");
    Ok(())
}

/// A token set on the engine only is the master's token too: one secret.
#[test]
fn an_engine_token_guards_the_master_link_too() -> Result<()> {
    let m = master(Some(TOKEN))?;
    let mut cfg = client_cfg(&m.local_addr().to_string(), BackendKind::Tcp, 4 << 20);
    cfg.engine.token = Some(TOKEN.into());
    let c = StoreClient::connect(cfg)?;
    ensure!(c.segment_id()?.is_some());
    ensure!(c.stats()?.segments == 1);
    Ok(())
}

/// Two different tokens in one config are the caller's mistake, refused before anything
/// is opened, and the message does not show either secret.
#[test]
fn two_different_tokens_are_refused() -> Result<()> {
    let m = master(None)?;
    let mut cfg = client_cfg(&m.local_addr().to_string(), BackendKind::Tcp, 4 << 20);
    cfg.token = Some("first-secret".into());
    cfg.engine.token = Some("second-secret".into());
    match StoreClient::connect(cfg) {
        Err(e @ StoreError::Config { .. }) => {
            let s = e.to_string();
            ensure!(
                !s.contains("first-secret") && !s.contains("second-secret"),
                "{s}"
            );
        }
        other => bail!("{other:?}"),
    }
    ensure!(m.stats().segments == 0);
    Ok(())
}

/// `with_engine` refuses an engine that lacks the store's token (its segment would be
/// open to anyone) or holds another one, without registering anything on it; an engine
/// with the token joins, and its token alone also serves the master.
#[test]
fn with_engine_needs_the_same_token() -> Result<()> {
    let m = master(Some(TOKEN))?;
    for token in [None, Some("guess")] {
        let e = Engine::new(engine_cfg(token))?;
        match StoreClient::with_engine(e.clone(), store_token_cfg(&m, 4 << 20)) {
            Err(StoreError::InvalidArgument { what }) => {
                ensure!(!what.contains(TOKEN) && !what.contains("guess"), "{what}");
            }
            other => bail!("engine token {token:?}: {other:?}"),
        }
        ensure!(e.regions().is_empty(), "{:?}", e.regions());
    }
    let e = Engine::new(engine_cfg(Some(TOKEN)))?;
    let a = StoreClient::with_engine(e.clone(), store_token_cfg(&m, 4 << 20))?;
    ensure!(a.segment_id()?.is_some());
    let mut cfg = store_token_cfg(&m, 0);
    cfg.token = None;
    let b = StoreClient::with_engine(Engine::new(engine_cfg(Some(TOKEN)))?, cfg)?;
    ensure!(b.stats()?.segments == 1);
    Ok(())
}
