//! The floor under `pagewire bench lat`: ib_write_lat's loop written directly on sideway,
//! without the engine. Each side spins on the last byte of its landing buffer, posts one
//! signalled 2 B RDMA WRITE with the extended QP API (as the engine does) and polls its
//! CQ for that WRITE's completion; latency is half the time between consecutive posts,
//! as perftest computes it. It exists to tell how much of a gap to perftest is Rust and
//! sideway, and how much is the engine (docs/benchmarks.md).
//!
//! With `--imm` each WRITE carries an immediate (WRITE_WITH_IMM) and the receiver waits for
//! the RECV completion instead of spinning on memory: what `bench lat` does without
//! `--poll-memory` (the engine's notification), minus the engine.
//!
//! ```text
//! raw_verbs_lat --server [--imm] [-d DEV] [-x GID_INDEX] [-p PORT] [-n ITERS]   # one end
//! raw_verbs_lat HOST     [--imm] [-d DEV] [-x GID_INDEX] [-p PORT] [-n ITERS]   # the other
//! ```
//!
//! The QP numbers, PSNs, GIDs, addresses and rkeys are exchanged over TCP. Needs an RDMA
//! device (the soft-RoCE VM: `scripts/rdma-vm.sh run -- target/release/examples/...`).
//! Raw verbs on purpose: unlike the library, whose FFI sits in `backend::verbs`, this
//! tool calls `ibv_poll_cq` itself so that nothing stands between the loop and the device.

#[cfg(not(feature = "verbs"))]
fn main() {
    eprintln!("raw_verbs_lat needs the `verbs` feature");
    std::process::exit(2);
}

#[cfg(feature = "verbs")]
fn main() -> anyhow::Result<()> {
    raw::main()
}

#[cfg(feature = "verbs")]
mod raw {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::time::{Duration, Instant};

    use anyhow::{Context, bail, ensure};
    use rdma_mummy_sys::ibv_wc;
    use sideway::ibverbs::AccessFlags;
    use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
    use sideway::ibverbs::completion::CompletionQueue as _;
    use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
    use sideway::ibverbs::device_context::Mtu;
    use sideway::ibverbs::queue_pair::{
        PostSendGuard as _, QueuePair as _, QueuePairAttribute, QueuePairState,
        SetScatterGatherEntry as _, WorkRequestFlags,
    };

    const SIZE: usize = 2;
    const HALF: usize = 4096;
    /// RECVs kept posted in `--imm` mode (one is reposted per notification).
    const RECVS: u32 = 64;
    /// `IBV_WC_RECV_RDMA_WITH_IMM`.
    const WC_RECV_RDMA_WITH_IMM: u32 = 129;

    struct Args {
        host: Option<String>,
        dev: Option<String>,
        gid_index: u8,
        port: u16,
        iters: usize,
        imm: bool,
    }

    fn args() -> anyhow::Result<Args> {
        let mut a = Args {
            host: None,
            dev: None,
            gid_index: 0,
            port: 18516,
            iters: 1000,
            imm: false,
        };
        let mut it = std::env::args().skip(1);
        let mut server = false;
        while let Some(x) = it.next() {
            let mut val = || it.next().with_context(|| format!("{x} needs a value"));
            match x.as_str() {
                "--server" => server = true,
                "--imm" => a.imm = true,
                "-d" => a.dev = Some(val()?),
                "-x" => a.gid_index = val()?.parse()?,
                "-p" => a.port = val()?.parse()?,
                "-n" => a.iters = val()?.parse()?,
                h if !h.starts_with('-') => a.host = Some(h.to_string()),
                _ => bail!("unknown argument {x}"),
            }
        }
        ensure!(server != a.host.is_some(), "give --server or a HOST");
        ensure!(a.iters >= 2, "-n must be at least 2");
        Ok(a)
    }

    fn attr_access() -> AccessFlags {
        AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
    }

