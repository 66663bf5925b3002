//! Transfers: Mooncake's batch ids with per-task status (`allocateBatchID`,
//! `submitTransfer`, `getTransferStatus`, `freeBatchID`), and the Python binding's
//! calls built on them (`transfer_sync*`, `batch_transfer_async*`,
//! `transfer_check_status`, `get_batch_transfer_status`).
//!
//! Every request of a call is checked before anything is posted: the local range inside
//! one buffer registered through this engine, the remote range inside what the target
//! segment exposes for the operation (asking the peer again once if not, since it may
//! have registered more). A refused call moves nothing and adds no task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pagewire_transport::{
    Access, Batch, BatchStatus, Op, RemoteRegion, TransferHandle, TransferOp,
};

use crate::code::{Code, Error, fail};
use crate::engine::TransferEngine;
use crate::lock;
use crate::segments::{Target, remote_covered};

/// Largest batch capacity `allocateBatchID` accepts.
pub const MAX_BATCH_SIZE: usize = 1 << 20;
/// Most live batch ids of one engine.
const MAX_BATCHES: usize = 1 << 20;
/// How long a submit with a notification waits for a free outbox slot.
const SLOT_WAIT: Duration = Duration::from_secs(1);
/// Longest wait of a standalone notification (`genNotifyInEngine`).
const NOTIFY_WAIT: Duration = Duration::from_secs(5);

/// Mooncake's `OPCODE_READ` / `OPCODE_WRITE` (and the Python `TransferOpcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Opcode {
    /// Remote to local.
    Read = 0,
    /// Local to remote.
    Write = 1,
}

impl TryFrom<i64> for Opcode {
    type Error = Error;
    fn try_from(v: i64) -> Result<Opcode, Error> {
        match v {
            0 => Ok(Opcode::Read),
            1 => Ok(Opcode::Write),
            _ => fail(
                Code::InvalidArgument,
                format!("opcode {v} is neither READ (0) nor WRITE (1)"),
            ),
        }
    }
}

impl Opcode {
    fn remote_access(self) -> Access {
        match self {
            Opcode::Read => Access::REMOTE_READ,
            Opcode::Write => Access::REMOTE_WRITE,
        }
    }
}

/// One request (`struct transfer_request`).
#[derive(Debug, Clone, Copy)]
pub struct Request {
    /// Direction.
    pub opcode: Opcode,
    /// Local address, inside memory registered on this engine.
    pub source: u64,
    /// The segment (from [`TransferEngine::open_segment`], or `LOCAL_SEGMENT`).
    pub target_id: i32,
    /// Remote address: the peer's virtual address, as Mooncake uses it.
    pub target_offset: u64,
    /// Bytes.
    pub length: u64,
}

/// One call of the Python binding: `lens[i]` bytes between local `locals[i]` and the
/// peer's `remotes[i]`, on the engine named `session` (`host:port`).
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// The peer engine's segment name.
    pub session: &'a str,
    /// Direction.
    pub opcode: Opcode,
    /// Local addresses, inside memory registered on this engine.
    pub locals: &'a [u64],
    /// The peer's addresses.
    pub remotes: &'a [u64],
    /// Bytes of each range.
    pub lens: &'a [u64],
}

impl<'a> Transfer<'a> {
    /// WRITEs of `lens[i]` bytes from `locals[i]` to the peer's `remotes[i]`.
    pub fn write(session: &'a str, locals: &'a [u64], remotes: &'a [u64], lens: &'a [u64]) -> Self {
        Transfer {
            session,
            opcode: Opcode::Write,
            locals,
            remotes,
            lens,
        }
    }

    /// READs of `lens[i]` bytes from the peer's `remotes[i]` into `locals[i]`.
    pub fn read(session: &'a str, locals: &'a [u64], remotes: &'a [u64], lens: &'a [u64]) -> Self {
        Transfer {
            opcode: Opcode::Read,
            ..Transfer::write(session, locals, remotes, lens)
        }
    }

    /// The three lists have one length.
    fn check_lists(&self) -> Result<(), Error> {
        let (a, b, c) = (self.locals.len(), self.remotes.len(), self.lens.len());
        if a != b || a != c {
            return fail(
                Code::InvalidArgument,
                format!(
                    "buffers, peer_buffer_addresses and lengths differ in length ({a}, {b}, {c})"
                ),
            );
        }
        Ok(())
    }

