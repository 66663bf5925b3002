//! RC queue pairs on sideway's extended QP API: creation, INIT -> RTR -> RTS, WR chains with one
//! doorbell, RECVs for WRITE_WITH_IMM, real-state queries, and basic-CQ polling.

use std::sync::Arc;

use rdma_mummy_sys::{ibv_sge, ibv_wc};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionQueue as _};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard as _, QueuePair as _, QueuePairAttribute,
    QueuePairAttributeMask, QueuePairState, SendOperationFlags, SetScatterGatherEntry as _,
    WorkRequestFlags,
};

use super::device::mtu_from_bytes;
use super::device::verbs_err as verr;
use crate::core::slice::{Dir, Sge};
use crate::error::Error;
use crate::util::random_psn;

/// What one QP was really given (rxe rounds requests up to 2^n - 1).
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpCaps {
    pub max_send_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_wr: u32,
}

/// Where the peer's QP is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteQp {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
}

/// Local addressing shared by all QPs of an engine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalPath {
    pub port: u8,
    pub gid_index: u8,
    pub mtu: u32,
    pub max_rd_atomic: u8,
}

pub(crate) struct RcQp {
    pub qp: ExtendedQueuePair,
    pub qpn: u32,
    pub psn: u32,
    pub caps: QpCaps,
}

impl std::fmt::Debug for RcQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcQp")
            .field("qpn", &self.qpn)
            .field("caps", &self.caps)
            .finish()
    }
}

/// Every op this backend posts. Leaving one out makes rxe leave its `ibv_qp_ex` function
/// pointer NULL, and sideway would call it from safe code (hazard 3).
fn send_ops() -> SendOperationFlags {
    SendOperationFlags::Write | SendOperationFlags::WriteWithImmediate | SendOperationFlags::Read
}

pub(crate) fn qp_access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
}

impl RcQp {
    /// Creates the QP (extended API) and moves it to INIT.
    pub fn create(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<BasicCompletionQueue>,
        recv_cq: &Arc<BasicCompletionQueue>,
        send_wr: u32,
        send_sge: u32,
        recv_wr: u32,
        port: u8,
    ) -> Result<Self, Error> {
        let mut b = pd.create_qp_builder();
        b.setup_max_send_wr(send_wr)
            .setup_max_send_sge(send_sge)
            .setup_max_recv_wr(recv_wr)
            .setup_max_recv_sge(1)
            .setup_send_ops_flags(send_ops())
            .setup_send_cq(Arc::clone(send_cq))
            .setup_recv_cq(Arc::clone(recv_cq));
        let mut qp = b.build_ex().map_err(|e| verr("ibv_create_qp_ex", e))?;
        // The builder reports what we asked for; the device may round up (or down).
        let (_, init) = qp
            .query(QueuePairAttributeMask::Capabilities)
            .map_err(|e| verr("ibv_query_qp(CAP)", e))?;
        let caps = QpCaps {
            max_send_wr: init.max_send_wr().max(1),
            max_send_sge: init.max_send_sge().max(1),
            max_recv_wr: init.max_recv_wr(),
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(port)
            .setup_access_flags(qp_access());
        qp.modify(&attr)
            .map_err(|e| verr("ibv_modify_qp(INIT)", e))?;
        let qpn = qp.qp_number();
        Ok(Self {
            qp,
            qpn,
            psn: random_psn(),
            caps,
        })
    }

    /// INIT -> RTR -> RTS towards `remote`.
    pub fn connect(&mut self, local: &LocalPath, remote: &RemoteQp) -> Result<(), Error> {
        let mtu = mtu_from_bytes(local.mtu.min(remote.mtu));
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(local.max_rd_atomic)
            .setup_min_rnr_timer(1);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid)
            .setup_port(local.port)
            .setup_grh_src_gid_index(local.gid_index)
            .setup_grh_dest_gid(&Gid { raw: remote.gid })
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        self.qp
            .modify(&attr)
            .map_err(|e| verr("ibv_modify_qp(RTR)", e))?;

        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(local.max_rd_atomic);
        self.qp
            .modify(&attr)
            .map_err(|e| verr("ibv_modify_qp(RTS)", e))?;
        Ok(())
    }

    /// The real state (`QueuePair::state()` is a cached field that misses async errors).
    pub fn query_state(&self) -> Option<QueuePairState> {
        self.qp
            .query(QueuePairAttributeMask::State)
            .ok()
            .map(|(a, _)| a.state())
    }

    /// Moves the QP to ERR so its peer sees the connection die and everything is flushed.
    pub fn move_to_error(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        let _ = self.qp.modify(&attr);
    }