    pub fn main() -> anyhow::Result<()> {
        let a = args()?;
        let list = DeviceList::new().context("no RDMA devices")?;
        let dev = list
            .iter()
            .find(|d| a.dev.as_deref().is_none_or(|n| d.name() == n))
            .context("RDMA device not found")?;
        let ctx = dev.open()?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq_builder().setup_cqe(64).build()?;
        let gid = ctx
            .query_gid_table()?
            .iter()
            .find(|e| e.gid_index() == u32::from(a.gid_index) && e.port_num() == 1)
            .context("no such GID index on port 1")?
            .gid()
            .raw;

        // Lower half: what this side sends; upper half: where the peer's WRITE lands.
        let buf: &'static mut [u8] = Box::leak(vec![0u8; 2 * HALF].into_boxed_slice());
        let addr = buf.as_mut_ptr() as u64;
        // SAFETY: `buf` is leaked, so the range stays mapped for the rest of the process,
        // which outlives the MR.
        let mr = unsafe { pd.reg_mr(addr as usize, buf.len(), attr_access())? };
        let mut b = pd.create_qp_builder();
        b.setup_max_send_wr(16)
            .setup_max_send_sge(1)
            .setup_max_recv_wr(RECVS)
            .setup_max_recv_sge(1)
            .setup_send_cq(Arc::clone(&cq))
            .setup_recv_cq(Arc::clone(&cq));
        let mut qp = b.build_ex()?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(attr_access());
        qp.modify(&attr)?;
        if a.imm {
            let mut g = qp.start_post_recv();
            for id in 0..u64::from(RECVS) {
                g.construct_wr(id);
            }
            g.post()?;
        }

        let psn = 0x1234u32;
        let mut mine = Vec::with_capacity(36);
        mine.extend(qp.qp_number().to_le_bytes());
        mine.extend(psn.to_le_bytes());
        mine.extend(gid);
        mine.extend(addr.to_le_bytes());
        mine.extend(mr.rkey().to_le_bytes());
        let mut s = match &a.host {
            None => TcpListener::bind(("0.0.0.0", a.port))?.accept()?.0,
            Some(h) => TcpStream::connect((h.as_str(), a.port))?,
        };
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.write_all(&mine)?;
        let mut theirs = [0u8; 36];
        s.read_exact(&mut theirs)?;
        let u32_at = |o: usize| u32::from_le_bytes(theirs[o..o + 4].try_into().expect("4 B"));
        let (rqpn, rpsn, rkey) = (u32_at(0), u32_at(4), u32_at(32));
        let rgid: [u8; 16] = theirs[8..24].try_into()?;
        let raddr = u64::from_le_bytes(theirs[24..32].try_into()?);

        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu1024)
            .setup_dest_qp_num(rqpn)
            .setup_rq_psn(rpsn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(1);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0)
            .setup_port(1)
            .setup_grh_src_gid_index(a.gid_index)
            .setup_grh_dest_gid(&Gid { raw: rgid })
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        qp.modify(&attr)?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(1);
        qp.modify(&attr)?;
        s.write_all(&[1])?;
        s.read_exact(&mut [0u8; 1])?;

