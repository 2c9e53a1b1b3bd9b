//! The pool's shared state: [`Store`], what every volume handle and the public
//! [`Pool`](crate::Pool) work through. Its fields are private; the data path and the
//! catalogue use the methods below and those of its files: commit.rs (commits, the
//! `fdatasync` turn, the committer thread), checkpoint.rs (checkpoints, superblock
//! switches, block writes), room.rs (the room set aside for checkpoints). Not here:
//! opening (the pool's open.rs), the data path (`volume`), formats (`format`, `journal`).
//!
//! # Lock order
//! Locks are taken in this order and never in another (any may be skipped):
//!
//! 1. a volume's *gate* (`VolState::gate`, tokio: writes shared; snapshot and clone of
//!    that volume exclusive); only a group snapshot holds several, taken in the
//!    volumes' name order;
//! 2. the *range locks* (`stripes`, tokio, by volume and logical unit, each call taking
//!    its stripes in index order), or a *copy-on-write lock* (`cow_stripes`);
//! 3. the *log lock* (`log`, tokio: a commit cycle or checkpoint, from its start to its
//!    end), then the *`fdatasync` turn* (`sync_turn`);
//! 4. the *volume registry* (`volumes`);
//! 5. a volume's *map lock* (`VolState::map`); only a checkpoint holds several, every
//!    volume's, taken in the registry's order, and a group snapshot, its members'
//!    (read), in name order, which is the registry's;
//! 6. the *allocator* (`alloc`);
//! 7. the *journal* (`journal`), then the *commit queue* (`commits`).
//!
//! A volume's *properties lock* (`VolState::props`, labels and attachments) is a leaf:
//! held only to clone or replace the `Arc` it guards, with no other lock taken under
//! it. Its value changes only under that volume's map lock (5) held for writing. The
//! hole puncher's signal (`punch::Signal`, punch.rs) is a leaf too, and so is its stop
//! lock, held across one punch. A pool grow's
//! *grow lock* (`grow_lock`, grow.rs) comes before all of them: taken with no lock held,
//! it takes the log lock (3) to write the superblocks, and the allocator (6) under
//! it to free the new units.
//!
//! Locks 4 to 7 are parking_lot locks held for short synchronous steps, never across an
//! `.await`; 1 to 3 are tokio locks, which may be held across I/O. A step that holds a
//! lock never waits for one earlier in the order (`Pool::status` reads the registry
//! before it takes the allocator for that reason). The volume count the room for
//! metadata needs is kept in the allocator, so reading it takes no registry lock.
//!
//! # Commit protocol
//! A *commit* makes every completed data write and every logged metadata change
//! durable, in this order:
//! 1. note how far the pending frees and settles reach, and take the pending log records;
//! 2. `fdatasync` the pool: data written before the records were taken is durable,
//!    so no durable mapping ever points at unwritten data;
//! 3. write the records as log batches with `RWF_DSYNC` (each durable on completion);
//! 4. frees noted in step 1 become allocatable.
//!
//! Cycles and checkpoints run one at a time under the log lock, which each holds from
//! step 1 to its end. A flush runs its cycle on a task of its own tokio runtime
//! ([`Store::commit`]); flushes waiting for the lock share the cycle that began
//! after they did. The committer thread runs the cycles that must be checkpoints,
//! background commits, and the flushes of callers on no runtime.
//!
//! When no log record is pending (every one logged is durable), a flush needs only
//! step 2, and the flushing task issues that `fdatasync` itself;
//! flushes that arrive while one runs share the next.
//!
//! A *checkpoint* (when half the log is used or a commit would not fit, on request, and
//! at an open that needs one; a close writes none) snapshots the metadata under all the locks, writes the snapshot into free data
//! units, `fdatasync`s (data and chunks), then writes the other superblock slot pointing
//! at it with the log restarting at the current position, and `fdatasync`s. Until that
//! last write the old superblock, checkpoint and log describe the pool; after it, the
//! new ones do. The checkpoint at open also moves the log's sequence numbers past any
//! batch a crash may have left beyond the replayed end of the log.

