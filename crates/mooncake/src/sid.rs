//! Segment names (Mooncake's session ids): `host:port`, `[v6]:port`.
//!
//! In Mooncake's P2P handshake mode an engine's segment name is `host:rpc_port`, with
//! IPv6 literals in brackets; callers pass it back as a string (SGLang's session id,
//! NIXL's segment name). Host names are resolved with a deadline, on a helper thread, so
//! that a slow resolver cannot hold a caller past the handshake timeout.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// `(host, port)` of a segment name `host:port` / `[v6]:port`. The port is required and
/// not 0 (Mooncake would try its legacy default port 12001 without one); a bare IPv6
/// literal must be in brackets. `Err` says what is wrong.
pub fn parse(name: &str) -> Result<(&str, u16), &'static str> {
    let (host, port) = if let Some(rest) = name.strip_prefix('[') {
        rest.split_once("]:").ok_or("expected [ipv6]:port")?
    } else {
        let (h, p) = name.rsplit_once(':').ok_or("expected host:port")?;
        if h.contains(':') {
            return Err("an IPv6 host must be in brackets");
        }
        (h, p)
    };
    let port: u16 = port
        .parse()
        .map_err(|_| "the port is not a number in 1..=65535")?;
    if port == 0 || host.is_empty() {
        return Err("empty host or port 0");
    }
    Ok((host, port))
}

/// The host of a `local_hostname` / `local_server_name` (`host`, `host:port`, `[v6]`,
/// `[v6]:port`, a bare IPv6 literal, Ascend's `ip:port:npu_N`): what goes before
/// `:port` in the engine's own segment name. A port in it is ignored, as in Mooncake's
/// P2P mode.
pub fn host_part(local_hostname: &str) -> &str {
    let s = local_hostname.trim();
    if s.parse::<IpAddr>().is_ok() {
        return s;
    }
    if let Some(rest) = s.strip_prefix('[')
        && let Some((h, _)) = rest.split_once(']')
    {
        return h;
    }
    s.split(':').next().unwrap_or(s)
}

/// `host:port`, with an IPv6 literal in brackets.
pub fn join(host: &str, port: u16) -> String {
    if host.parse::<Ipv6Addr>().is_ok() {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Name resolutions running at once (each on its own thread).
const MAX_RESOLVERS: usize = 8;
static RESOLVERS: AtomicUsize = AtomicUsize::new(0);

/// The addresses of `host` (an IP literal at once, a name within `within`). `Err` says
/// why not; at most [`MAX_RESOLVERS`] lookups run at once, beyond that a lookup fails.
pub fn resolve(host: &str, port: u16, within: Duration) -> Result<Vec<SocketAddr>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if RESOLVERS.fetch_add(1, Ordering::AcqRel) >= MAX_RESOLVERS {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(format!(
            "cannot resolve {host:?}: {MAX_RESOLVERS} lookups already running"
        ));
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    let h = host.to_owned();
    let spawned = std::thread::Builder::new()
        .name("pagewire-resolve".into())
        .spawn(move || {
            let r = (h.as_str(), port)
                .to_socket_addrs()
                .map(|a| a.collect::<Vec<_>>());
            RESOLVERS.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(format!("cannot resolve {host:?}: {e}"));
    }
    match rx.recv_timeout(within) {
        Ok(Ok(v)) if !v.is_empty() => Ok(v),
        Ok(Ok(_)) => Err(format!("{host:?} resolves to nothing")),
        Ok(Err(e)) => Err(format!("cannot resolve {host:?}: {e}")),
        Err(_) => Err(format!("resolving {host:?} took longer than {within:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names() {
        assert_eq!(parse("10.0.0.1:15000"), Ok(("10.0.0.1", 15000)));
        assert_eq!(parse("[::1]:7"), Ok(("::1", 7)));
        assert_eq!(parse("host.example:80"), Ok(("host.example", 80)));
        for bad in [
            "10.0.0.1",
            "::1",
            "::1:15000",
            ":80",
            "h:",
            "h:0",
            "h:99999",
            "[::1]",
            "[::1]x",
            "[::1]:",
            "",
            "h:-1",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn own_host() {
        assert_eq!(host_part("10.0.0.1"), "10.0.0.1");
        assert_eq!(host_part(" 10.0.0.1:1234"), "10.0.0.1");
        assert_eq!(host_part("10.0.0.1:1234:npu_2"), "10.0.0.1");
        assert_eq!(host_part("::1"), "::1");
        assert_eq!(host_part("[fe80::1]:80"), "fe80::1");
        assert_eq!(host_part("[fe80::1]"), "fe80::1");
        assert_eq!(host_part("node-3:80"), "node-3");
        assert_eq!(join("::1", 15000), "[::1]:15000");
        assert_eq!(join("node-3", 15000), "node-3:15000");
    }

    #[test]
    fn resolution() {
        let t = Duration::from_secs(5);
        assert_eq!(
            resolve("127.0.0.1", 9, t).unwrap(),
            vec!["127.0.0.1:9".parse().unwrap()]
        );
        assert!(resolve("::1", 9, t).unwrap()[0].is_ipv6());
        assert!(resolve("localhost", 9, t).is_ok());
        assert!(resolve("no-such-host.invalid", 9, t).is_err());
    }
}
