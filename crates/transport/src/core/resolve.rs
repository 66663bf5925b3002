//! Ops after validation: each piece lies inside one local registration and one region the
//! peer exposed, with both keys resolved. What the engine hands a backend to execute.
//! [`resolve`] checks a batch's ops against the local registry and the peer's table,
//! pins the local regions and splits ops at registration edges.

use crate::core::registry::{Pins, Registry, RemoteTable, checked_end};
use crate::error::{Error, Result};
use crate::types::{Access, Op, PeerId, TransferOp};

/// A batch's resolved ops; up to two inline, so a small batch allocates no list.
pub(crate) type ResolvedOps = smallvec::SmallVec<[ResolvedOp; 2]>;

/// One validated, key-resolved piece of a batch. The local range is inside one local MR
/// chunk, the remote range inside one chunk the peer exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResolvedOp {
    pub op: Op,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
}

/// Checks `ops` (to `peer`, whose exposed regions are `table`) and resolves them: the
/// local range inside registered memory with the access the op needs, the remote range
/// inside what the peer exposed with the access it needs, each op split where either
/// side's registration (MR chunk) ends. Returns the pins that keep the local regions
/// registered, the resolved pieces and the batch's bytes.
pub(crate) fn resolve(
    registry: &Registry,
    table: &RemoteTable,
    peer: PeerId,
    ops: &[TransferOp],
) -> Result<(Pins, ResolvedOps, u64)> {
    let mut pins = Pins::new();
    let mut resolved = ResolvedOps::with_capacity(ops.len());
    let mut bytes = 0u64;
    for o in ops {
        let (need_local, need_remote) = match o.op {
            Op::Write => (Access::NONE, Access::REMOTE_WRITE),
            Op::Read => (Access::LOCAL_WRITE, Access::REMOTE_READ),
        };
        checked_end(o.remote, o.len)?;
        let local_end = checked_end(o.local, o.len)?;
        // A batch's ops nearly always lie in a region it pinned already (one KV pool):
        // reuse that pin rather than a registry lookup and a pin/unpin per op.
        let held = pins.iter().position(|p| {
            let r = p.region();
            r.addr <= o.local && local_end <= r.addr + r.len && r.access.contains(need_local)
        });
        let i = match held {
            Some(i) => i,
            None => {
                pins.push(registry.pin(o.local, o.len, need_local)?);
                pins.len() - 1
            }
        };
        let region = pins[i].region();
        let mut off = 0u64;
        while off < o.len {
            let l = o.local + off;
            let r = o.remote + off;
            let lc = region.chunk_at(l).ok_or_else(|| Error::Unregistered {
                addr: o.local,
                len: o.len,
            })?;
            let rr = table.at(r).ok_or_else(|| Error::RemoteOutOfBounds {
                peer,
                addr: o.remote,
                len: o.len,
            })?;
            if !rr.access.contains(need_remote) {
                return Err(Error::RemotePermission {
                    peer,
                    addr: o.remote,
                    len: o.len,
                    needed: need_remote,
                });
            }
            let n = (o.len - off).min(lc.addr + lc.len - l).min(rr.end() - r);
            resolved.push(ResolvedOp {
                op: o.op,
                local: l,
                lkey: lc.lkey,
                remote: r,
                rkey: rr.rkey,
                len: n,
            });
            off += n;
        }
        bytes += o.len;
    }
    Ok((pins, resolved, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::registry::Chunk;
    use crate::types::RemoteRegion;

    /// A local region `[0x1000, 0x3000)` registered as two chunks (lkeys 1 and 2), and a
    /// peer exposing `[0x10000, 0x11800)` writable as two regions (rkeys 7, 8) plus a
    /// read-only one.
    fn setup() -> (Registry, RemoteTable) {
        let reg = Registry::default();
        let chunk = |addr, lkey| Chunk {
            addr,
            len: 0x1000,
            lkey,
            rkey: lkey,
            lrails: crate::types::RailKeys::NONE,
            rrails: crate::types::RailKeys::NONE,
        };
        reg.finish_insert(
            0x1000,
            0x2000,
            Access::LOCAL_WRITE,
            vec![chunk(0x1000, 1), chunk(0x2000, 2)],
            Vec::new(),
            None,
        )
        .unwrap();
        let table = RemoteTable::new(vec![
            RemoteRegion::new(0x10000, 0x1000, 7, Access::REMOTE_WRITE),
            RemoteRegion::new(0x11000, 0x800, 8, Access::REMOTE_WRITE),
            RemoteRegion::new(0x20000, 0x1000, 9, Access::REMOTE_READ),
        ]);
        (reg, table)
    }

    fn write(local: u64, remote: u64, len: u64) -> TransferOp {
        TransferOp {
            op: Op::Write,
            local,
            remote,
            len,
        }
    }

    #[test]
    fn splits_at_both_sides_registration_edges() {
        let (reg, table) = setup();
        // Local chunk edge at 0x2000, remote edge at 0x11000.
        let (pins, ops, bytes) =
            resolve(&reg, &table, PeerId(1), &[write(0x1800, 0x10400, 0x1400)]).unwrap();
        assert_eq!(pins.len(), 1);
        assert_eq!(bytes, 0x1400);
        let got: Vec<_> = ops
            .iter()
            .map(|o| (o.local, o.lkey, o.remote, o.rkey, o.len))
            .collect();
        assert_eq!(
            got,
            [
                (0x1800, 1, 0x10400, 7, 0x800),
                (0x2000, 2, 0x10c00, 7, 0x400),
                (0x2400, 2, 0x11000, 8, 0x800),
            ]
        );
    }

    #[test]
    fn refuses_what_is_not_registered_exposed_or_allowed() {
        let (reg, table) = setup();
        let peer = PeerId(1);
        let e = resolve(&reg, &table, peer, &[write(0x3000, 0x10000, 8)]).unwrap_err();
        assert!(matches!(e, Error::Unregistered { .. }), "{e}");
        let e = resolve(&reg, &table, peer, &[write(0x1000, 0x11800, 8)]).unwrap_err();
        assert!(matches!(e, Error::RemoteOutOfBounds { .. }), "{e}");
        let e = resolve(&reg, &table, peer, &[write(0x1000, 0x20000, 8)]).unwrap_err();
        assert!(matches!(e, Error::RemotePermission { .. }), "{e}");
        let e = resolve(&reg, &table, peer, &[write(0x1000, 0x10000, 0)]).unwrap_err();
        assert!(matches!(e, Error::InvalidRange { .. }), "{e}");
        let read = TransferOp {
            op: Op::Read,
            ..write(0x1000, 0x20000, 8)
        };
        assert!(resolve(&reg, &table, peer, &[read]).is_ok());
    }
}