mod checkpoint;
mod commit;
mod grow;
mod punch;
pub(crate) mod room;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock};

use commit::Commits;

use crate::error::{Error, ErrorKind, Result};
use crate::format::Superblock;
use crate::info::{Recovery, VolumeInfo};
use crate::io::IoRing;
use crate::journal::{Geometry, LogCursor, Record, VolumeMeta};
use crate::meta::{Allocator, MapTable, RefcountTable, StripedCounts};
use crate::props::Props;

/// Seconds after which the committer commits completed writes nobody flushed.
const COMMIT_INTERVAL_SECS: u64 = 5;
/// Pending log bytes that make the committer write them without a flush request.
const BACKGROUND_COMMIT_BYTES: usize = 256 * 1024;

/// One volume's live state.
pub(crate) struct VolState {
    pub id: u64,
    pub name: String,
    /// A read-only snapshot.
    pub snapshot: bool,
    pub created: u32,
    pub size: AtomicU64,
    pub map: RwLock<MapTable>,
    pub deleted: AtomicBool,
    /// Not pristine ([`crate::format::VOLUME_FLAG_WRITTEN`]): set with the first
    /// mapping record, under the map lock.
    pub written: AtomicBool,
    /// Labels and attachments. Changed only under the map lock held for writing (so
    /// that a checkpoint, which holds every map lock, sees them with the log position
    /// of their record); read under this lock alone.
    pub props: Mutex<Arc<Props>>,
    /// Writes, trims and zeroes hold it shared for their whole duration; taking a
    /// snapshot or clone of this volume holds it exclusively, so the point in time
    /// falls between writes, never inside one.
    pub gate: tokio::sync::RwLock<()>,
}

impl VolState {
    /// The live state of volume `id` as the metadata `v` describes it.
    pub(crate) fn new(id: u64, v: VolumeMeta) -> VolState {
        VolState {
            id,
            name: v.name,
            snapshot: v.snapshot,
            created: v.created,
            size: AtomicU64::new(v.size),
            map: RwLock::new(v.map),
            deleted: AtomicBool::new(false),
            written: AtomicBool::new(v.written),
            props: Mutex::new(Arc::new(v.props)),
            gate: tokio::sync::RwLock::new(()),
        }
    }

    /// Its labels and attachments now.
    pub(crate) fn props(&self) -> Arc<Props> {
        self.props.lock().clone()
    }
}

/// Metadata records waiting for the next commit.
#[derive(Default)]
pub(crate) struct Journal {
    pub bytes: Vec<u8>,
    /// Offsets in `bytes` where no log batch may begin: the record boundaries inside
    /// runs logged together by [`Store::log_records`] (ascending).
    pub glued: Vec<usize>,
}

/// Committer-only state: the log cursor and the current superblock.
pub(crate) struct LogState {
    pub(crate) cursor: LogCursor,
    pub(crate) sb: Superblock,
    /// Units of the current checkpoint's chain of chunks (its directory).
    pub(crate) checkpoint_units: Vec<u32>,
    /// The current checkpoint's page chunks.
    pub(crate) page_chunks: crate::journal::PageChunks,
}

/// Counters behind [`crate::CommitStats`]: durations in nanoseconds.
#[derive(Default)]
pub(crate) struct Costs {
    commits: AtomicU64,
    commit_nanos: AtomicU64,
    commit_max_nanos: AtomicU64,
    checkpoints: AtomicU64,
    checkpoint_nanos: AtomicU64,
    checkpoint_max_nanos: AtomicU64,
    checkpoint_bytes: AtomicU64,
    checkpoint_hold_max_nanos: AtomicU64,
}

/// A commit cycle or checkpoint longer than this is logged (info), with what it cost.
const SLOW: std::time::Duration = std::time::Duration::from_millis(100);

impl Costs {
    pub(crate) fn commit(&self, took: std::time::Duration, bytes: usize) {
        let n = took.as_nanos() as u64;
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.commit_nanos.fetch_add(n, Ordering::Relaxed);
        self.commit_max_nanos.fetch_max(n, Ordering::Relaxed);
        if took > SLOW {
            tracing::info!(ms = took.as_millis() as u64, log_bytes = bytes, "slow commit");
        }
    }