        // SAFETY: both offsets are inside the leaked buffer; `AtomicU8` has `u8`'s layout
        // and every bit pattern is valid, so loads see some value the NIC or this thread
        // wrote, and the spin is not hoisted out of its loop.
        let (landing, sending) = unsafe {
            (
                AtomicU8::from_ptr(buf.as_mut_ptr().add(HALF + SIZE - 1)),
                AtomicU8::from_ptr(buf.as_mut_ptr().add(SIZE - 1)),
            )
        };
        // SAFETY: the CQ lives in `cq` for the whole loop below.
        let cqp = unsafe { cq.cq().as_ptr() };
        let lkey = mr.lkey();
        let server = a.host.is_none();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut posted = Vec::with_capacity(a.iters);
        let start = Instant::now();
        // Iteration i's ping (client) and pong (server) both carry mark(i) in their last byte.
        let mark = |i: usize| (i % 255) as u8 + 1;
        // Completions seen: sends (our WRITEs) and, with --imm, RECVs (the peer's).
        let (mut sends, mut recvs) = (0usize, 0usize);
        let poll = |qp: &mut sideway::ibverbs::queue_pair::ExtendedQueuePair,
                    sends: &mut usize,
                    recvs: &mut usize|
         -> anyhow::Result<()> {
            let mut wc = std::mem::MaybeUninit::<ibv_wc>::uninit();
            // SAFETY: `cqp` is the live CQ; `wc` has room for the one entry asked for.
            let n = unsafe { rdma_mummy_sys::ibv_poll_cq(cqp, 1, wc.as_mut_ptr()) };
            ensure!(n >= 0, "ibv_poll_cq failed: {n}");
            if n == 1 {
                // SAFETY: the provider wrote the entry it reported.
                let w = unsafe { wc.assume_init_ref() };
                ensure!(w.status == 0, "work completion status {}", w.status);
                if w.opcode == WC_RECV_RDMA_WITH_IMM {
                    *recvs += 1;
                    let mut g = qp.start_post_recv();
                    g.construct_wr(w.wr_id);
                    g.post()?;
                } else {
                    *sends += 1;
                }
            }
            ensure!(
                Instant::now() < deadline || n == 1,
                "no completion within 60 s"
            );
            Ok(())
        };
        for i in 1..=a.iters {
            if server || i > 1 {
                // The peer's ping (server) or the pong to our previous ping (client).
                let want = if server { mark(i) } else { mark(i - 1) };
                if a.imm {
                    let seen = if server { i } else { i - 1 };
                    while recvs < seen {
                        poll(&mut qp, &mut sends, &mut recvs)?;
                    }
                } else {
                    let mut spins = 0u32;
                    while landing.load(Ordering::Acquire) != want {
                        spins = spins.wrapping_add(1);
                        if spins.is_multiple_of(1 << 20) && Instant::now() > deadline {
                            bail!("iteration {i}: the peer's write never landed");
                        }
                    }
                }
            }
            sending.store(mark(i), Ordering::Release);
            posted.push(start.elapsed().as_nanos() as u64);
            let mut g = qp.start_post_send();
            let h = g.construct_wr(i as u64, WorkRequestFlags::Signaled);
            let w = if a.imm {
                h.setup_write_imm(rkey, raddr + HALF as u64, i as u32)
            } else {
                h.setup_write(rkey, raddr + HALF as u64)
            };
            // SAFETY: the SGE is inside `buf`, registered as `mr` (lkey), which outlives
            // the WR: its completion is polled right below.
            unsafe { w.setup_sge(lkey, addr, SIZE as u32) };
            g.post()?;
            while sends < i {
                poll(&mut qp, &mut sends, &mut recvs)?;
            }
        }
        if !server {
            // Wait for the last pong before reporting.
            if a.imm {
                while recvs < a.iters {
                    poll(&mut qp, &mut sends, &mut recvs)?;
                }
            }
            while landing.load(Ordering::Acquire) != mark(a.iters) {
                ensure!(Instant::now() < deadline, "the last pong never landed");
            }
            // perftest's columns and definitions: half of each post-to-post interval;
            // typical is the median, percentiles by nearest rank.
            let mut d: Vec<f64> = posted
                .windows(2)
                .map(|w| (w[1] - w[0]) as f64 / 2000.0)
                .collect();
            d.sort_by(f64::total_cmp);
            let n = d.len() as f64;
            let avg = d.iter().sum::<f64>() / n;
            let sd = (d.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n).sqrt();
            let rank = |q: f64| d[((n * q).ceil() as usize).clamp(1, d.len()) - 1];
            println!(
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
            );
            println!(
                " {SIZE:<6} {:<10}  {:<14.2} {:<12.2} {:<16.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                a.iters,
                d[0],
                d[d.len() - 1],
                rank(0.5),
                avg,
                sd,
                rank(0.99),
                rank(0.999)
            );
        }
        s.write_all(&[2])?;
        let _ = s.read(&mut [0u8; 1]);
        Ok(())
    }
}
