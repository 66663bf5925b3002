//! Open segments: Mooncake's segment ids (`openSegment`) and the Python binding's
//! per-session-id cache are one table here, keyed by name.
//!
//! A segment is the connection to one peer engine plus the regions it exposes, as last
//! described. Opening a name again returns the same id while the connection lives; a
//! broken one is reconnected under the same id by the next open. Segment 0
//! ([`LOCAL_SEGMENT`]) is this engine itself, connected on first use.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pagewire_transport::{Access, PeerId, RemoteRegion};

use crate::code::{Code, Error, fail};
use crate::directory::{DirectoryError, check_name};
use crate::engine::TransferEngine;
use crate::{lock, sid};

/// `LOCAL_SEGMENT`: this engine itself.
pub const LOCAL_SEGMENT: i32 = 0;
/// Most segments open at once on one engine.
const MAX_SEGMENTS: usize = 1 << 16;

#[derive(Debug)]
struct Segment {
    name: String,
    peer: Option<PeerId>,
    /// The peer's exposed regions, sorted, as last described.
    regions: Arc<Vec<RemoteRegion>>,
    /// Bumped by every describe: a submit that waited for another's refresh uses its
    /// result instead of asking the peer again.
    epoch: u64,
    /// Held while the peer is asked for its regions (one describe in flight at a time).
    refreshing: Arc<Mutex<()>>,
}

impl Segment {
    fn new(name: &str, peer: Option<PeerId>, regions: Arc<Vec<RemoteRegion>>) -> Segment {
        Segment {
            name: name.to_owned(),
            peer,
            regions,
            epoch: 0,
            refreshing: Arc::default(),
        }
    }

    fn target(&self, id: i32, peer: PeerId) -> Target {
        Target {
            id,
            peer,
            regions: self.regions.clone(),
            epoch: self.epoch,
        }
    }
}

/// The segment table.
#[derive(Debug)]
pub(crate) struct Segments {
    by_name: HashMap<String, i32>,
    by_id: BTreeMap<i32, Segment>,
    next_id: i32,
}

impl Segments {
    /// A table holding only this engine's own segment, named `own_name`.
    pub(crate) fn new(own_name: &str) -> Segments {
        let mut s = Segments {
            by_name: HashMap::new(),
            by_id: BTreeMap::new(),
            next_id: LOCAL_SEGMENT + 1,
        };
        s.by_name.insert(own_name.to_owned(), LOCAL_SEGMENT);
        s.by_id
            .insert(LOCAL_SEGMENT, Segment::new(own_name, None, Arc::default()));
        s
    }

    /// The connections of open segments.
    pub(crate) fn peers(&self) -> Vec<PeerId> {
        self.by_id.values().filter_map(|s| s.peer).collect()
    }
}

/// An open segment as a submit sees it.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) id: i32,
    pub(crate) peer: PeerId,
    pub(crate) regions: Arc<Vec<RemoteRegion>>,
    pub(crate) epoch: u64,
}

/// An open segment, as [`TransferEngine::segments`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Its id.
    pub id: i32,
    /// Its name (`host:port`).
    pub name: String,
    /// Whether its connection is up.
    pub connected: bool,
}

fn sorted(mut v: Vec<RemoteRegion>) -> Arc<Vec<RemoteRegion>> {
    v.sort_by_key(|r| r.addr);
    Arc::new(v)
}

/// Whether `[addr, addr+len)` is covered by `regions` (sorted) with `need`, across
/// adjacent regions.
pub(crate) fn remote_covered(regions: &[RemoteRegion], addr: u64, len: u64, need: Access) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut at = addr;
    let mut i = regions.partition_point(|r| r.end() <= at);
    while at < end {
        let Some(r) = regions.get(i) else {
            return false;
        };
        if r.addr > at || !r.access.contains(need) {
            return false;
        }
        at = r.end();
        i += 1;
    }
    true
}

impl TransferEngine {
    /// `openSegment`: the id of the segment named `host:port` (`[v6]:port`), connecting
    /// (handshake) on first use or when its connection broke; this engine's own name is
    /// [`LOCAL_SEGMENT`]. Blocks for at most the handshake timeout (plus as much for the
    /// name lookup). `refresh` (`openSegmentNoCache`) asks an open segment's peer again
    /// for its regions.
    pub fn open_segment(&self, name: &str, refresh: bool) -> Result<i32, Error> {
        let t = self.open(name)?;
        if refresh && !t.fresh {
            self.refresh(t.target.id, t.target.peer)?;
        }
        Ok(t.target.id)
    }