    pub(crate) fn checkpoint(&self, took: std::time::Duration, hold: std::time::Duration, bytes: u64) {
        let n = took.as_nanos() as u64;
        self.checkpoints.fetch_add(1, Ordering::Relaxed);
        self.checkpoint_nanos.fetch_add(n, Ordering::Relaxed);
        self.checkpoint_max_nanos.fetch_max(n, Ordering::Relaxed);
        self.checkpoint_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.checkpoint_hold_max_nanos.fetch_max(hold.as_nanos() as u64, Ordering::Relaxed);
        if took > SLOW {
            tracing::info!(
                ms = took.as_millis() as u64,
                hold_ms = hold.as_millis() as u64,
                bytes,
                "slow checkpoint (writes that map or allocate waited for hold_ms)"
            );
        }
    }

    pub(crate) fn stats(&self) -> crate::CommitStats {
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        crate::CommitStats {
            commits: self.commits.load(Ordering::Relaxed),
            commit_seconds: s(&self.commit_nanos),
            commit_max_seconds: s(&self.commit_max_nanos),
            checkpoints: self.checkpoints.load(Ordering::Relaxed),
            checkpoint_seconds: s(&self.checkpoint_nanos),
            checkpoint_max_seconds: s(&self.checkpoint_max_nanos),
            checkpoint_bytes: self.checkpoint_bytes.load(Ordering::Relaxed),
            checkpoint_hold_max_seconds: s(&self.checkpoint_hold_max_nanos),
        }
    }
}

/// The shared state of one open pool (module docs).
pub(crate) struct Store {
    path: PathBuf,
    /// The pool file or device (for what the ring does not do: its holes, its room).
    file: Arc<File>,
    /// Every unit is backed by blocks of the host (a block device, or a preallocated
    /// file): the spare needs no writes to back it (room.rs).
    backed_all: AtomicBool,
    /// The pool is on a block device that gets the units it frees as discards
    /// (punch.rs), though every unit counts as backed.
    discard_device: bool,
    /// The host file system refused room for a write (ENOSPC): allocations look for
    /// units the pool file already holds blocks for (room.rs) until it has room again.
    host_full: AtomicBool,
    /// Freed data units of a pool file are given back to the host (hole punching):
    /// cleared when the host file system cannot, and never done when `backed_all`.
    punch_holes: AtomicBool,
    /// Wakes the thread that punches them (punch.rs).
    puncher: Arc<punch::Signal>,
    ring: IoRing,
    direct: bool,
    /// The geometry the pool was opened with: its unit size and data offset hold for
    /// good; its size and unit count are those at open (a grown pool's are in
    /// `pool_size` and the allocator).
    geo: Geometry,
    /// Bytes of the pool now (the superblock's `pool_size`; changes when it grows).
    pool_size: AtomicU64,
    /// Held by a pool grow from start to end (grow.rs): one at a time. Taken with no
    /// lock held, before the log lock.
    grow_lock: std::sync::Mutex<()>,
    volumes: RwLock<BTreeMap<String, Arc<VolState>>>,
    next_volume: AtomicU64,
    alloc: Mutex<Allocator>,
    /// The allocator's refcounts, for lock-free reads on the data path.
    refcounts: Arc<RefcountTable>,
    /// The allocator's settling counts, readable without its lock: non-zero means the
    /// unit may be exclusive only by changes not yet durable, so writes copy it.
    settling: Arc<StripedCounts>,
    journal: Mutex<Journal>,
    /// In-flight I/O per data unit (striped); a unit that may be pinned is never made
    /// allocatable.
    pins: StripedCounts,
    /// Data writes completed since the last commit's fdatasync started.
    writes_since_sync: AtomicU64,
    /// What the open read to recover the pool.
    recovery: Recovery,
    /// Log records appended so far (counted under the journal lock).
    records_logged: AtomicU64,
    /// Of those, how many are durable (the first N, by a completed commit or checkpoint).
    records_durable: AtomicU64,
    failed: AtomicBool,
    /// Set by [`crate::Pool::close`]: later writes are refused.
    closed: AtomicBool,
    /// Range locks, striped by (volume, logical unit): a write holds its units' stripes
    /// from before it reads partial blocks until its bitmap bits are set, exclusively
    /// where it rewrites a partial block (read-modify-write), shared elsewhere; a trim
    /// holds its units' stripes exclusively while it clears bits and unmaps. So a
    /// read-modify-write never writes back stale bytes over a concurrent write, and a
    /// trim never unmaps a unit under a write that has not set its bits yet.
    stripes: Box<[tokio::sync::RwLock<()>]>,
    /// Locks for copy-on-write of one logical unit, striped by (volume, unit).
    cow_stripes: Box<[tokio::sync::Mutex<()>]>,
    /// Commit requests; shared with the committer thread, which holds no strong
    /// reference to the pool while it waits.
    commits: Arc<Commits>,
    /// The log cursor and superblock: held for a whole commit cycle or checkpoint, so
    /// those run one at a time and take the journal's records in log order. A tokio
    /// mutex, because a cycle run by [`Self::commit`] holds it across its I/O; the
    /// committer thread takes it with `blocking_lock`.
    log: tokio::sync::Mutex<LogState>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Every `fdatasync` of the pool after open takes its turn here, one at a time
    /// ([`Self::sync_data`]).
    sync_turn: tokio::sync::Mutex<()>,
    /// Those `fdatasync`s: how many were issued, and the number of the last one that
    /// completed successfully.
    syncs_started: AtomicU64,
    syncs_done: AtomicU64,
    /// Commit cycles run by [`Self::commit`] on a runtime task: how many began, and the
    /// number of the last that completed successfully (group commit, as for the fast
    /// syncs).
    cycles_started: AtomicU64,
    cycles_done: AtomicU64,
    /// What commits and checkpoints cost ([`crate::CommitStats`]).
    pub(crate) costs: Costs,
}

