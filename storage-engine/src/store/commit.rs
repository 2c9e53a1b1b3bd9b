//! Commits and the committer thread (the commit protocol of the store's module docs):
//! [`Store::commit`] (a flush: one `fdatasync`, or a commit cycle on the caller's
//! runtime), the cycles the committer thread runs, requests to it (checkpoints, growing
//! the spare), and [`Store::sync_data`], the one place the pool is synced. Not here:
//! checkpoints themselves (checkpoint.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use tokio::sync::oneshot;

use super::checkpoint::write_blocks_async;
use super::room;
use super::{worker_gone, LogState, Store, COMMIT_INTERVAL_SECS};
use crate::error::{Error, ErrorKind, Result};
use crate::io;
use crate::journal;
use crate::meta::PendingMark;

#[derive(Default)]
pub(super) struct Commits {
    pub(super) queue: Mutex<CommitQueue>,
    pub(super) cv: Condvar,
}

#[derive(Default)]
pub(super) struct CommitQueue {
    pub(super) waiters: Vec<oneshot::Sender<Result<(), ErrorKind>>>,
    /// The next cycle is a checkpoint ([`Store::checkpoint_async`]).
    pub(super) checkpoint: bool,
    pub(super) background: bool,
    pub(super) shutdown: bool,
    /// The spare should grow (room.rs); these wait for it.
    pub(super) grow: bool,
    pub(super) grow_waiters: Vec<oneshot::Sender<Result<(), ErrorKind>>>,
}

