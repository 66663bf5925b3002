//! The verbs (RC) backend, on sideway's extended QP API. All verbs FFI of the crate lives
//! in this folder.
//!
//! * `device`: device list, capabilities, active port, GID table; [`list_devices`].
//! * `gid`: perftest-style GID choice (pure).
//! * `plan`: slicing, SGE merging, striping, wr_id encoding, windows (pure).
//! * `qp`: RC QP creation, INIT/RTR/RTS, WR chains with one doorbell, CQ polling.
//! * `conn`: one connection (several QPs), batch bookkeeping, notification, failures.
//! * `poller`: per device: PD, registrations, connection setup; the completion thread.
//! * `rails`: several devices per engine: registration on each, striping, failover.
//! * `prefer`: which rails a registration's batches use, by where its memory is.
//!
//! Design notes and the soft-RoCE hazards it works around: docs/transport.md, "Verbs".

mod conn;
mod device;
mod gid;
mod poller;
mod prefer;
mod qp;
mod rails;
#[cfg(test)]
mod rxe_tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

pub use device::{NoRdma, RdmaDeviceInfo, RdmaPortInfo, host_rdma_missing, list_devices};
pub use gid::{GidInfo, GidKind};

use self::conn::VerbsConn;
use self::poller::{PendingVerbs, VerbsDevice, VerbsEndpoint, VerbsMr, VerbsOptions};
use self::rails::{MultiConn, RailSet, RailSpec, RailTags, RailsWanted, SeqWindow, parse_rails};
use crate::config::EngineConfig;
use crate::contract::{
    Backend, BackendInfo, BatchState, Conn, ConnCtx, EndpointInfo, FastPath, FastPathRequest,
    PendingConn, QpInfo, Reaper, ResolvedOp, ResolvedOps, TagSink,
};
use crate::core::slice::{Dir, PlanOp};
use crate::core::topology::{MemoryLocation, Placement, RailRef, Topology};
use crate::core::wire::RailEndpoint;
use crate::error::{Error, HandshakeError, PeerFault};
use crate::host;
use crate::types::{Access, BackendKind, MAX_RAILS, MrHandle, Op, PeerId, RailKeys, RailStats};

/// Opens the verbs backend: the configured devices (`rdma_device`: a name, a list
/// `name[:port[:gid]],...`, `all`, or unset for the first with an ACTIVE port), a PD per
/// device and (under auto progress) one completion thread for all of them. No device, no
/// kernel RDMA or no libibverbs gives [`Error::BackendUnavailable`], which `Auto` turns
/// into a TCP fallback.
pub(crate) fn open(config: &EngineConfig) -> Result<Arc<dyn Backend>, Error> {
    let wanted = parse_rails(
        config.rdma_device.as_deref(),
        config.ib_port,
        config.gid_index,
    )?;
    let specs = match wanted {
        RailsWanted::List(l) => l,
        RailsWanted::All => {
            let list: Vec<RailSpec> = list_devices()?
                .into_iter()
                .filter(|d| {
                    d.ports
                        .iter()
                        .any(|p| p.port == config.ib_port && p.state == "ACTIVE")
                })
                .take(MAX_RAILS)
                .map(|d| RailSpec {
                    name: Some(d.name),
                    port: config.ib_port,
                    gid_index: config.gid_index,
                })
                .collect();
            if list.is_empty() {
                return Err(device::no_device(NoRdma::NoActivePort {
                    port: config.ib_port,
                    devices: Vec::new(),
                }));
            }
            list
        }
    };
    let mut devices: Vec<Arc<VerbsDevice>> = Vec::with_capacity(specs.len());
    for spec in specs {
        let opts = VerbsOptions {
            device: spec.name,
            port: spec.port,
            gid_index: spec.gid_index,
            mtu: config.mtu,
            qps_per_peer: config.qps_per_peer.into(),
            tx_depth: config.tx_depth,
            signal_every: config.signal_every,
            max_wr_bytes: config.max_wr_bytes,
            max_mr_bytes: config.max_mr_bytes,
            poll_spin: config.poll_spin,
            progress: config.progress,
        };
        let shared = devices.first().map(|d| d.progress());
        devices.push(VerbsDevice::open(opts, shared.as_ref())?);
    }
    let placement = placement(config, &devices)?;
    let rails =
        (devices.len() > 1).then(|| Arc::new(RailSet::new(devices.clone(), config.max_wr_bytes)));
    let device = Arc::clone(&devices[0]);
    Ok(Arc::new(VerbsBackend {
        device,
        rails,
        placement,
    }))
}