    /// Its non-empty requests to segment `target`, with their index.
    fn requests(&self, target: i32) -> impl Iterator<Item = (usize, Request)> + '_ {
        (0..self.lens.len())
            .filter(|&i| self.lens[i] > 0)
            .map(move |i| {
                let r = Request {
                    opcode: self.opcode,
                    source: self.locals[i],
                    target_id: target,
                    target_offset: self.remotes[i],
                    length: self.lens[i],
                };
                (i, r)
            })
    }
}

impl Request {
    /// The transport's op for it.
    fn op(&self) -> TransferOp {
        TransferOp {
            op: match self.opcode {
                Opcode::Read => Op::Read,
                Opcode::Write => Op::Write,
            },
            local: self.source,
            remote: self.target_offset,
            len: self.length,
        }
    }
}

/// Mooncake's `STATUS_*` of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum TransferStatus {
    /// `STATUS_WAITING`: posted, not finished.
    Waiting = 0,
    /// `STATUS_PENDING`.
    Pending = 1,
    /// `STATUS_INVALID`.
    Invalid = 2,
    /// `STATUS_CANCELED`.
    Canceled = 3,
    /// `STATUS_COMPLETED`.
    Completed = 4,
    /// `STATUS_TIMEOUT`: the batch's deadline passed.
    Timeout = 5,
    /// `STATUS_FAILED`.
    Failed = 6,
}

/// A task's status and the bytes it moved (its length once completed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskStatus {
    /// The state.
    pub status: TransferStatus,
    /// Bytes moved.
    pub transferred_bytes: u64,
}

/// `transfer_check_status` of the Python binding: 1, 0, -1, -2 there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchCheck {
    /// Every request completed; the id is collected.
    Completed,
    /// Still running; ask again.
    Running,
    /// A request failed (or the id is unknown or already collected).
    Failed,
    /// A request ran past the deadline; the id is collected.
    Timeout,
}

/// Index of the task's transport batch in [`BatchEntry::subs`]; `NONE` for a
/// zero-length task, which is complete from the start.
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Task {
    sub: u32,
    len: u64,
}

#[derive(Debug)]
struct BatchEntry {
    capacity: usize,
    tasks: Vec<Task>,
    subs: Vec<TransferHandle>,
}

impl BatchEntry {
    /// The batch as a whole: running while any transport batch is.
    fn check(&self) -> BatchCheck {
        let mut out = BatchCheck::Completed;
        for h in &self.subs {
            match h.status() {
                BatchStatus::Pending => return BatchCheck::Running,
                BatchStatus::Done => {}
                BatchStatus::Failed(pagewire_transport::Error::Timeout { .. }) => {
                    if out == BatchCheck::Completed {
                        out = BatchCheck::Timeout;
                    }
                }
                _ => out = BatchCheck::Failed,
            }
        }
        out
    }
}

/// Live batch ids: `tag:16 | sequence:48`, the tag per engine (another engine's ids are
/// refused), the sequence never reused (a freed id stays dead). Never 0 (the Python
/// binding's failure value) nor `INVALID_BATCH` (`u64::MAX`).
#[derive(Debug)]
pub(crate) struct Batches {
    tag: u64,
    next: u64,
    live: HashMap<u64, Arc<Mutex<BatchEntry>>>,
}

impl Batches {
    pub(crate) fn new(tag: u16) -> Batches {
        Batches {
            tag: u64::from(tag.min(0xfffe)) << 48,
            next: 1,
            live: HashMap::new(),
        }
    }

    fn insert(&mut self, capacity: usize) -> Result<u64, Error> {
        if self.live.len() >= MAX_BATCHES || self.next >= 1 << 48 {
            return fail(
                Code::TooManyRequests,
                format!("{MAX_BATCHES} batch ids are live (free them with freeBatchID)"),
            );
        }
        let id = self.tag | self.next;
        self.next += 1;
        let entry = BatchEntry {
            capacity,
            tasks: Vec::new(),
            subs: Vec::new(),
        };
        self.live.insert(id, Arc::new(Mutex::new(entry)));
        Ok(id)
    }

    pub(crate) fn clear(&mut self) {
        self.live.clear();
    }
}

/// The remote checks of one call, remembering the last region that held a whole request.
#[derive(Default)]
struct RemoteFit {
    last: Option<RemoteRegion>,
}

