//! The verbs (RC) backend, on sideway's extended QP API. All verbs FFI of the crate lives
//! in this folder.
//!
//! * `device`: device list, capabilities, active port, GID table; [`list_devices`].
//! * `gid`: perftest-style GID choice (pure).
//! * `plan`: slicing, SGE merging, striping, wr_id encoding, windows (pure).
//! * `qp`: RC QP creation, INIT/RTR/RTS, WR chains with one doorbell, CQ polling.
//! * `conn`: one connection (several QPs), batch bookkeeping, notification, failures.
//! * `engine`: PD, registrations, the completion thread, connection setup.
//!
//! Design notes and the soft-RoCE hazards it works around: docs/transport.md, "Verbs".

mod conn;
mod device;
mod gid;
mod poller;
mod qp;
#[cfg(test)]
mod rxe_tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

pub use device::{NoRdma, RdmaDeviceInfo, RdmaPortInfo, host_rdma_missing, list_devices};
pub use gid::{GidInfo, GidKind};

use self::conn::VerbsConn;
use self::poller::{PendingVerbs, VerbsDevice, VerbsEndpoint, VerbsMr, VerbsOptions};
use crate::config::EngineConfig;
use crate::contract::{
    Backend, BackendInfo, BatchState, Conn, ConnCtx, EndpointInfo, FastPath, FastPathRequest,
    PendingConn, QpInfo, Reaper, ResolvedOp, ResolvedOps, TagSink,
};
use crate::core::slice::{Dir, PlanOp};
use crate::error::{Error, HandshakeError, PeerFault};
use crate::types::{Access, BackendKind, MrHandle, Op, PeerId};

/// Opens the verbs backend: the configured device (or the first with an ACTIVE port),
/// its PD and (under auto progress) the completion thread. No device, no kernel RDMA or
/// no libibverbs gives [`Error::BackendUnavailable`], which `Auto` turns into a TCP
/// fallback.
pub(crate) fn open(config: &EngineConfig) -> Result<Arc<dyn Backend>, Error> {
    let engine = VerbsDevice::open(VerbsOptions {
        device: config.rdma_device.clone(),
        port: config.ib_port,
        gid_index: config.gid_index,
        mtu: config.mtu,
        qps_per_peer: config.qps_per_peer.into(),
        tx_depth: config.tx_depth,
        signal_every: config.signal_every,
        max_wr_bytes: config.max_wr_bytes,
        max_mr_bytes: config.max_mr_bytes,
        poll_spin: config.poll_spin,
        progress: config.progress,
    })?;
    Ok(Arc::new(VerbsBackend { device: engine }))
}

#[derive(Debug)]
struct VerbsBackend {
    device: Arc<VerbsDevice>,
}

impl VerbsBackend {
    fn mr(mr: VerbsMr) -> MrHandle {
        MrHandle {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            handle: Some(Box::new(mr)),
        }
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
            lanes_per_peer: e.opts.qps_per_peer as u16,
            tx_depth: e.opts.tx_depth.min(d.caps.max_qp_wr),
            signal_every: e.opts.signal_every,
            max_wr_bytes: e.opts.max_wr_bytes,
            max_mr_bytes: e.max_mr_bytes(),
            max_outstanding_reads: Some(u32::from(e.max_rd_atomic())),
            selection: String::new(),
        }
    }

    fn register(&self, addr: usize, len: usize, access: Access) -> Result<MrHandle, Error> {
        // SAFETY: the engine core only registers memory the caller promised to keep mapped
        // until deregistration (`HostBuffer` keep-alive or `register_raw`'s contract), and
        // drops the returned MR (deregistering it) before giving the memory back.
        let mr = unsafe {
            self.device.register(
                addr as u64,
                len as u64,
                access.contains(Access::REMOTE_WRITE),
                access.contains(Access::REMOTE_READ),
            )
        }?;
        Ok(Self::mr(mr))
    }

    fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<MrHandle, Error> {
        // SAFETY: `Engine::register_dmabuf`'s contract: `fd` is a dma-buf whose range stays
        // allocated until the region is deregistered, which drops this MR first.
        let mr = unsafe {
            self.device.register_dmabuf(
                fd,
                offset,
                len as u64,
                iova,
                access.contains(Access::REMOTE_WRITE),
                access.contains(Access::REMOTE_READ),
            )
        }?;
        Ok(Self::mr(mr))
    }

    fn deregister(&self, mr: MrHandle) {
        // Dropping the `VerbsMr` runs `ibv_dereg_mr`.
        drop(mr);
    }

    fn prepare_conn(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo), Error> {
        let (pending, ep) = self.device.prepare()?;
        let info = EndpointInfo::Verbs {
            gid: ep.gid,
            lid: ep.lid,
            mtu: ep.mtu,
            qps: ep
                .qps
                .iter()
                .map(|&(qpn, psn)| QpInfo { qpn, psn })
                .collect(),
        };
        Ok((Box::new(Pending(pending)), info))
    }

    fn reaper(&self) -> Option<Arc<dyn Reaper>> {
        Some(self.device.progress())
    }

    fn shutdown(&self) {
        self.device.stop();
    }
}

#[derive(Debug)]
struct Pending(PendingVerbs);

impl PendingConn for Pending {
    fn complete(
        self: Box<Self>,
        remote: &EndpointInfo,
        ctx: ConnCtx,
    ) -> Result<Arc<dyn Conn>, Error> {
        let EndpointInfo::Verbs { gid, lid, mtu, qps } = remote else {
            return Err(HandshakeError::BackendMismatch {
                ours: "verbs".into(),
                theirs: remote.backend_name().into(),
            }
            .into());
        };
        let ep = VerbsEndpoint {
            gid: *gid,
            lid: *lid,
            mtu: *mtu,
            qps: qps.iter().map(|q| (q.qpn, q.psn)).collect(),
        };
        let peer = ctx.peer;
        let sink: Arc<dyn TagSink> = Arc::new(ctx.notify);
        let conn = self.0.complete(&ep, Some(sink), peer)?;
        Ok(Arc::new(VerbsPeerConn { conn, peer }))
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
