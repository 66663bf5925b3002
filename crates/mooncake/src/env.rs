//! Mooncake's environment variables, read as Mooncake reads them.
//!
//! | variable | effect |
//! | --- | --- |
//! | `MC_TRANSFER_TIMEOUT` | seconds a transfer of the Python binding may take (plus 1 ns per byte); `atoi`, floor 5, default 30 |
//! | `MC_MIN_RPC_PORT`, `MC_MAX_RPC_PORT` | the range the handshake (RPC) port is picked from; default 15000-17000 |
//! | `MC_FORCE_TCP` | set (to anything): TCP even where an RDMA device is usable |
//! | `MC_TCP_BIND_ADDRESS` | with a metadata server (etcd): the host published for peers to reach this engine, and listened on |
//!
//! `PAGEWIRE_TRANSPORT` (pagewire's own) wins over all of them.

use std::time::Duration;

use pagewire_transport::BackendKind;

/// Mooncake's default RPC port range.
pub const DEFAULT_RPC_PORTS: (u16, u16) = (15000, 17000);

/// `MC_TCP_BIND_ADDRESS`, trimmed, when set and not empty.
pub fn tcp_bind_address() -> Option<String> {
    std::env::var("MC_TCP_BIND_ADDRESS")
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// `MC_TRANSFER_TIMEOUT` as Mooncake reads it: whole seconds, `atoi` semantics, floor 5,
/// default 30.
pub fn transfer_timeout() -> Duration {
    match std::env::var("MC_TRANSFER_TIMEOUT") {
        Ok(v) => Duration::from_secs(atoi(&v).max(5) as u64),
        Err(_) => Duration::from_secs(30),
    }
}

/// C's `atoi`: optional spaces and sign, then digits; 0 when there are none.
pub(crate) fn atoi(s: &str) -> i64 {
    let t = s.trim_start();
    let (neg, rest) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let digits: String = rest
        .chars()
        .take_while(char::is_ascii_digit)
        .take(18)
        .collect();
    let v: i64 = digits.parse().unwrap_or(0);
    if neg { -v } else { v }
}

/// `MC_MIN_RPC_PORT` / `MC_MAX_RPC_PORT` (or Mooncake's misspelt `MC_M*_PRC_PORT`),
/// validated as Mooncake does: each in 1024..=65535 and outside the ephemeral range
/// 32768..=60999, min <= max; otherwise the default range.
pub fn rpc_port_range() -> (u16, u16) {
    let get = |a: &str, b: &str| std::env::var(a).or_else(|_| std::env::var(b)).ok();
    let (d0, d1) = DEFAULT_RPC_PORTS;
    let lo = get("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT").map_or(i64::from(d0), |v| atoi(&v));
    let hi = get("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT").map_or(i64::from(d1), |v| atoi(&v));
    valid_range(lo, hi).unwrap_or(DEFAULT_RPC_PORTS)
}

fn valid_range(lo: i64, hi: i64) -> Option<(u16, u16)> {
    let ok = |p: i64| (1024..=65535).contains(&p) && !(32768..=60999).contains(&p);
    (ok(lo) && ok(hi) && lo <= hi).then_some((lo as u16, hi as u16))
}

/// Which backend to open, and why. `protocol` is the Python binding's argument; `None`
/// (the C API's auto-discovery) lets the transport pick verbs when a device is usable.
/// Mooncake's own order: `PAGEWIRE_TRANSPORT` (pagewire's), then `MC_FORCE_TCP` (any
/// value), then the protocol.
pub fn backend(protocol: Option<&str>) -> (BackendKind, String) {
    if let Ok(v) = std::env::var("PAGEWIRE_TRANSPORT")
        && let Ok(k) = v.parse::<BackendKind>()
    {
        return (k, format!("PAGEWIRE_TRANSPORT={v}"));
    }
    if std::env::var_os("MC_FORCE_TCP").is_some() {
        return (BackendKind::Tcp, "MC_FORCE_TCP is set".into());
    }
    match protocol {
        None => (BackendKind::Auto, "auto-discovery".into()),
        Some("rdma") => (BackendKind::Verbs, "protocol \"rdma\"".into()),
        Some(p) => (BackendKind::Tcp, format!("protocol {p:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atoi_as_c() {
        assert_eq!(atoi("30"), 30);
        assert_eq!(atoi("  7s"), 7);
        assert_eq!(atoi("-3"), -3);
        assert_eq!(atoi("+4"), 4);
        assert_eq!(atoi("x"), 0);
        assert_eq!(atoi(""), 0);
    }

    #[test]
    fn port_ranges_as_mooncake_validates_them() {
        assert_eq!(valid_range(16100, 16120), Some((16100, 16120)));
        assert_eq!(valid_range(15000, 15000), Some((15000, 15000)));
        assert_eq!(valid_range(40000, 41000), None, "ephemeral");
        assert_eq!(valid_range(80, 15000), None, "privileged");
        assert_eq!(valid_range(17000, 15000), None, "reversed");
        assert_eq!(valid_range(61000, 70000), None, "above 65535");
    }
}