impl RemoteFit {
    /// Whether `e`'s remote range lies in `regions` (sorted) with the access it needs.
    fn fits(&mut self, regions: &[RemoteRegion], e: &Request) -> bool {
        let (addr, len, need) = (e.target_offset, e.length, e.opcode.remote_access());
        let end = addr.saturating_add(len);
        let inside = |r: &RemoteRegion| r.addr <= addr && end <= r.end() && r.access.contains(need);
        if self.last.as_ref().is_some_and(inside) {
            return true;
        }
        let i = regions.partition_point(|r| r.end() <= addr);
        match regions.get(i) {
            Some(r) if inside(r) => {
                self.last = Some(*r);
                true
            }
            _ => remote_covered(regions, addr, len, need),
        }
    }
}

/// The checked part of a call, ready to post: one transport batch per target segment.
struct Group {
    target: Target,
    /// Indices into the call's requests.
    idx: Vec<usize>,
}

impl TransferEngine {
    // ------------------------------------------------------------------ checks

    /// `[start, end)` of the buffer registered through this engine that holds all of
    /// `[addr, addr+len)`, if one does.
    fn local_buffer(regions: &crate::engine::Regions, addr: u64, len: u64) -> Option<(u64, u64)> {
        let end = addr.checked_add(len)?;
        let (&a, r) = regions.range(..=addr).next_back()?;
        (r.id.is_some() && a + r.len >= end).then_some((a, a + r.len))
    }

    /// Checks requests to `target` (`reqs` gives them, `(index, request)`, as often as
    /// needed): a source and no overflow, local ranges inside one buffer registered
    /// through this engine, remote ranges exposed for the operation (asking the peer
    /// again once if not). A bad local range fails before the peer is asked. Returns
    /// the target as last described.
    fn check_target<I>(&self, mut target: Target, reqs: impl Fn() -> I) -> Result<Target, Error>
    where
        I: Iterator<Item = (usize, Request)>,
    {
        let mut misfit = None;
        {
            let regions = lock(&self.inner.regions);
            // The buffers the last request fell in: a batch's requests are mostly pages
            // of one pool on each side, so most need no lookup.
            let mut local = (0u64, 0u64);
            let mut remote = RemoteFit::default();
            for (i, e) in reqs() {
                Self::precheck(i, &e)?;
                let end = e.source + e.length;
                if e.source < local.0 || end > local.1 {
                    local = Self::local_buffer(&regions, e.source, e.length).ok_or_else(|| {
                        Error::new(
                            Code::AddressNotRegistered,
                            format!(
                                "request {i}: local range {:#x}+{} is not inside one registered buffer",
                                e.source, e.length
                            ),
                        )
                    })?;
                }
                if misfit.is_none() && !remote.fits(&target.regions, &e) {
                    misfit = Some(i);
                }
            }
        }
        if misfit.is_some() {
            target = self.refresh_for_submit(&target)?;
            let mut remote = RemoteFit::default();
            if let Some((i, e)) = reqs().find(|(_, e)| !remote.fits(&target.regions, e)) {
                let what = match e.opcode {
                    Opcode::Write => "writes",
                    Opcode::Read => "reads",
                };
                return fail(
                    Code::AddressNotRegistered,
                    format!(
                        "request {i}: remote range {:#x}+{} is outside the buffers segment {} registered for remote {what}",
                        e.target_offset, e.length, target.id,
                    ),
                );
            }
        }
        Ok(target)
    }

    /// What needs no lookup: a source, no overflow.
    fn precheck(i: usize, e: &Request) -> Result<(), Error> {
        if e.source == 0 {
            return fail(Code::InvalidArgument, format!("request {i}: null source"));
        }
        if e.source.checked_add(e.length).is_none()
            || e.target_offset.checked_add(e.length).is_none()
        {
            return fail(
                Code::InvalidArgument,
                format!("request {i}: address + length {} overflows", e.length),
            );
        }
        Ok(())
    }