    /// The open segment named `name`, connected (see [`Self::open_segment`]).
    pub(crate) fn open(&self, name: &str) -> Result<Opened, Error> {
        let local = {
            let segs = lock(&self.inner.segments);
            match segs.by_name.get(name).map(|&id| (id, &segs.by_id[&id])) {
                Some((id, s)) => match s.peer {
                    Some(p) if self.transport().peer_alive(p).unwrap_or(false) => {
                        return Ok(Opened {
                            target: s.target(id, p),
                            fresh: false,
                        });
                    }
                    None if id == LOCAL_SEGMENT => true,
                    _ => false,
                },
                None => false,
            }
        };
        if local {
            return self.segment(LOCAL_SEGMENT).map(|target| Opened {
                target,
                fresh: true,
            });
        }
        let (addrs, expect) = self.locate(name)?;
        let peer = self
            .connect_to(name, &addrs, expect)
            .map_err(|e| Error::transport(&format!("cannot open segment {name:?}"), e))?;
        self.install(name, peer).map(|target| Opened {
            target,
            fresh: true,
        })
    }

    /// The addresses of the engine named `name`, and the engine id it must answer with
    /// when a directory published one. P2P: `name` is `host:port`
    /// ([`Code::InvalidArgument`] when malformed, [`Code::Dns`] when it does not
    /// resolve). With a directory: the name is looked up there within the handshake
    /// timeout; a name nobody holds is [`Code::InvalidArgument`] (Mooncake's -1), a
    /// directory that fails [`Code::Metadata`].
    fn locate(&self, name: &str) -> Result<(Vec<SocketAddr>, Option<u64>), Error> {
        let within = self.handshake_timeout();
        let Some(dir) = &self.inner.directory else {
            let (host, port) = sid::parse(name).map_err(|why| {
                Error::new(
                    Code::InvalidArgument,
                    format!("segment name {name:?}: {why}"),
                )
            })?;
            let addrs = sid::resolve(host, port, within)
                .map_err(|m| Error::new(Code::Dns, format!("segment {name:?}: {m}")))?;
            return Ok((addrs, None));
        };
        check_name(name).map_err(|why| Error::new(Code::InvalidArgument, why))?;
        let found = dir
            .resolve(name, Instant::now() + within)
            .map_err(|e| Error::directory(&format!("looking up segment {name:?}"), e))?;
        let Some(desc) = found else {
            return fail(
                Code::InvalidArgument,
                format!(
                    "segment {name:?} is not registered in {} (no live engine has that name)",
                    dir.describe()
                ),
            );
        };
        if desc.name != name {
            let e = DirectoryError::Malformed {
                name: name.to_owned(),
                reason: format!("it names segment {:?}", desc.name),
            };
            return Err(Error::directory("looking up a segment", e));
        }
        let (host, port) = sid::parse(&desc.rpc).map_err(|why| {
            let e = DirectoryError::Malformed {
                name: name.to_owned(),
                reason: format!("address {:?}: {why}", desc.rpc),
            };
            Error::directory("looking up a segment", e)
        })?;
        let addrs = sid::resolve(host, port, within)
            .map_err(|m| Error::new(Code::Dns, format!("segment {name:?}: {m}")))?;
        Ok((addrs, Some(desc.engine_id)))
    }

    /// Connects to `addrs`; with `expect`, the engine reached must have that id (a
    /// directory's entry whose address another engine took since is refused).
    fn connect_to(
        &self,
        name: &str,
        addrs: &[SocketAddr],
        expect: Option<u64>,
    ) -> Result<PeerId, pagewire_transport::Error> {
        let peer = self.transport().connect(addrs)?;
        if let Some(want) = expect {
            let got = self.transport().peer_info(peer).map(|i| i.engine_id);
            if got.as_ref().ok() != Some(&want) {
                let _ = self.transport().disconnect(peer);
                return Err(pagewire_transport::Error::PeerGone {
                    peer,
                    fault: pagewire_transport::PeerFault::Disconnected,
                    reason: format!(
                        "the engine published as {name:?} ({want:016x}) is gone: another one answers at its address"
                    ),
                });
            }
        }
        Ok(peer)
    }