/// Which rails serve which memory: the topology under `sysfs_root` and the priority
/// list. Read only with two rails or more; with one, the list is still checked against
/// the rail's name so that a typo is not silently ignored.
fn placement(config: &EngineConfig, devices: &[Arc<VerbsDevice>]) -> Result<Placement, Error> {
    let rails: Vec<RailRef> = devices
        .iter()
        .map(|d| RailRef {
            name: d.dev.name.clone(),
            gbps: d.dev.gbps,
        })
        .collect();
    let topo = if rails.len() > 1 {
        let root = config
            .sysfs_root
            .clone()
            .unwrap_or_else(|| host::DEFAULT_SYSFS_ROOT.into());
        host::read_sysfs(&root).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no topology: every rail serves all memory alike");
            Topology::default()
        })
    } else {
        Topology::default()
    };
    let p = Placement::new(topo, rails, config.rail_priority.clone())?;
    for (loc, c) in p.table() {
        tracing::debug!(memory = %loc, tiers = ?c.tiers, source = ?c.source, "rails by topology");
    }
    Ok(p)
}

#[derive(Debug)]
struct VerbsBackend {
    /// Rail 0 (the only one of a one-rail engine).
    device: Arc<VerbsDevice>,
    /// Two rails or more.
    rails: Option<Arc<RailSet>>,
    /// Which rails serve which memory (used with two rails or more).
    placement: Placement,
}

impl VerbsBackend {
    fn mr(mr: VerbsMr) -> MrHandle {
        MrHandle {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            handle: Some(Box::new(mr)),
            lrails: RailKeys::NONE,
            rrails: RailKeys::NONE,
        }
    }

    /// Registers with `reg` on every rail ([`Self::register_all`]), or on the one device.
    fn register_on_rails(
        &self,
        addr: usize,
        reg: impl Fn(&VerbsDevice) -> Result<VerbsMr, Error>,
    ) -> Result<MrHandle, Error> {
        match &self.rails {
            Some(set) => self.register_all(set, addr, reg),
            None => Ok(Self::mr(reg(&self.device)?)),
        }
    }

    /// Registers on every rail with `reg`; rail 0's keys are the handle's, the others'
    /// ride along (and the local ones are remembered for translating ops).
    fn register_all(
        &self,
        set: &RailSet,
        addr: usize,
        reg: impl Fn(&VerbsDevice) -> Result<VerbsMr, Error>,
    ) -> Result<MrHandle, Error> {
        let mut mrs = Vec::with_capacity(set.devices.len());
        for d in &set.devices {
            // A failure drops (deregisters) the ones made so far.
            mrs.push(reg(d)?);
        }
        let lk: Vec<u32> = mrs[1..].iter().map(VerbsMr::lkey).collect();
        let rk: Vec<u32> = mrs[1..].iter().map(VerbsMr::rkey).collect();
        let lrails = RailKeys::from_slice(&lk).expect("at most MAX_RAILS rails");
        let rrails = RailKeys::from_slice(&rk).expect("at most MAX_RAILS rails");
        let lkey = mrs[0].lkey();
        set.remember(lkey, lrails);
        // Host memory: the node its (now pinned) first page is on. Device memory has no
        // node and stays unknown until `place` says which GPU it is on.
        let loc = host::node_of(addr).map_or(MemoryLocation::Any, MemoryLocation::HostNode);
        set.prefs
            .remember(lkey, &prefer::tiers_for(&self.placement, &loc));
        Ok(MrHandle {
            lkey,
            rkey: mrs[0].rkey(),
            handle: Some(Box::new(mrs)),
            lrails,
            rrails,
        })
    }
}