    /// Checks what needs no lookup (null source, overflow) and groups the requests by
    /// target, in order of first appearance (zero-length requests are in no group).
    fn group(entries: &[Request]) -> Result<Vec<(i32, Vec<usize>)>, Error> {
        let mut groups: Vec<(i32, Vec<usize>)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if e.length == 0 {
                continue;
            }
            Self::precheck(i, e)?;
            match groups.iter_mut().find(|g| g.0 == e.target_id) {
                Some(g) => g.1.push(i),
                None => groups.push((e.target_id, vec![i])),
            }
        }
        Ok(groups)
    }

    /// Checks every group against its segment (see [`Self::check_target`]). `open` is
    /// the target already opened by name, if the caller did.
    fn check_groups(
        &self,
        groups: Vec<(i32, Vec<usize>)>,
        entries: &[Request],
        open: Option<&Target>,
    ) -> Result<Vec<Group>, Error> {
        let mut out = Vec::with_capacity(groups.len());
        for (id, idx) in groups {
            let target = match open {
                Some(t) if t.id == id => t.clone(),
                _ => self.segment(id)?,
            };
            let target = self.check_target(target, || idx.iter().map(|&i| (i, entries[i])))?;
            out.push(Group { target, idx });
        }
        Ok(out)
    }

    fn batch_of(entries: &[Request], idx: &[usize]) -> Batch {
        let mut b = Batch::with_capacity(idx.len());
        for &i in idx {
            b.push(entries[i].op());
        }
        b
    }

    // ------------------------------------------------------------------ batch ids

    /// `allocateBatchID`: an id with room for `capacity` requests (1 to
    /// [`MAX_BATCH_SIZE`]).
    pub fn allocate_batch(&self, capacity: usize) -> Result<u64, Error> {
        if capacity == 0 || capacity > MAX_BATCH_SIZE {
            return fail(
                Code::InvalidArgument,
                format!("batch_size {capacity} is not in 1..={MAX_BATCH_SIZE}"),
            );
        }
        lock(&self.inner.batches).insert(capacity)
    }

    fn batch(&self, id: u64) -> Result<Arc<Mutex<BatchEntry>>, Error> {
        match lock(&self.inner.batches).live.get(&id) {
            Some(b) => Ok(b.clone()),
            None => fail(
                Code::InvalidArgument,
                format!("unknown or freed batch id {id:#x}"),
            ),
        }
    }

    /// `freeBatchID`: refused with [`Code::BatchBusy`] while a task is pending; the id
    /// is dead afterwards.
    pub fn free_batch(&self, id: u64) -> Result<(), Error> {
        let b = self.batch(id)?;
        let busy = lock(&b)
            .subs
            .iter()
            .any(|h| matches!(h.status(), BatchStatus::Pending));
        if busy {
            return fail(Code::BatchBusy, format!("batch {id:#x} has pending tasks"));
        }
        lock(&self.inner.batches).live.remove(&id);
        Ok(())
    }

    /// `getTransferStatus` of task `task` (the index of a request among all submitted
    /// to the batch). Never blocks.
    pub fn task_status(&self, id: u64, task: usize) -> Result<TaskStatus, Error> {
        let b = self.batch(id)?;
        let b = lock(&b);
        let Some(&t) = b.tasks.get(task) else {
            return fail(
                Code::InvalidArgument,
                format!("task {task} not in the batch ({} tasks)", b.tasks.len()),
            );
        };
        let status = if t.sub == NONE {
            TransferStatus::Completed
        } else {
            match b.subs[t.sub as usize].status() {
                BatchStatus::Pending => TransferStatus::Waiting,
                BatchStatus::Done => TransferStatus::Completed,
                BatchStatus::Cancelled => TransferStatus::Canceled,
                BatchStatus::Failed(pagewire_transport::Error::Timeout { .. }) => {
                    TransferStatus::Timeout
                }
                _ => TransferStatus::Failed,
            }
        };
        let transferred_bytes = if status == TransferStatus::Completed {
            t.len
        } else {
            0
        };
        Ok(TaskStatus {
            status,
            transferred_bytes,
        })
    }

    /// `submitTransfer` / `submitTransferWithNotify`: posts `entries` into the batch,
    /// one transport batch per target segment, each with the engine's batch deadline.
    /// Every request is checked first; on error nothing moves and the batch is unchanged.
    /// A notification follows the data of one segment: every request must target it
    /// (Mooncake sends it to the first request's target); it waits up to a second for a
    /// free outbox slot.
    pub fn submit(
        &self,
        batch_id: u64,
        entries: &[Request],
        notify: Option<(&[u8], &[u8])>,
    ) -> Result<(), Error> {
        let timeout = self.transport().config().batch_timeout;
        self.submit_into(batch_id, entries, notify, None, timeout)
    }

    fn submit_into(
        &self,
        batch_id: u64,
        entries: &[Request],
        notify: Option<(&[u8], &[u8])>,
        open: Option<&Target>,
        timeout: Duration,
    ) -> Result<(), Error> {
        let b = self.batch(batch_id)?;
        let mut b = lock(&b);
        if b.tasks.len().saturating_add(entries.len()) > b.capacity {
            return fail(
                Code::TooManyRequests,
                format!(
                    "{} requests over the batch's capacity ({} of {} used)",
                    entries.len(),
                    b.tasks.len(),
                    b.capacity
                ),
            );
        }
        let Some(first) = entries.first() else {
            // Mooncake refuses a notification with nothing to carry it.
            return match notify {
                Some(_) => fail(
                    Code::InvalidArgument,
                    "a notification needs at least one request",
                ),
                None => Ok(()),
            };
        };
        let groups = Self::group(entries)?;
        let notify_target = first.target_id;
        if notify.is_some()
            && (groups.len() > 1 || groups.first().is_some_and(|g| g.0 != notify_target))
        {
            return fail(
                Code::InvalidArgument,
                "a notification follows the data of one segment: every request must target it",
            );
        }
        let groups = self.check_groups(groups, entries, open)?;
        if groups.is_empty() {
            // Only zero-length requests: a notification goes alone.
            if let Some((name, msg)) = notify {
                let peer = self.segment(notify_target)?.peer;
                let deadline = Instant::now() + timeout;
                self.inner
                    .mailbox
                    .send(self.transport(), peer, name, msg, deadline)?;
            }
            b.tasks
                .extend(entries.iter().map(|_| Task { sub: NONE, len: 0 }));
            return Ok(());
        }
        let staged = match notify {
            Some((name, msg)) => Some(self.inner.mailbox.stage(
                self.transport(),
                groups[0].target.peer,
                name,
                msg,
                Instant::now() + SLOT_WAIT,
            )?),
            None => None,
        };
        let first_sub = b.subs.len();
        let mut posted: Vec<TransferHandle> = Vec::with_capacity(groups.len());
        let mut sub_of = vec![NONE; entries.len()];
        for (g, group) in groups.iter().enumerate() {
            let mut batch = Self::batch_of(entries, &group.idx).timeout(timeout);
            for &i in &group.idx {
                sub_of[i] = (first_sub + g) as u32;
            }
            if let Some(s) = staged {
                batch = batch.notify(s.tag());
            }
            match self.transport().submit(group.target.peer, batch) {
                Ok(h) => {
                    if let Some(s) = staged {
                        self.inner.mailbox.attach(s, h.clone());
                    }
                    posted.push(h);
                }
                Err(e) => {
                    // Only reachable when the state changed since the checks (a peer went
                    // away): take back what was posted.
                    for h in &posted {
                        h.cancel();
                    }
                    if let Some(s) = staged {
                        self.inner.mailbox.release(s);
                    }
                    return Err(Error::transport(
                        &format!("posting to segment {}", group.target.id),
                        e,
                    ));
                }
            }
        }
        b.subs.extend(posted);
        b.tasks.extend(
            entries
                .iter()
                .zip(&sub_of)
                .map(|(e, &sub)| Task { sub, len: e.length }),
        );
        Ok(())
    }

    // ------------------------------------------------------------------ notifications

    /// `genNotifyInEngine`: a notification alone to segment `target`, waited for until
    /// the peer's engine has it (at most the batch deadline, and 5 s).
    pub fn notify(&self, target: i32, name: &[u8], msg: &[u8]) -> Result<(), Error> {
        let peer = self.segment(target)?.peer;
        let wait = self.transport().config().batch_timeout.min(NOTIFY_WAIT);
        self.inner
            .mailbox
            .send(self.transport(), peer, name, msg, Instant::now() + wait)
    }

    /// `getNotifsFromEngine` / `get_notifies`: every notification received since the
    /// last call, `(name, msg)`, each once, in arrival order.
    pub fn take_notifications(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.inner.mailbox.drain()
    }

    // ------------------------------------------------------------------ Python binding

    /// Mooncake's deadline for a Python binding transfer: `MC_TRANSFER_TIMEOUT` plus
    /// 1 ns per byte.
    fn binding_timeout(&self, lens: &[u64]) -> Duration {
        let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
        self.inner.transfer_timeout + Duration::from_nanos(total)
    }

    /// `transfer_sync*` / `batch_transfer_sync*`: moves the ranges of `t`, optionally
    /// followed by a notification, and waits until done or
    /// until Mooncake's deadline (`MC_TRANSFER_TIMEOUT` plus 1 ns per byte). Empty lists
    /// move nothing (a notification then goes alone). On failure the call's batch is
    /// cancelled: nothing more of it is handed to the network, and a refused call (any
    /// range outside registered or exposed memory) moved nothing at all.
    pub fn transfer_sync(
        &self,
        t: &Transfer<'_>,
        notify: Option<(&[u8], &[u8])>,
    ) -> Result<(), Error> {
        let session = t.session;
        // The lists first, before any connection is made.
        t.check_lists()?;
        let target = self.open(session)?.target;
        let timeout = self.binding_timeout(t.lens);
        let deadline = Instant::now() + timeout;
        let id = target.id;
        let n = t.lens.iter().filter(|&&l| l > 0).count();
        if n == 0 {
            return match notify {
                Some((name, msg)) => {
                    let peer = target.peer;
                    self.inner
                        .mailbox
                        .send(self.transport(), peer, name, msg, deadline)
                }
                None => Ok(()),
            };
        }
        let peer = self.check_target(target, || t.requests(id))?.peer;
        let staged = match notify {
            Some((name, msg)) => {
                Some(
                    self.inner
                        .mailbox
                        .stage(self.transport(), peer, name, msg, deadline)?,
                )
            }
            None => None,
        };
        let mut batch = Batch::with_capacity(n);
        for (_, r) in t.requests(id) {
            batch.push(r.op());
        }
        batch = batch.timeout(timeout);
        if let Some(s) = staged {
            batch = batch.notify(s.tag());
        }
        let h = match self.transport().submit(peer, batch) {
            Ok(h) => h,
            Err(e) => {
                if let Some(s) = staged {
                    self.inner.mailbox.release(s);
                }
                return Err(Error::transport(
                    &format!("transfer to {session} refused"),
                    e,
                ));
            }
        };
        match h.wait(deadline) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Nothing more is handed to the wire; bytes already sent may still land,
                // inside the ranges checked above.
                h.cancel();
                if let Some(s) = staged {
                    self.inner.mailbox.release(s);
                }
                Err(Error::transport(
                    &format!("transfer to {session} failed"),
                    e,
                ))
            }
        }
    }

    /// `batch_transfer_async*` / `transfer_submit_write`: posts the transfer and returns
    /// a batch id (never 0) for [`Self::check_batch`] or [`Self::wait_batches`]; the
    /// deadline is Mooncake's, as for [`Self::transfer_sync`]. A range that fails the
    /// checks is refused here, not reported later.
    pub fn transfer_async(&self, t: &Transfer<'_>) -> Result<u64, Error> {
        t.check_lists()?;
        let target = self.open(t.session)?.target;
        let entries: Vec<Request> = (0..t.lens.len())
            .map(|i| Request {
                opcode: t.opcode,
                source: t.locals[i],
                target_id: target.id,
                target_offset: t.remotes[i],
                length: t.lens[i],
            })
            .collect();
        let id = lock(&self.inner.batches).insert(entries.len().max(1))?;
        let timeout = self.binding_timeout(t.lens);
        match self.submit_into(id, &entries, None, Some(&target), timeout) {
            Ok(()) => Ok(id),
            Err(e) => {
                lock(&self.inner.batches).live.remove(&id);
                Err(e)
            }
        }
    }

    /// `transfer_check_status`: the batch's state; once it is not running the id is
    /// collected (a second call gets [`BatchCheck::Failed`], as does an unknown id).
    /// Never blocks.
    pub fn check_batch(&self, id: u64) -> BatchCheck {
        let Ok(b) = self.batch(id) else {
            return BatchCheck::Failed;
        };
        let state = lock(&b).check();
        if state != BatchCheck::Running {
            lock(&self.inner.batches).live.remove(&id);
        }
        state
    }

    /// `get_batch_transfer_status`: waits for every batch of `ids` (each until its
    /// deadline) and collects them all. Fails if any id is unknown or any request
    /// failed; the batches not yet finished then are cancelled.
    pub fn wait_batches(&self, ids: &[u64]) -> Result<(), Error> {
        let entries: Vec<Option<Arc<Mutex<BatchEntry>>>> = {
            let mut t = lock(&self.inner.batches);
            ids.iter().map(|id| t.live.remove(id)).collect()
        };
        let mut first: Result<(), Error> = match ids.iter().zip(&entries).find(|(_, e)| e.is_none())
        {
            Some((id, _)) => fail(
                Code::InvalidArgument,
                format!("unknown or collected batch id {id}"),
            ),
            None => Ok(()),
        };
        for e in entries.iter().flatten() {
            for h in &lock(e).subs {
                if first.is_err() {
                    h.cancel();
                    continue;
                }
                if let Err(err) = h.wait(h.deadline()) {
                    h.cancel();
                    first = Err(Error::transport("batch failed", err));
                }
            }
        }
        first
    }
}