impl Store {
    /// Waits for a commit that covers everything completed before the call.
    ///
    /// When every log record is already durable ([`Self::metadata_settled`]), only data
    /// writes can still be volatile, and one `fdatasync` issued now covers each write
    /// that completed before the call: the caller's thread submits it and waits on its
    /// own runtime, with no hand-off to the committer (a database's write-then-flush
    /// pays one device flush and no thread switch). Otherwise a commit cycle (module
    /// docs) runs on a task of the caller's tokio runtime ([`Self::commit_on_task`]),
    /// again with no thread switch; the committer thread runs it instead when a
    /// checkpoint is due, or when the caller is on no tokio runtime.
    ///
    /// Errors: [`ErrorKind::Failed`] when the pool failed, is closing, or this commit's
    /// I/O failed (the pool then fails: [`Self::fail`]).
    pub(crate) async fn commit(self: &Arc<Self>) -> Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "a write to the pool failed earlier; the pool refuses writes"));
        }
        if self.metadata_settled() && !self.commits.queue.lock().shutdown {
            // writes_since_sync is left alone: the committer may skip its own sync only
            // when no write completed since it last synced, and this sync may not have
            // finished when it looks.
            return self
                .sync_data()
                .await
                .map_err(|_| Error::new(ErrorKind::Failed, "commit failed; the pool refuses writes"));
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            // A task of its own: once it has taken records from the journal it must
            // write them even if the caller stops waiting (a dropped request), or a
            // later flush would be answered without them.
            let store = Arc::clone(self);
            let seen = self.cycles_started.load(Ordering::SeqCst);
            match rt.spawn(async move { store.commit_on_task(seen).await }).await {
                Ok(Some(result)) => return result,
                Ok(None) => {} // a checkpoint is due: the committer runs it
                Err(_) => return Err(Error::new(ErrorKind::Failed, "commit task failed")),
            }
        }
        self.on_committer(false).await
    }

    /// Asks the committer for a checkpoint and waits for it: everything logged or
    /// pending becomes part of a new checkpoint, the log is emptied, and the current
    /// checkpoint's size (what the room for metadata counts on, room.rs) becomes that
    /// of the metadata now.
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool failed earlier or is closing, or if the
    /// checkpoint failed, which fails the pool as any failed checkpoint does (an I/O
    /// error; [`ErrorKind::NoSpace`] if it found no unit, which the spare is there to
    /// prevent).
    pub(crate) async fn checkpoint_async(&self) -> Result<()> {
        self.on_committer(true).await
    }

    /// Asks the committer for a checkpoint and does not wait for it; requests made
    /// while one is pending are served by one checkpoint. A failed checkpoint fails the
    /// pool, which every later change reports.
    pub(crate) fn request_checkpoint(&self) {
        let mut q = self.commits.queue.lock();
        if q.shutdown {
            return;
        }
        q.checkpoint = true;
        q.background = true;
        self.commits.cv.notify_one();
    }

    /// Asks the committer to grow the spare (room.rs) and does not wait; requests made
    /// while one is pending are served together.
    pub(crate) fn request_grow_spare(&self) {
        let mut q = self.commits.queue.lock();
        if q.shutdown || q.grow {
            return;
        }
        q.grow = true;
        self.commits.cv.notify_one();
    }

    /// Asks the committer to grow the spare and waits for it.
    ///
    /// Errors: [`ErrorKind::NoSpace`] when the host file system had no room to back
    /// the units; [`ErrorKind::Failed`] when the pool failed or is closing.
    pub(crate) async fn grow_spare_async(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.commits.queue.lock();
            if q.shutdown {
                return Err(Error::new(ErrorKind::Failed, "pool is closing"));
            }
            q.grow = true;
            q.grow_waiters.push(tx);
            self.commits.cv.notify_one();
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(ErrorKind::NoSpace)) => Err(room::host_full_error()),
            Ok(Err(kind)) => Err(Error::new(kind, "growing the room for metadata failed; the pool refuses writes")),
            Err(_) => Err(Error::new(ErrorKind::Failed, "pool closed")),
        }
    }

    /// Queues a cycle on the committer thread (a checkpoint if `checkpoint`, else a
    /// commit cycle, which may itself become a checkpoint) and waits for its outcome.
    async fn on_committer(&self, checkpoint: bool) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut q = self.commits.queue.lock();
            if q.shutdown {
                return Err(Error::new(ErrorKind::Failed, "pool is closing"));
            }
            q.waiters.push(tx);
            q.checkpoint |= checkpoint;
            self.commits.cv.notify_one();
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(ErrorKind::NoSpace)) if checkpoint => {
                Err(Error::new(ErrorKind::NoSpace, "no free unit for the checkpoint"))
            }
            Ok(Err(kind)) => Err(Error::new(
                kind,
                if checkpoint {
                    "checkpoint failed; the pool refuses writes"
                } else {
                    "commit failed; the pool refuses writes"
                },
            )),
            Err(_) => Err(Error::new(ErrorKind::Failed, "pool closed")),
        }
    }

    /// `fdatasync` of the pool: the only way the pool is synced once it is open (the
    /// flush fast path, commit cycles, checkpoints), so that no two run at once. With
    /// buffered I/O the kernel reports a writeback error to one `fdatasync` of the file
    /// only; one running beside it would succeed over the lost write. So each waits for
    /// its turn; a sync that was issued after this call began and succeeded covers the
    /// call (group commit: every write completed before the call was before that sync);
    /// a failure fails the pool before the next turn begins, and the failed state is
    /// looked at again after each sync, so that no waiter is answered with success over
    /// a failure it overlapped.
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool failed (before or during the wait),
    /// [`ErrorKind::Io`] if this `fdatasync` failed (the pool is then failed).
    pub(super) async fn sync_data(&self) -> Result<()> {
        let seen = self.syncs_started.load(Ordering::SeqCst);
        let _turn = self.sync_turn.lock().await;
        let Some(number) = self.sync_turn_begins(seen)? else { return Ok(()) };
        let r = self.ring.fdatasync().await;
        self.sync_turn_ends(number, r)
    }

    /// [`Self::sync_data`] for a caller on no runtime (the committer, open, close).
    ///
    /// Errors: as [`Self::sync_data`].
    pub(super) fn sync_data_blocking(&self) -> Result<()> {
        let seen = self.syncs_started.load(Ordering::SeqCst);
        let _turn = self.sync_turn.blocking_lock();
        let Some(number) = self.sync_turn_begins(seen)? else { return Ok(()) };
        let r = self.ring.fdatasync().blocking_recv();
        self.sync_turn_ends(number, r)
    }

    /// A sync's turn has come (`seen`: `syncs_started` when it was called): `None` when
    /// a later sync already covers it, else the number of the sync to issue.
    fn sync_turn_begins(&self, seen: u64) -> Result<Option<u64>> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "the pool failed earlier; it refuses writes"));
        }
        if self.syncs_done.load(Ordering::SeqCst) > seen {
            return Ok(None);
        }
        Ok(Some(self.syncs_started.fetch_add(1, Ordering::SeqCst) + 1))
    }

    /// Accounts the outcome of sync `number`, still in its turn.
    fn sync_turn_ends(
        &self,
        number: u64,
        r: std::result::Result<std::io::Result<()>, oneshot::error::RecvError>,
    ) -> Result<()> {
        let r = r.map_err(|_| worker_gone()).and_then(|r| r.map_err(|e| Error::io("fdatasync pool", e)));
        if let Err(e) = &r {
            self.fail(e);
            return r;
        }
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "the pool failed during the fdatasync; it refuses writes"));
        }
        self.syncs_done.store(number, Ordering::SeqCst);
        Ok(())
    }

    /// A commit cycle on the calling task, for [`Self::commit`] (`seen`: the value of
    /// `cycles_started` when that call began). Returns `None`, having changed nothing,
    /// when a checkpoint is due or the records do not fit in the log: the committer
    /// must run it.
    async fn commit_on_task(&self, seen: u64) -> Option<Result<()>> {
        let mut log = self.log.lock().await;
        // Both looked at under the lock: a cycle or checkpoint that failed did so while
        // holding it, and close() writes its last commit under it after setting `closed`.
        if self.failed.load(Ordering::SeqCst) {
            return Some(Err(Error::new(ErrorKind::Failed, "commit failed; the pool refuses writes")));
        }
        if self.closed.load(Ordering::SeqCst) {
            return Some(Err(Error::new(ErrorKind::Failed, "pool is closing")));
        }
        // A cycle that began after the call and succeeded covers it (group commit).
        if self.cycles_done.load(Ordering::SeqCst) > seen {
            return Some(Ok(()));
        }
        if self.checkpoint_due(&log) {
            return None;
        }
        let number = self.cycles_started.fetch_add(1, Ordering::SeqCst) + 1;
        let began = std::time::Instant::now();
        let (pending, records, upto) = self.take_records();
        let Some(plan) = self.place_batches(&log, &records).transpose() else {
            self.untake_records(records);
            return None;
        };
        // From here the records exist nowhere else: if this task is dropped before the
        // cycle ends (its runtime shut down), the pool fails rather than go on without
        // them or write later batches over a torn part of this one.
        let unfinished = FailOnDrop(Some(self));
        let result = async {
            let plan = plan?;
            if self.data_sync_needed(&records.bytes) {
                self.sync_data().await?;
            }
            // Every batch write is waited for, even after one fails: none may land
            // after the lock is released.
            let rxs = self.submit_batches(&plan);
            let mut first_error = None;
            for rx in rxs {
                if let Err(e) = log_write_done(rx.await) {
                    first_error.get_or_insert(e);
                }
            }
            first_error.map_or(Ok(plan), Err)
        }
        .await;
        unfinished.disarm();
        Some(match result {
            Ok(plan) => {
                self.finish_cycle(&mut log, plan, pending, upto);
                self.cycles_done.store(number, Ordering::SeqCst);
                self.costs.commit(began.elapsed(), records.bytes.len());
                Ok(())
            }
            Err(e) => {
                self.fail(&e);
                Err(Error::new(ErrorKind::Failed, "commit failed; the pool refuses writes"))
            }
        })
    }

    /// One commit cycle on the committer thread (see the module docs); a checkpoint
    /// instead when one is due or the records do not fit in the log. A failure fails
    /// the pool before the log lock is released.
    pub(super) fn commit_cycle(&self) -> Result<()> {
        self.with_log_locked(|log| self.commit_cycle_locked(log))
    }

    /// Runs `f` holding the log lock (a blocking wait for it), unless the pool has
    /// failed; a failure of `f` fails the pool before the lock is released, so the next
    /// holder sees it.
    pub(super) fn with_log_locked(&self, f: impl FnOnce(&mut LogState) -> Result<()>) -> Result<()> {
        let mut log = self.log.blocking_lock();
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "the pool failed earlier"));
        }
        let r = f(&mut log);
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }

    fn commit_cycle_locked(&self, log: &mut LogState) -> Result<()> {
        let began = std::time::Instant::now();
        if self.checkpoint_due(log) {
            return self.checkpoint_locked(log, 0);
        }
        let (pending, records, upto) = self.take_records();
        let Some(plan) = self.place_batches(log, &records)? else {
            // No room in the log: a checkpoint captures these records' effects (they
            // are already applied in memory) and empties the log.
            return self.checkpoint_locked(log, 0);
        };
        if self.data_sync_needed(&records.bytes) {
            self.sync_data_blocking()?;
        }
        let rxs = self.submit_batches(&plan);
        // Every batch write is waited for, even after one fails.
        let mut first_error = None;
        for rx in rxs {
            if let Err(e) = log_write_done(rx.blocking_recv()) {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        self.finish_cycle(log, plan, pending, upto);
        self.costs.commit(began.elapsed(), records.bytes.len());
        Ok(())
    }

    /// Whether the next cycle must be a checkpoint: the live log plus twice the
    /// pending records pass half the log (on-disk-format.md 6.2).
    pub(super) fn checkpoint_due(&self, log: &LogState) -> bool {
        let pending = self.journal.lock().bytes.len() as u64;
        log.cursor.pos - log.cursor.head + pending * 2 > self.geo.log_size / 2
    }

    /// C1 (on-disk-format.md 6.2): how far the pending frees and settles reach, the
    /// journal's records (the journal is left empty), and how many records were logged
    /// so far. Call with the log locked.
    pub(super) fn take_records(&self) -> (PendingMark, super::Journal, u64) {
        let pending = self.alloc.lock().pending_mark();
        let mut j = self.journal.lock();
        (pending, std::mem::take(&mut *j), self.records_logged.load(Ordering::SeqCst))
    }

    /// Puts records taken by [`Self::take_records`] back in front of the journal
    /// (they are older than anything logged since). Call with the log still locked.
    fn untake_records(&self, records: super::Journal) {
        let mut j = self.journal.lock();
        let newer = std::mem::replace(&mut *j, records);
        let shift = j.bytes.len();
        j.bytes.extend_from_slice(&newer.bytes);
        j.glued.extend(newer.glued.iter().map(|g| g + shift));
    }

    /// C3's placement: `records` as log batches numbered from the cursor's sequence
    /// number, each at its byte offset in the pool (wrap rule, 4.2). `None` if they do
    /// not all fit in the live log. Errors: a malformed pending record (an engine bug).
    fn place_batches(&self, log: &LogState, records: &super::Journal) -> Result<Option<LogPlan>> {
        let batches = journal::encode_batches(&records.bytes, &records.glued, log.cursor.seq + 1, self.geo.pool_tag())?;
        let mut pos = log.cursor.pos;
        let mut writes = Vec::with_capacity(batches.len());
        for b in batches {
            let len = b.len() as u64;
            if pos % self.geo.log_size + len > self.geo.log_size {
                pos += self.geo.log_size - pos % self.geo.log_size;
            }
            if pos + len - log.cursor.head > self.geo.log_size {
                return Ok(None);
            }
            writes.push((self.geo.log_offset + pos % self.geo.log_size, b));
            pos += len;
        }
        Ok(Some(LogPlan { writes, end: pos }))
    }

    /// Whether C2's `fdatasync` is needed before `records` are written: data was written
    /// since the last one, or records will point at data (resets the write count).
    fn data_sync_needed(&self, records: &[u8]) -> bool {
        let writes = self.writes_since_sync.swap(0, Ordering::SeqCst);
        writes > 0 || !records.is_empty()
    }

    /// C3: submits `plan`'s batch writes, each with `RWF_DSYNC` (durable on completion).
    fn submit_batches(&self, plan: &LogPlan) -> Vec<oneshot::Receiver<io::RwResult>> {
        plan.writes.iter().map(|(off, b)| write_blocks_async(&self.ring, *off, &[b], true)).collect()
    }

    /// C3's end and C4, once the batches of `plan` are durable: advance the log, mark
    /// the records counted in C1 durable, release the frees and settles noted there.
    fn finish_cycle(&self, log: &mut LogState, plan: LogPlan, pending: PendingMark, upto: u64) {
        log.cursor.pos = plan.end;
        log.cursor.seq += plan.writes.len() as u64;
        self.records_durable.fetch_max(upto, Ordering::SeqCst);
        self.release_pending(pending);
    }
}

/// Fails the pool when dropped while armed (see [`Store::commit_on_task`]).
struct FailOnDrop<'a>(Option<&'a Store>);