/// What [`Store::assemble`] builds a store from: a pool loaded and validated.
pub(crate) struct Parts {
    pub path: PathBuf,
    pub file: Arc<File>,
    pub backed_all: bool,
    /// A block device whose freed units are passed down as discards (`PoolOptions::discard`).
    pub discard_device: bool,
    pub ring: IoRing,
    pub direct: bool,
    pub geo: Geometry,
    pub volumes: BTreeMap<String, Arc<VolState>>,
    pub next_volume: u64,
    pub alloc: Allocator,
    pub recovery: Recovery,
    pub log: LogState,
}

impl Store {
    /// A store over a loaded pool; its committer is not started yet
    /// ([`Self::start_committer`]).
    pub(crate) fn assemble(p: Parts) -> Arc<Store> {
        Arc::new(Store {
            path: p.path,
            file: p.file,
            backed_all: AtomicBool::new(p.backed_all),
            discard_device: p.discard_device,
            host_full: AtomicBool::new(false),
            punch_holes: AtomicBool::new(true),
            puncher: Arc::new(punch::Signal::default()),
            ring: p.ring,
            direct: p.direct,
            pool_size: AtomicU64::new(p.geo.pool_size),
            grow_lock: std::sync::Mutex::new(()),
            geo: p.geo,
            volumes: RwLock::new(p.volumes),
            next_volume: AtomicU64::new(p.next_volume),
            refcounts: p.alloc.refcount_table(),
            settling: p.alloc.settling_table(),
            alloc: Mutex::new(p.alloc),
            journal: Mutex::new(Journal::default()),
            pins: StripedCounts::new(),
            writes_since_sync: AtomicU64::new(0),
            recovery: p.recovery,
            records_logged: AtomicU64::new(0),
            records_durable: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            // 4096, so that a trim of a whole mapping page (512 units) holds an eighth
            // of them at a time, not all.
            stripes: (0..4096).map(|_| tokio::sync::RwLock::new(())).collect(),
            cow_stripes: (0..256).map(|_| tokio::sync::Mutex::new(())).collect(),
            commits: Arc::new(Commits::default()),
            log: tokio::sync::Mutex::new(p.log),
            committer: Mutex::new(None),
            sync_turn: tokio::sync::Mutex::new(()),
            syncs_started: AtomicU64::new(0),
            syncs_done: AtomicU64::new(0),
            cycles_started: AtomicU64::new(0),
            cycles_done: AtomicU64::new(0),
            costs: Costs::default(),
        })
    }