impl Backend for VerbsBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Verbs
    }

    fn info(&self) -> BackendInfo {
        let e = &self.device;
        let d = &e.dev;
        BackendInfo {
            kind: BackendKind::Verbs,
            device: d.name.clone(),
            port: d.port,
            link: match d.gid.kind {
                GidKind::Ib => "InfiniBand".into(),
                k => format!("Ethernet ({k})"),
            },
            mtu: e.mtu,
            gid: Some(d.gid.addr.octets()),
            gid_index: Some(d.gid.index),
            lid: d.lid,
            qps_or_streams: e.opts.qps_per_peer as u16,
            tx_depth: e.opts.tx_depth.min(d.caps.max_qp_wr),
            signal_every: e.opts.signal_every,
            max_wr_bytes: e.opts.max_wr_bytes,
            max_mr_bytes: e.max_mr_bytes(),
            max_outstanding_reads: Some(u32::from(e.max_rd_atomic())),
            selection: String::new(),
            rails: match &self.rails {
                Some(set) => set.devices.iter().map(|d| rail_label(d)).collect(),
                None => vec![rail_label(e)],
            },
            // The deprecated `lanes_per_peer` (the engine copies `qps_or_streams` in).
            ..BackendInfo::default()
        }
    }

    fn register(&self, addr: usize, len: usize, access: Access) -> Result<MrHandle, Error> {
        self.register_on_rails(addr, |d| {
            // SAFETY: the engine core only registers memory the caller promised to keep
            // mapped until deregistration (`HostBuffer` keep-alive or `register_raw`'s
            // contract), and drops the returned handle (deregistering every rail's MR)
            // before giving the memory back.
            unsafe {
                d.register(
                    addr as u64,
                    len as u64,
                    access.contains(Access::REMOTE_WRITE),
                    access.contains(Access::REMOTE_READ),
                )
            }
        })
    }

    fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<MrHandle, Error> {
        // `iova` is a device address: `node_of` finds no host page there.
        self.register_on_rails(iova as usize, |d| {
            // SAFETY: `Engine::register_dmabuf`'s contract: `fd` is a dma-buf whose range
            // stays allocated until the region is deregistered, which drops every rail's
            // MR first.
            unsafe {
                d.register_dmabuf(
                    fd,
                    offset,
                    len as u64,
                    iova,
                    access.contains(Access::REMOTE_WRITE),
                    access.contains(Access::REMOTE_READ),
                )
            }
        })
    }

    fn deregister(&self, mr: MrHandle) {
        if let Some(set) = &self.rails {
            set.forget(mr.lkey);
            set.prefs.forget(mr.lkey);
        }
        // Dropping the `VerbsMr`s runs `ibv_dereg_mr`.
        drop(mr);
    }

    fn prepare_conn(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo), Error> {
        let (pending, ep) = self.device.prepare()?;
        let mut more = Vec::new();
        let mut rails = Vec::new();
        if let Some(set) = &self.rails {
            for d in &set.devices[1..] {
                let (p, e) = d.prepare()?;
                more.push(p);
                rails.push(RailEndpoint {
                    gid: e.gid,
                    lid: e.lid,
                    mtu: e.mtu,
                    qps: qp_infos(&e.qps),
                });
            }
        }
        let info = EndpointInfo::Verbs {
            gid: ep.gid,
            lid: ep.lid,
            mtu: ep.mtu,
            qps: qp_infos(&ep.qps),
            rails,
        };
        Ok((
            Box::new(Pending {
                first: pending,
                more,
                set: self.rails.clone(),
            }),
            info,
        ))
    }

    fn place(&self, lkeys: &[u32], loc: &MemoryLocation) {
        if let Some(set) = &self.rails {
            let tiers = prefer::tiers_for(&self.placement, loc);
            for &lkey in lkeys {
                set.prefs.remember(lkey, &tiers);
            }
        }
    }

    fn rail_stats(&self) -> Vec<RailStats> {
        self.rails.as_ref().map_or_else(Vec::new, |s| s.stats())
    }

    fn reaper(&self) -> Option<Arc<dyn Reaper>> {
        Some(self.device.progress())
    }

    fn shutdown(&self) {
        self.device.stop();
    }
}