impl FailOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for FailOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(store) = self.0 {
            store.fail(&Error::new(ErrorKind::Failed, "a commit cycle was stopped before it finished"));
        }
    }
}

/// One commit cycle's log writes: (byte offset in the pool, batch) in log order, and the
/// log position after the last.
struct LogPlan {
    writes: Vec<(u64, Vec<u8>)>,
    end: u64,
}

/// The outcome of one log batch write, from its completion channel.
fn log_write_done(done: std::result::Result<io::RwResult, oneshot::error::RecvError>) -> Result<()> {
    match done {
        Ok((_, r)) => r.map_err(|e| Error::io("write log", e)),
        Err(_) => Err(worker_gone()),
    }
}

/// The committer thread: serves commit requests in groups; checkpoints when half the
/// log is used or a commit would not fit. Exits when the pool is closed or dropped.
pub(super) fn committer(weak: std::sync::Weak<Store>, commits: Arc<Commits>) {
    loop {
        let (waiters, shutdown, checkpoint, cycle, grow, grow_waiters) = {
            let mut q = commits.queue.lock();
            while q.waiters.is_empty() && !q.background && !q.shutdown && !q.grow {
                // Like a file system's commit interval: writes nobody flushed are
                // committed within a few seconds anyway.
                if commits.cv.wait_for(&mut q, std::time::Duration::from_secs(COMMIT_INTERVAL_SECS)).timed_out() {
                    q.background = true;
                }
            }
            let cycle = !q.waiters.is_empty() || q.background || q.shutdown;
            q.background = false;
            let checkpoint = std::mem::take(&mut q.checkpoint);
            let grow = std::mem::take(&mut q.grow);
            (std::mem::take(&mut q.waiters), q.shutdown, checkpoint, cycle, grow, std::mem::take(&mut q.grow_waiters))
        };
        let Some(store) = weak.upgrade() else {
            for w in waiters.into_iter().chain(grow_waiters) {
                let _ = w.send(Err(ErrorKind::Failed));
            }
            return;
        };
        let kind = |e: Error| match e.kind() {
            ErrorKind::NoSpace => ErrorKind::NoSpace,
            _ => ErrorKind::Failed,
        };
        if grow {
            let result = if shutdown { Err(ErrorKind::Failed) } else { store.grow_spare().map_err(kind) };
            for w in grow_waiters {
                let _ = w.send(result);
            }
        }
        if cycle {
            // A failed pool is refused, and a failing cycle fails the pool, inside.
            let result = if checkpoint { store.checkpoint(0) } else { store.commit_cycle() };
            let result = result.map_err(kind);
            // Release the pool before answering, so a caller that drops its last handle
            // after the flush closes the pool file at once.
            drop(store);
            for w in waiters {
                let _ = w.send(result);
            }
        }
        if shutdown && commits.queue.lock().waiters.is_empty() {
            return;
        }
    }
}