    /// Makes `peer` (just connected) the connection of the segment `name`, replacing a
    /// broken one, or opens a new segment for it.
    pub(crate) fn install(&self, name: &str, peer: PeerId) -> Result<Target, Error> {
        let regions = sorted(self.transport().peer_regions(peer).unwrap_or_default());
        let mut segs = lock(&self.inner.segments);
        if let Some(&id) = segs.by_name.get(name) {
            let seg = segs.by_id.get_mut(&id).expect("by_name and by_id agree");
            let old = seg.peer.replace(peer);
            seg.regions = regions;
            seg.epoch += 1;
            let t = seg.target(id, peer);
            drop(segs);
            if let Some(old) = old.filter(|&o| o != peer) {
                let _ = self.transport().disconnect(old);
            }
            return Ok(t);
        }
        if segs.by_id.len() >= MAX_SEGMENTS || segs.next_id == i32::MAX {
            drop(segs);
            let _ = self.transport().disconnect(peer);
            return fail(
                Code::TooManyRequests,
                format!("{MAX_SEGMENTS} segments are open"),
            );
        }
        let id = segs.next_id;
        segs.next_id += 1;
        segs.by_name.insert(name.to_owned(), id);
        let seg = Segment::new(name, Some(peer), regions);
        let t = seg.target(id, peer);
        segs.by_id.insert(id, seg);
        Ok(t)
    }

    /// The peer and regions of an open segment; segment 0 (this engine) connects to
    /// itself on first use.
    pub(crate) fn segment(&self, id: i32) -> Result<Target, Error> {
        {
            let segs = lock(&self.inner.segments);
            let Some(seg) = segs.by_id.get(&id) else {
                return fail(Code::InvalidArgument, format!("unknown segment id {id}"));
            };
            if let Some(p) = seg.peer {
                return Ok(seg.target(id, p));
            }
            if id != LOCAL_SEGMENT {
                return fail(Code::InvalidArgument, format!("segment {id} is closed"));
            }
        }
        let mut addr = self.transport().local_addr();
        if addr.ip().is_unspecified() {
            addr.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let peer = self
            .transport()
            .connect(addr)
            .map_err(|e| Error::transport("connecting to this engine", e))?;
        let regions = sorted(self.transport().peer_regions(peer).unwrap_or_default());
        let mut segs = lock(&self.inner.segments);
        let seg = segs
            .by_id
            .get_mut(&LOCAL_SEGMENT)
            .expect("segment 0 always exists");
        if let Some(p) = seg.peer {
            // Another thread connected first.
            let t = seg.target(LOCAL_SEGMENT, p);
            drop(segs);
            let _ = self.transport().disconnect(peer);
            return Ok(t);
        }
        seg.peer = Some(peer);
        seg.regions = regions;
        seg.epoch += 1;
        Ok(seg.target(LOCAL_SEGMENT, peer))
    }

    /// Asks a segment's peer again for its regions.
    pub(crate) fn refresh(&self, id: i32, peer: PeerId) -> Result<Target, Error> {
        let regions = self
            .transport()
            .redescribe(peer)
            .map_err(|e| Error::transport(&format!("describing segment {id}"), e))?;
        let regions = sorted(regions);
        let mut segs = lock(&self.inner.segments);
        match segs.by_id.get_mut(&id) {
            Some(seg) if seg.peer == Some(peer) => {
                seg.regions = regions;
                seg.epoch += 1;
                Ok(seg.target(id, peer))
            }
            _ => Ok(Target {
                id,
                peer,
                regions,
                epoch: 0,
            }),
        }
    }

    /// A submit found a remote range outside `t`'s regions: the peer may have
    /// registered memory since. Asks it again, one describe at a time per segment; a
    /// submit that waited for another's describe uses that one's answer.
    pub(crate) fn refresh_for_submit(&self, t: &Target) -> Result<Target, Error> {
        let gate = match lock(&self.inner.segments).by_id.get(&t.id) {
            Some(s) if s.peer == Some(t.peer) => s.refreshing.clone(),
            _ => return self.refresh(t.id, t.peer),
        };
        let _one_at_a_time = lock(&gate);
        if let Some(s) = lock(&self.inner.segments).by_id.get(&t.id)
            && s.peer == Some(t.peer)
            && s.epoch != t.epoch
        {
            return Ok(s.target(t.id, t.peer));
        }
        self.refresh(t.id, t.peer)
    }

    /// `closeSegment`: disconnects; the segment's pending batches fail and its id is
    /// dead (segment 0 only disconnects).
    pub fn close_segment(&self, id: i32) -> Result<(), Error> {
        let mut segs = lock(&self.inner.segments);
        let peer = if id == LOCAL_SEGMENT {
            let seg = segs.by_id.get_mut(&id).expect("segment 0 always exists");
            seg.epoch += 1;
            seg.peer.take()
        } else {
            let Some(seg) = segs.by_id.remove(&id) else {
                return fail(Code::InvalidArgument, format!("unknown segment id {id}"));
            };
            segs.by_name.remove(&seg.name);
            seg.peer
        };
        drop(segs);
        if let Some(p) = peer {
            let _ = self.transport().disconnect(p);
        }
        Ok(())
    }

    /// `syncSegmentCache`: asks every open segment's peer again for its regions. Tries
    /// all; returns the first failure.
    pub fn sync_segments(&self) -> Result<(), Error> {
        let open: Vec<(i32, PeerId)> = lock(&self.inner.segments)
            .by_id
            .iter()
            .filter_map(|(&id, s)| s.peer.map(|p| (id, p)))
            .collect();
        let mut first = Ok(());
        for (id, p) in open {
            if let Err(e) = self.refresh(id, p) {
                first = first.and(Err(e));
            }
        }
        first
    }

    /// Open segments, by id (ascending).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let list: Vec<(i32, String, Option<PeerId>)> = lock(&self.inner.segments)
            .by_id
            .iter()
            .map(|(&id, s)| (id, s.name.clone(), s.peer))
            .collect();
        list.into_iter()
            .map(|(id, name, p)| SegmentInfo {
                id,
                name,
                connected: p.is_some_and(|p| self.transport().peer_alive(p).unwrap_or(false)),
            })
            .collect()
    }