    /// Starts the committer thread (after the checkpoint at open).
    ///
    /// Errors: [`ErrorKind::Io`] when the thread cannot be made.
    pub(crate) fn start_committer(self: &Arc<Self>) -> Result<()> {
        let weak = Arc::downgrade(self);
        let commits = self.commits.clone();
        let handle = std::thread::Builder::new()
            .name("ferrovol-commit".into())
            .spawn(move || commit::committer(weak, commits))
            .map_err(|e| Error::io("start committer", e))?;
        *self.committer.lock() = Some(handle);
        self.start_puncher()
    }

    /// Stops the committer and commits what is left (the pool's close): every logged
    /// change and completed write is durable on return. No checkpoint: the next open
    /// replays the log (at most half of it, docs/on-disk-format.md 6.2).
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool had failed (nothing is written);
    /// the commit's (the pool is then failed).
    pub(crate) fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::SeqCst);
        {
            let mut q = self.commits.queue.lock();
            q.shutdown = true;
            self.commits.cv.notify_all();
        }
        if let Some(h) = self.committer.lock().take() {
            let _ = h.join();
        }
        self.stop_puncher();
        if self.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "pool failed; not writing a final commit"));
        }
        // A change that began before the close may have logged its records after the
        // committer's last cycle.
        self.commit_cycle().map_err(|e| e.op("close pool"))
    }

    /// The pool's geometry.
    pub(crate) fn geo(&self) -> &Geometry {
        &self.geo
    }

    /// The pool's io_uring.
    pub(crate) fn ring(&self) -> &IoRing {
        &self.ring
    }

    /// Path of the pool file or device.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the pool file is opened with O_DIRECT.
    pub(crate) fn direct(&self) -> bool {
        self.direct
    }

    /// What the open read to recover the pool.
    pub(crate) fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// The volume registry: volumes and snapshots by name (lock order 4).
    pub(crate) fn volumes(&self) -> &RwLock<BTreeMap<String, Arc<VolState>>> {
        &self.volumes
    }

    /// A fresh volume id, never used before in this pool.
    pub(crate) fn next_volume_id(&self) -> u64 {
        self.next_volume.fetch_add(1, Ordering::SeqCst)
    }

    /// The id the next volume will get (what a checkpoint records).
    fn next_volume(&self) -> u64 {
        self.next_volume.load(Ordering::SeqCst)
    }

    /// The allocator, locked (lock order 6).
    pub(crate) fn alloc(&self) -> MutexGuard<'_, Allocator> {
        self.alloc.lock()
    }

    /// The allocator's refcounts, for lock-free reads on the data path.
    pub(crate) fn refcounts(&self) -> &RefcountTable {
        &self.refcounts
    }

    /// The allocator's settling counts, readable without its lock: non-zero means the
    /// unit may be exclusive only by changes not yet durable, so writes copy it.
    pub(crate) fn settling(&self) -> &StripedCounts {
        &self.settling
    }

    /// In-flight I/O per data unit (striped); a unit that may be pinned is never made
    /// allocatable.
    pub(crate) fn pins(&self) -> &StripedCounts {
        &self.pins
    }

    /// The range locks (lock order 2), striped by (volume, logical unit).
    pub(crate) fn stripes(&self) -> &[tokio::sync::RwLock<()>] {
        &self.stripes
    }

    /// The copy-on-write locks (lock order 2), striped by (volume, logical unit).
    pub(crate) fn cow_stripes(&self) -> &[tokio::sync::Mutex<()>] {
        &self.cow_stripes
    }

    /// Counts a completed data write: the next commit `fdatasync`s before it logs.
    pub(crate) fn note_data_write(&self) {
        self.writes_since_sync.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether the host file system refused room for a write (room.rs).
    pub(crate) fn host_full(&self) -> bool {
        self.host_full.load(Ordering::Relaxed)
    }

    /// Notes that the host file system refused room for a write.
    pub(crate) fn set_host_full(&self) {
        self.host_full.store(true, Ordering::Relaxed);
    }

    /// Whether the pool failed (it then refuses writes until restarted).
    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub fn info(&self, v: &VolState) -> VolumeInfo {
        let props = v.props();
        let (mut mapped, mut exclusive) = (0u64, 0u64);
        for (_, leaf) in v.map.read().leaves() {
            for (_, page) in leaf.pages() {
                mapped += u64::from(page.mapped);
                if !leaf.is_shared() && !page.is_shared() {
                    exclusive += page.units().filter(|&u| self.refcounts.is_exclusive(u)).count() as u64;
                }
            }
        }
        VolumeInfo {
            name: v.name.clone(),
            id: v.id,
            snapshot: v.snapshot,
            size: v.size.load(Ordering::SeqCst),
            allocated: mapped * self.geo.unit_size,
            exclusive: exclusive * self.geo.unit_size,
            shared: (mapped - exclusive) * self.geo.unit_size,
            created: u64::from(v.created),
            pristine: !v.written.load(Ordering::SeqCst),
            labels: props.labels.clone(),
            attachments: props.attachments.clone(),
        }
    }

    /// Bytes of the pool now (its superblock's `pool_size`).
    pub(crate) fn pool_size(&self) -> u64 {
        self.pool_size.load(Ordering::SeqCst)
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Error::new(ErrorKind::Failed, "the pool was closed"))
        } else if self.failed.load(Ordering::SeqCst) {
            Err(Error::new(
                ErrorKind::Failed,
                "an earlier write or commit to the pool device failed; the pool refuses writes until restarted",
            ))
        } else {
            Ok(())
        }
    }

    /// Appends a record to the pending journal (call with the affected map locked).
    pub(crate) fn log_record(&self, r: &Record) {
        self.log_records(std::slice::from_ref(r));
    }

    /// Appends `rs` to the journal together: no commit falls between them, and no log
    /// batch boundary either (unless they alone overflow a batch), so recovery replays
    /// all of them or none.
    pub(crate) fn log_records(&self, rs: &[Record]) {
        let mut j = self.journal.lock();
        for (i, r) in rs.iter().enumerate() {
            if i > 0 {
                let at = j.bytes.len();
                j.glued.push(at);
            }
            r.encode(&mut j.bytes);
        }
        self.records_logged.fetch_add(rs.len() as u64, Ordering::SeqCst);
        if j.bytes.len() >= BACKGROUND_COMMIT_BYTES {
            drop(j);
            let mut q = self.commits.queue.lock();
            if !q.background {
                q.background = true;
                self.commits.cv.notify_one();
            }
        }
    }

    /// Fail-stop: after a write, `fdatasync` or commit to the pool device failed, the
    /// pool refuses writes, trims and management changes (reads keep working) until it
    /// is restarted; `status().failed` reports it. Nothing is written to a device that
    /// may have lost data, so nothing acknowledged later can depend on it.
    pub(crate) fn fail(&self, e: &Error) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %e, path = %self.path.display(), "pool I/O failed; the pool now refuses writes");
        }
    }

    /// True when every log record appended so far is durable: a FUA write that changes
    /// no mapping may then rely on `RWF_DSYNC` alone (the mapping it writes through is
    /// already on the medium).
    pub(crate) fn metadata_settled(&self) -> bool {
        self.records_durable.load(Ordering::SeqCst) >= self.records_logged.load(Ordering::SeqCst)
    }
}

/// The error of an I/O whose completion channel closed: the ring's reaper is gone.
pub(crate) fn worker_gone() -> Error {
    Error::new(ErrorKind::Failed, "the I/O worker stopped")
}

impl Drop for Store {
    fn drop(&mut self) {
        // Without close(): a crash-equivalent stop; the log has everything committed.
        self.commits.queue.lock().shutdown = true;
        self.commits.cv.notify_all();
        self.puncher.stop();
    }
}