/// `name:port` with the GID index and link speed, for reports.
fn rail_label(d: &VerbsDevice) -> String {
    let speed = match d.dev.gbps {
        0 => String::from("speed unknown"),
        g => format!("{g} Gb/s"),
    };
    format!(
        "{}:{} (gid {}, {speed})",
        d.dev.name, d.dev.port, d.dev.gid.index
    )
}

fn qp_infos(qps: &[(u32, u32)]) -> Vec<QpInfo> {
    qps.iter().map(|&(qpn, psn)| QpInfo { qpn, psn }).collect()
}

/// One rail's QPs as the control channel carries them (a verbs endpoint without rails).
fn endpoint_info(e: &VerbsEndpoint) -> EndpointInfo {
    EndpointInfo::Verbs {
        gid: e.gid,
        lid: e.lid,
        mtu: e.mtu,
        qps: qp_infos(&e.qps),
        rails: Vec::new(),
    }
}

/// The peer's QPs for one rail, from what the control channel carried.
fn verbs_endpoint(e: &EndpointInfo) -> Result<VerbsEndpoint, Error> {
    match e {
        EndpointInfo::Verbs {
            gid, lid, mtu, qps, ..
        } => Ok(VerbsEndpoint {
            gid: *gid,
            lid: *lid,
            mtu: *mtu,
            qps: qps.iter().map(|q| (q.qpn, q.psn)).collect(),
        }),
        other => Err(HandshakeError::BackendMismatch {
            ours: "verbs".into(),
            theirs: other.backend_name().into(),
        }
        .into()),
    }
}

#[derive(Debug)]
struct Pending {
    first: PendingVerbs,
    /// Rails 1.. of a multi-rail engine.
    more: Vec<PendingVerbs>,
    set: Option<Arc<RailSet>>,
}

impl PendingConn for Pending {
    fn complete(
        self: Box<Self>,
        remote: &EndpointInfo,
        ctx: ConnCtx,
    ) -> Result<Arc<dyn Conn>, Error> {
        let EndpointInfo::Verbs {
            gid,
            lid,
            mtu,
            qps,
            rails,
        } = remote
        else {
            return Err(HandshakeError::BackendMismatch {
                ours: "verbs".into(),
                theirs: remote.backend_name().into(),
            }
            .into());
        };
        let endpoint = |gid: &[u8; 16], lid: u16, mtu: u32, qps: &[QpInfo]| VerbsEndpoint {
            gid: *gid,
            lid,
            mtu,
            qps: qps.iter().map(|q| (q.qpn, q.psn)).collect(),
        };
        let peer = ctx.peer;
        let sink: Arc<dyn TagSink> = Arc::new(ctx.notify);
        let this = *self;
        // Rail i pairs with the peer's rail i; rails either side has alone stay idle. Both
        // sides agree on `paired`, and so on how notifications are framed (RailTags).
        let paired = this.more.len().min(rails.len());
        let multi = paired > 0 && this.set.is_some();
        let seen = Arc::new(std::sync::Mutex::new(SeqWindow::new()));
        let tags = || {
            if multi {
                RailTags::sink(Arc::clone(&sink), Arc::clone(&seen))
            } else {
                Arc::clone(&sink)
            }
        };
        let first = this
            .first
            .complete(&endpoint(gid, *lid, *mtu, qps), Some(tags()), peer)?;
        let Some(set) = this.set.filter(|_| paired > 0) else {
            return Ok(Arc::new(VerbsPeerConn { conn: first, peer }));
        };
        let mut conns = vec![first];
        for (p, r) in this.more.into_iter().zip(rails).take(paired) {
            match p.complete(&endpoint(&r.gid, r.lid, r.mtu, &r.qps), Some(tags()), peer) {
                Ok(c) => conns.push(c),
                Err(e) => {
                    for c in &conns {
                        c.close(Error::peer_gone(
                            peer,
                            PeerFault::ClosedLocally,
                            "setup failed",
                        ));
                    }
                    return Err(e);
                }
            }
        }
        Ok(MultiConn::new(set, conns, peer, (sink, seen), ctx.rails))
    }
}