    /// Mooncake's `send_probe`: `Ok` when the engine behind the session id answers a
    /// handshake (or, on a live cached connection, a describe) within the handshake
    /// timeout. A malformed id, or with a directory a name nobody holds there or a
    /// failed lookup, is [`Code::Metadata`], a name that does not resolve [`Code::Dns`],
    /// anything else [`Code::Socket`]. A fresh connection becomes the segment's.
    pub fn send_probe(&self, name: &str) -> Result<(), Error> {
        // A malformed id, or a name the directory does not hold, names no engine.
        let (addrs, expect) = self.locate(name).map_err(|e| match e.code() {
            Code::InvalidArgument => e.recode(Code::Metadata),
            _ => e,
        })?;
        let probe = |e| Error::with_code(Code::Socket, &format!("probe {name}"), e);
        let cached = {
            let segs = lock(&self.inner.segments);
            segs.by_name
                .get(name)
                .and_then(|id| segs.by_id[id].peer.map(|p| (*id, p)))
        };
        if let Some((id, p)) = cached
            && self.transport().peer_alive(p).unwrap_or(false)
        {
            return self
                .refresh(id, p)
                .map(drop)
                .map_err(|e| match e.transport_error() {
                    Some(t) => probe(t.clone()),
                    None => e,
                });
        }
        let peer = self.connect_to(name, &addrs, expect).map_err(probe)?;
        self.install(name, peer).map(drop)
    }

    /// The lowest address the peer behind `name` exposes for writing (its notification
    /// outbox, which is read-only, does not count); 0 when it exposes none. Asks the
    /// peer, so it is current.
    pub fn first_buffer_address(&self, name: &str) -> Result<u64, Error> {
        let t = self.open(name)?.target;
        let t = self.refresh(t.id, t.peer)?;
        Ok(t.regions
            .iter()
            .find(|r| r.access.contains(Access::REMOTE_WRITE))
            .map_or(0, |r| r.addr))
    }
}

/// What [`TransferEngine::open`] found.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) target: Target,
    /// Connected just now (its regions are fresh).
    pub(crate) fresh: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_coverage_spans_adjacent_regions() {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let regions = [
            RemoteRegion::new(100, 100, 1, rw),
            RemoteRegion::new(200, 100, 2, rw),
            RemoteRegion::new(400, 100, 3, Access::REMOTE_READ),
        ];
        assert!(remote_covered(&regions, 150, 100, Access::REMOTE_WRITE));
        assert!(remote_covered(&regions, 100, 200, Access::REMOTE_WRITE));
        assert!(
            !remote_covered(&regions, 250, 100, Access::REMOTE_WRITE),
            "gap"
        );
        assert!(!remote_covered(&regions, 99, 2, Access::REMOTE_WRITE));
        assert!(remote_covered(&regions, 400, 100, Access::REMOTE_READ));
        assert!(
            !remote_covered(&regions, 400, 100, Access::REMOTE_WRITE),
            "access"
        );
        assert!(!remote_covered(&regions, u64::MAX, 2, Access::REMOTE_READ));
    }
}
