//! RoCE GID selection, perftest-style. Pure logic; the table comes from `device.rs`.

use std::fmt;
use std::net::Ipv6Addr;

/// The wire format a GID entry selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GidKind {
    /// InfiniBand (no RoCE).
    Ib,
    /// RoCE v1 (Ethernet, no IP/UDP).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
}

impl fmt::Display for GidKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GidKind::Ib => "IB",
            GidKind::RoceV1 => "RoCEv1",
            GidKind::RoceV2 => "RoCEv2",
        })
    }
}

/// One valid entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GidInfo {
    /// Port number (1-based).
    pub port: u8,
    /// Index in the port's GID table (what `PAGEWIRE_GID_INDEX` names).
    pub index: u32,
    pub kind: GidKind,
    /// The network device the GID belongs to, if any.
    pub netdev: Option<String>,
    /// The GID as an IPv6 address (IPv4 addresses appear as `::ffff:a.b.c.d`).
    pub addr: Ipv6Addr,
}

impl GidInfo {
    pub(crate) fn new(
        port: u8,
        index: u32,
        kind: GidKind,
        netdev: Option<String>,
        raw: [u8; 16],
    ) -> Self {
        Self {
            port,
            index,
            kind,
            netdev,
            addr: Ipv6Addr::from(raw),
        }
    }

    /// `::ffff:a.b.c.d`.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.addr.to_ipv4_mapped().is_some()
    }

    /// `fe80::/10`.
    pub fn is_link_local(&self) -> bool {
        let o = self.addr.octets();
        o[0] == 0xfe && (o[1] & 0xc0) == 0x80
    }
}

/// Why no GID could be chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GidChoiceError {
    /// The port has no valid GID at all.
    Empty,
    /// The override names an index that is not in the table.
    NoSuchIndex(u32),
}

/// Picks the GID index to use on `port`.
///
/// With an override (`PAGEWIRE_GID_INDEX`) that index must exist. Otherwise, like perftest:
/// prefer an IPv4-mapped address, then a non-link-local scope, then RoCE v2 over v1; ties go
/// to the lowest index. A port that only has its link-local RoCE v2 GID (rxe on a bare dummy
/// device) therefore gets that entry (GID 0) rather than an error.
pub(crate) fn choose_gid(
    table: &[GidInfo],
    port: u8,
    override_index: Option<u32>,
) -> Result<GidInfo, GidChoiceError> {
    let on_port = table
        .iter()
        .filter(|g| g.port == port && !g.addr.is_unspecified());
    if let Some(idx) = override_index {
        return on_port
            .clone()
            .find(|g| g.index == idx)
            .cloned()
            .ok_or(GidChoiceError::NoSuchIndex(idx));
    }
    on_port
        .max_by_key(|g| {
            (
                g.is_ipv4_mapped(),
                !g.is_link_local(),
                g.kind == GidKind::RoceV2,
                std::cmp::Reverse(g.index),
            )
        })
        .cloned()
        .ok_or(GidChoiceError::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(index: u32, kind: GidKind, addr: &str) -> GidInfo {
        GidInfo::new(
            1,
            index,
            kind,
            Some("eth0".into()),
            addr.parse::<Ipv6Addr>().unwrap().octets(),
        )
    }

    #[test]
    fn bare_rxe_falls_back_to_link_local_gid0() {
        let t = [g(0, GidKind::RoceV2, "fe80::1")];
        assert_eq!(choose_gid(&t, 1, None).unwrap().index, 0);
    }

    #[test]
    fn prefers_ipv4_mapped_rocev2() {
        let t = [
            g(0, GidKind::RoceV1, "fe80::1"),
            g(1, GidKind::RoceV2, "fe80::1"),
            g(2, GidKind::RoceV1, "::ffff:10.0.0.1"),
            g(3, GidKind::RoceV2, "::ffff:10.0.0.1"),
            g(4, GidKind::RoceV2, "2001:db8::1"),
        ];
        assert_eq!(choose_gid(&t, 1, None).unwrap().index, 3);
        // Without IPv4: global IPv6 beats link-local.
        assert_eq!(choose_gid(&t[..2], 1, None).unwrap().index, 1);
        assert_eq!(
            choose_gid(&[t[0].clone(), t[1].clone(), t[4].clone()], 1, None)
                .unwrap()
                .index,
            4
        );
    }

    #[test]
    fn override_must_exist() {
        let t = [
            g(0, GidKind::RoceV2, "fe80::1"),
            g(1, GidKind::RoceV2, "::ffff:10.0.0.1"),
        ];
        assert_eq!(choose_gid(&t, 1, Some(0)).unwrap().index, 0);
        assert_eq!(
            choose_gid(&t, 1, Some(7)),
            Err(GidChoiceError::NoSuchIndex(7))
        );
    }

    #[test]
    fn empty_or_other_port() {
        assert_eq!(choose_gid(&[], 1, None), Err(GidChoiceError::Empty));
        let t = [g(0, GidKind::RoceV2, "fe80::1")];
        assert_eq!(choose_gid(&t, 2, None), Err(GidChoiceError::Empty));
    }
}