    /// Posts `wrs` as one chain with one doorbell (`ibv_wr_start` .. `ibv_wr_complete`).
    /// The extended API is all-or-nothing: on error nothing was posted.
    ///
    /// # Safety
    /// Every SGE must point into memory registered with its lkey that stays valid (and, for
    /// READs, unaliased) until the WR's completion has been polled or the QP is destroyed.
    /// `wrs` is an iterator so that callers build no list of WRs per post.
    pub unsafe fn post_chain<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = WrSpec<'a>>,
    ) -> Result<(), Error> {
        let mut sges: Vec<ibv_sge> = Vec::new();
        let mut g = self.qp.start_post_send();
        for w in wrs {
            let flags = if w.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = g.construct_wr(w.wr_id, flags);
            let lb = match (w.dir, w.imm) {
                (Dir::Write, None) => h.setup_write(w.rkey, w.remote),
                (Dir::Write, Some(imm)) => h.setup_write_imm(w.rkey, w.remote, imm),
                (Dir::Read, _) => h.setup_read(w.rkey, w.remote),
            };
            if let [s] = w.sges {
                // SAFETY: the caller guarantees the SGE's memory is registered under `lkey`
                // and outlives the WR (this fn's contract).
                unsafe { lb.setup_sge(s.lkey, s.addr, s.len) };
            } else {
                // Only equal-length lists reach here (plan.rs), the only shape rxe v44's
                // `wr_set_sge_list` handles; an empty list is a zero-length WRITE_WITH_IMM.
                sges.clear();
                sges.extend(w.sges.iter().map(|s| ibv_sge {
                    addr: s.addr,
                    length: s.len,
                    lkey: s.lkey,
                }));
                // SAFETY: as above for every entry; `sges` is only read during the call
                // (the provider copies the list into the WQE).
                unsafe { lb.setup_sge_list(&sges) };
            }
        }
        g.post().map_err(|e| verr("ibv_wr_complete", e))
    }

    /// Posts `n` SGE-less RECVs (they only absorb WRITE_WITH_IMM immediates).
    pub fn post_recvs(&mut self, ids: impl Iterator<Item = u64>) -> Result<(), Error> {
        let mut g = self.qp.start_post_recv();
        for id in ids {
            g.construct_wr(id);
        }
        g.post().map_err(|e| verr("ibv_post_recv", e))
    }
}

/// One WR of a chain.
#[derive(Debug)]
pub(crate) struct WrSpec<'a> {
    pub wr_id: u64,
    pub signaled: bool,
    pub dir: Dir,
    pub remote: u64,
    pub rkey: u32,
    pub sges: &'a [Sge],
    pub imm: Option<u32>,
}

/// A polled work completion (copied out of the CQ).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: u32,
    pub vendor_err: u32,
}

/// Completions taken from a CQ per `ibv_poll_cq` call.
pub(crate) const POLL_BATCH: usize = 16;

/// Polls up to [`POLL_BATCH`] completions from a basic CQ into `out` with one
/// `ibv_poll_cq` and no allocation (sideway's `start_poll` allocates a vector per call,
/// and callers now poll on every spin of a wait). Basic, never extended: draining an
/// extended CQ with sideway's iterator corrupts it on rdma-core 44 (hazard 1).
pub(crate) fn poll_cq(
    cq: &BasicCompletionQueue,
    out: &mut [Wc; POLL_BATCH],
) -> Result<usize, Error> {
    let mut raw = [std::mem::MaybeUninit::<ibv_wc>::uninit(); POLL_BATCH];
    // SAFETY: `cq.cq()` is the live `ibv_cq` owned by `cq`, which is borrowed for the whole
    // call; `raw` has room for POLL_BATCH entries and the provider writes at most
    // `num_entries` of them. ibv_poll_cq is thread-safe per CQ (the provider locks it).
    let n = unsafe {
        rdma_mummy_sys::ibv_poll_cq(
            cq.cq().as_ptr(),
            POLL_BATCH as i32,
            raw.as_mut_ptr().cast::<ibv_wc>(),
        )
    };
    if n < 0 {
        return Err(verr("ibv_poll_cq", std::io::Error::from_raw_os_error(-n)));
    }
    let n = (n as usize).min(POLL_BATCH);
    for (o, r) in out.iter_mut().zip(&raw[..n]) {
        // SAFETY: the provider initialised the first `n` entries (its return value).
        let w = unsafe { r.assume_init_ref() };
        *o = Wc {
            wr_id: w.wr_id,
            status: w.status,
            opcode: w.opcode,
            byte_len: w.byte_len,
            // SAFETY: every bit pattern of the union is a valid u32; the value only
            // means something for WITH_IMM completions, which is where it is read.
            imm: unsafe { w.imm_data_invalidated_rkey_union.imm_data },
            vendor_err: w.vendor_err,
        };
    }
    Ok(n)
}

/// `IBV_WC_*` status names, as perftest and the kernel print them.
pub(crate) fn wc_status_name(status: u32) -> &'static str {
    match status {
        0 => "SUCCESS",
        1 => "LOC_LEN_ERR",
        2 => "LOC_QP_OP_ERR",
        3 => "LOC_EEC_OP_ERR",
        4 => "LOC_PROT_ERR",
        5 => "WR_FLUSH_ERR",
        6 => "MW_BIND_ERR",
        7 => "BAD_RESP_ERR",
        8 => "LOC_ACCESS_ERR",
        9 => "REM_INV_REQ_ERR",
        10 => "REM_ACCESS_ERR",
        11 => "REM_OP_ERR",
        12 => "RETRY_EXC_ERR",
        13 => "RNR_RETRY_EXC_ERR",
        14 => "LOC_RDD_VIOL_ERR",
        15 => "REM_INV_RD_REQ_ERR",
        16 => "REM_ABORT_ERR",
        17 => "INV_EECN_ERR",
        18 => "INV_EEC_STATE_ERR",
        19 => "FATAL_ERR",
        20 => "RESP_TIMEOUT_ERR",
        21 => "GENERAL_ERR",
        22 => "TM_ERR",
        23 => "TM_RNDV_INCOMPLETE",
        _ => "UNKNOWN",
    }
}

/// `IBV_WC_RECV_RDMA_WITH_IMM`.
pub(crate) const WC_RECV_RDMA_WITH_IMM: u32 = 129;
/// `IBV_WC_SUCCESS`.
pub(crate) const WC_SUCCESS: u32 = 0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names() {
        assert_eq!(wc_status_name(10), "REM_ACCESS_ERR");
        assert_eq!(wc_status_name(5), "WR_FLUSH_ERR");
        assert_eq!(wc_status_name(99), "UNKNOWN");
    }

    #[test]
    fn psn_is_24_bit() {
        for _ in 0..100 {
            assert!(random_psn() < (1 << 24));
        }
    }
}