#[derive(Debug)]
struct VerbsPeerConn {
    conn: Arc<VerbsConn>,
    peer: PeerId,
}

/// The verbs view of a validated op.
fn plan_op(o: &ResolvedOp) -> PlanOp {
    PlanOp {
        dir: match o.op {
            Op::Write => Dir::Write,
            Op::Read => Dir::Read,
        },
        local: o.local,
        lkey: o.lkey,
        remote: o.remote,
        rkey: o.rkey,
        len: o.len,
    }
}

/// A prepared batch posted as one chain on QP 0 of its connection.
struct VerbsLane {
    conn: Arc<VerbsConn>,
    chain: conn::LaneChain,
    peer: PeerId,
    /// Waiting rounds so far (see `VerbsConn::reap_waiting`).
    polls: AtomicU32,
}

impl FastPath for VerbsLane {
    fn start(&self, tag: Option<u32>) -> Result<(), Error> {
        // sideway passes the immediate through as raw `__be32`: network order, as the
        // ordinary path sends it.
        self.conn
            .post_lane(&self.chain, tag.map(u32::to_be))
            .map_err(|e| closed_as_gone(e, self.peer))
    }

    fn poll(&self) -> usize {
        let round = self.polls.fetch_add(1, Ordering::Relaxed);
        self.conn.reap_waiting(round, true)
    }

    fn abort(&self) -> bool {
        self.conn.abort_lane(&self.chain)
    }
}

impl Drop for VerbsLane {
    fn drop(&mut self) {
        self.conn.drop_lane(&self.chain);
    }
}

fn closed_as_gone(e: Error, peer: PeerId) -> Error {
    match e {
        Error::Shutdown => Error::peer_gone(peer, PeerFault::ClosedLocally, "connection closed"),
        e => e,
    }
}

impl Conn for VerbsPeerConn {
    fn prepare_fast_path(&self, req: FastPathRequest<'_>) -> Option<Box<dyn FastPath>> {
        let chain = self.conn.prepare_fast_path(
            req.ops.iter().map(plan_op),
            req.notify.is_some(),
            Arc::clone(req.cell),
        )?;
        Some(Box::new(VerbsLane {
            conn: Arc::clone(&self.conn),
            chain,
            peer: self.peer,
            polls: AtomicU32::new(0),
        }))
    }

    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<(), Error> {
        let plan = ops.iter().map(plan_op);
        let deadline = batch.deadline();
        self.conn
            .post(batch, plan, notify, deadline)
            .map_err(|e| closed_as_gone(e, self.peer))
    }

    fn is_broken(&self) -> bool {
        self.conn.is_broken()
    }

    fn probe(&self, deadline: std::time::Instant) -> Result<(), Error> {
        self.conn.probe(deadline)
    }

    fn close(&self) {
        self.conn.close(Error::peer_gone(
            self.peer,
            PeerFault::ClosedLocally,
            "connection closed",
        ));
    }
}
