//! The pool: opening and creating, volume management, and the committer.
//!
//! Lives here: [`Pool`] (public handle), [`PoolOptions`], [`VolumeInfo`],
//! [`PoolStatus`], the shared `PoolInner` that volumes use, commits (group commit on
//! the flushing task's runtime) and the committer thread (checkpoints and background
//! commits).
//! Not here: the per-request data path (`volume`), formats (`format`, `journal`).
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
//! ([`PoolInner::commit`]); flushes waiting for the lock share the cycle that began
//! after they did. The committer thread runs the cycles that must be checkpoints,
//! background commits, and the flushes of callers on no runtime.
//!
//! When no log record is pending (every one logged is durable), a flush needs only
//! step 2, and the flushing task issues that `fdatasync` itself;
//! flushes that arrive while one runs share the next.
//!
//! A *checkpoint* (when half the log is used or a commit would not fit, at open, and at
//! close) snapshots the metadata under all the locks, writes the snapshot into free data
//! units, `fdatasync`s (data and chunks), then writes the other superblock slot pointing
//! at it with the log restarting at the current position, and `fdatasync`s. Until that
//! last write the old superblock, checkpoint and log describe the pool; after it, the
//! new ones do. The checkpoint at open also moves the log's sequence numbers past any
//! batch a crash may have left beyond the replayed end of the log.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex, RwLock};
use tokio::sync::oneshot;
use zerocopy::IntoBytes;

use crate::error::{Error, ErrorKind, Result};
use crate::format::*;
use crate::io::{self, AlignedBuf, Dir, IoOptions, IoRing, Segment};
use crate::journal::{self, Geometry, LogCursor, Record, State, VolumeMeta};
use crate::meta::{Allocator, MapTable, PendingMark, RefcountTable, StripedCounts};
use crate::room::{self, NeedRoom, Tries};
use crate::volume::{worker_gone, Volume};

/// Default pool size for a newly created pool file: 64 GiB (sparse).
pub const DEFAULT_POOL_SIZE: u64 = 64 << 30;
/// Default data-unit size: 64 KiB.
pub const DEFAULT_UNIT_SIZE: u32 = 64 * 1024;
/// Largest volume: 1 PiB.
pub const MAX_VOLUME_SIZE: u64 = 1 << 50;
/// Longest volume name, in bytes.
pub const MAX_NAME_LEN: usize = 128;
/// Seconds after which the committer commits completed writes nobody flushed.
const COMMIT_INTERVAL_SECS: u64 = 5;
/// Pending log bytes that make the committer write them without a flush request.
const BACKGROUND_COMMIT_BYTES: usize = 256 * 1024;

/// How to create and open a pool.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Size in bytes for a new pool file (ignored for block devices, whose size is used).
    pub size: u64,
    /// Data-unit (allocation-unit) size in bytes: a power of two from 16 KiB to 128 KiB.
    pub unit_size: u32,
    /// How the pool's io_uring is set up (not stored in the pool).
    pub io: IoOptions,
    /// Open the pool from its one valid superblock slot even when the other slot is
    /// damaged and may have held the newer generation, accepting the loss of whatever
    /// was committed after the valid one (on-disk-format.md 7.1). Off by default: such
    /// a pool is refused with [`ErrorKind::Corrupt`].
    pub accept_superblock_rollback: bool,
    /// Open the pool even if a log batch is damaged with a later commit intact behind
    /// it, replaying the log up to the damaged batch and dropping the commits from it
    /// on (on-disk-format.md 4.5). Off by default: such a pool is refused with
    /// [`ErrorKind::Corrupt`].
    pub accept_log_loss: bool,
    /// Allocate every block of a pool file on the host file system (`fallocate`) at
    /// create and at open, so that no write to the pool ever needs room from the host:
    /// a thin pool on a thick file. Ignored for block devices, which need none.
    pub preallocate: bool,
}

impl PoolOptions {
    fn accept(&self) -> journal::Accept {
        journal::Accept { superblock_rollback: self.accept_superblock_rollback, log_loss: self.accept_log_loss }
    }
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            size: DEFAULT_POOL_SIZE,
            unit_size: DEFAULT_UNIT_SIZE,
            io: IoOptions::default(),
            accept_superblock_rollback: false,
            accept_log_loss: false,
            preallocate: false,
        }
    }
}

/// A volume as listed by the management API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Name (also the NBD export name): `VOLUME` or, for a snapshot, `VOLUME@SNAPSHOT`.
    pub name: String,
    /// Id, unique for the pool's lifetime.
    pub id: u64,
    /// Whether this is a read-only snapshot.
    pub snapshot: bool,
    /// Virtual size in bytes.
    pub size: u64,
    /// Bytes of data units mapped (units × unit size).
    pub allocated: u64,
    /// Bytes of mapped units no other volume or snapshot references: what deleting
    /// this one would free.
    pub exclusive: u64,
    /// Bytes of mapped units shared with other volumes or snapshots.
    pub shared: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created: u64,
}

/// Pool-wide space accounting, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// Pool UUID, hyphenated.
    pub uuid: String,
    /// Path of the pool file or device.
    pub path: PathBuf,
    /// Bytes of the data area (units × unit size).
    pub capacity: u64,
    /// Bytes in data units referenced by volumes.
    pub used: u64,
    /// Bytes in units holding checkpoint metadata.
    pub metadata: u64,
    /// Bytes in free units (including units whose free is not yet durable).
    pub free: u64,
    /// Of `free`, the bytes freed by deletes, trims and copies on write whose free is
    /// not yet durable: they become allocatable after the next commit (reclaim is
    /// no more than this wait; nothing is copied or rewritten).
    pub freeing: u64,
    /// Of `free`, the bytes data writes may not allocate: the metadata reserve, room
    /// for the next checkpoints (docs/on-disk-format.md, section 9). It grows with
    /// the metadata, so `free - reserved` is an upper bound on what writes to unmapped
    /// ranges can still take (at most a few percent high with 16 KiB units on an
    /// emptier pool, exact when full); a write that needs more gets `ENOSPC`.
    pub reserved: u64,
    /// Data-unit size.
    pub unit_size: u32,
    /// Number of volumes, snapshots included (each snapshot is a read-only volume).
    pub volumes: u64,
    /// Whether the pool file is opened with O_DIRECT.
    pub direct_io: bool,
    /// Whether the pool stopped accepting writes after an I/O error.
    pub failed: bool,
}

/// What the last [`Pool::open`] read to recover the pool: the checkpoint and the log
/// batches after it. Recovery reads grow with these, never with the pool's size (the
/// data area is not scanned; see docs/on-disk-format.md, section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Log batches replayed on top of the checkpoint.
    pub batches_replayed: u64,
    /// Bytes read from the pool: superblocks, checkpoint chunks and log batches.
    pub bytes_read: u64,
}

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
    /// Writes, trims and zeroes hold it shared for their whole duration; taking a
    /// snapshot or clone of this volume holds it exclusively, so the point in time
    /// falls between writes, never inside one.
    pub gate: tokio::sync::RwLock<()>,
}

impl VolState {
    fn new(id: u64, name: String, snapshot: bool, created: u32, size: u64, map: MapTable) -> VolState {
        VolState {
            id,
            name,
            snapshot,
            created,
            size: AtomicU64::new(size),
            map: RwLock::new(map),
            deleted: AtomicBool::new(false),
            gate: tokio::sync::RwLock::new(()),
        }
    }
}

/// Metadata records waiting for the next commit.
#[derive(Default)]
pub(crate) struct Journal {
    pub bytes: Vec<u8>,
}

#[derive(Default)]
struct Commits {
    queue: Mutex<CommitQueue>,
    cv: Condvar,
}

#[derive(Default)]
struct CommitQueue {
    waiters: Vec<oneshot::Sender<Result<(), ErrorKind>>>,
    /// The next cycle is a checkpoint ([`PoolInner::checkpoint_async`]).
    checkpoint: bool,
    background: bool,
    shutdown: bool,
    /// The spare should grow (room.rs); these wait for it.
    grow: bool,
    grow_waiters: Vec<oneshot::Sender<Result<(), ErrorKind>>>,
}

/// Committer-only state: the log cursor and the current superblock.
struct LogState {
    cursor: LogCursor,
    sb: Superblock,
    checkpoint_units: Vec<u32>,
}

pub(crate) struct PoolInner {
    pub path: PathBuf,
    /// The pool file or device (for what the ring does not do: its holes, its room).
    pub file: Arc<File>,
    /// Every unit is backed by blocks of the host (a block device, or a preallocated
    /// file): the spare needs no writes to back it (room.rs).
    pub backed_all: AtomicBool,
    /// The host file system refused room for a write (ENOSPC): allocations look for
    /// units the pool file already holds blocks for (room.rs) until it has room again.
    pub host_full: AtomicBool,
    pub ring: IoRing,
    pub direct: bool,
    pub geo: Geometry,
    pub volumes: RwLock<BTreeMap<String, Arc<VolState>>>,
    next_volume: AtomicU64,
    pub alloc: Mutex<Allocator>,
    /// The allocator's refcounts, for lock-free reads on the data path.
    pub refcounts: Arc<RefcountTable>,
    /// The allocator's settling counts, readable without its lock: non-zero means the
    /// unit may be exclusive only by changes not yet durable, so writes copy it.
    pub settling: Arc<StripedCounts>,
    pub journal: Mutex<Journal>,
    /// In-flight I/O per data unit (striped); a unit that may be pinned is never made
    /// allocatable.
    pub pins: StripedCounts,
    /// Data writes completed since the last commit's fdatasync started.
    pub writes_since_sync: AtomicU64,
    /// What the open read to recover the pool.
    recovery: Recovery,
    /// Log records appended so far (counted under the journal lock).
    pub records_logged: AtomicU64,
    /// Of those, how many are durable (the first N, by a completed commit or checkpoint).
    pub records_durable: AtomicU64,
    pub failed: AtomicBool,
    /// Set by [`Pool::close`]: later writes are refused.
    closed: AtomicBool,
    /// Range locks, striped by (volume, logical unit): a write holds its units' stripes
    /// from before it reads partial blocks until its bitmap bits are set, exclusively
    /// where it rewrites a partial block (read-modify-write), shared elsewhere; a trim
    /// holds its units' stripes exclusively while it clears bits and unmaps. So a
    /// read-modify-write never writes back stale bytes over a concurrent write, and a
    /// trim never unmaps a unit under a write that has not set its bits yet.
    pub stripes: Box<[tokio::sync::RwLock<()>]>,
    /// Locks for copy-on-write of one logical unit, striped by (volume, unit).
    pub cow_stripes: Box<[tokio::sync::Mutex<()>]>,
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
}

/// A pool of thin volumes on one file or block device. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

fn now() -> u32 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as u32).unwrap_or(0)
}

/// The error of a change whose metadata finds no room: the pool (or the host file
/// system under it) is full.
fn metadata_full() -> Error {
    Error::new(
        ErrorKind::NoSpace,
        "the pool is too full for the metadata this change adds (its next checkpoints must fit); \
         delete snapshots or volumes to free space",
    )
}

/// Refuses a new volume `name` while snapshots of a deleted volume of that name remain
/// (they would otherwise appear to belong to the new one).
fn check_no_orphan_snapshots(vols: &BTreeMap<String, Arc<VolState>>, name: &str) -> Result<()> {
    let prefix = format!("{name}@");
    match vols.range(prefix.clone()..).next() {
        Some((k, _)) if k.starts_with(&prefix) => Err(Error::new(
            ErrorKind::AlreadyExists,
            format!("snapshots of an earlier volume '{name}' remain (e.g. {k}); delete them or choose another name"),
        )),
        _ => Ok(()),
    }
}

/// Checks a volume name: 1..=128 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.starts_with('.')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "name '{}' is invalid: use 1 to {MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ - (not starting with . or -)",
                crate::error::shown_name(name)
            ),
        ))
    }
}

fn validate_size(size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(BLOCK_SIZE) || size > MAX_VOLUME_SIZE {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("volume size {size} must be a non-zero multiple of 4096 bytes and at most 1 PiB"),
        ));
    }
    Ok(())
}

pub(crate) fn read_at_file(file: &File) -> impl FnMut(u64, usize) -> std::io::Result<Vec<u8>> + '_ {
    use std::os::unix::fs::FileExt;
    move |off, len| {
        let mut v = vec![0u8; len];
        file.read_exact_at(&mut v, off)?;
        Ok(v)
    }
}

/// Locks the pool file, retrying for up to 3 s: after a process is killed with I/O in
/// flight, the kernel releases its files (and their locks) a little after it is reaped.
fn lock(file: &File, exclusive: bool, path: &Path) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match io::lock_file(file, exclusive) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() >= deadline {
                    return Err(Error::new(
                        ErrorKind::InUse,
                        format!("{} is in use by another process (a running server?)", path.display()),
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(format!("lock {}", path.display()), e)),
        }
    }
}

/// Where [`Pool::create`] formats a new pool file before moving it to `path`.
fn creating_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".creating");
    path.with_file_name(name)
}

/// `fsync` of the directory holding `path`, so that a rename into it is durable.
fn sync_parent_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Result of [`check`].
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// Problems found; empty means the pool is consistent.
    pub problems: Vec<String>,
    /// What the pool opens despite: damage with no loss (a damaged older superblock
    /// slot, which the next checkpoint rewrites), and, in a pool of format version 1 or
    /// 2 only, valid log batches behind the end of the replayed log, which a crash
    /// during a commit leaves but a damaged batch of an earlier commit also does (then
    /// the commits after it were lost). From version 3 on the second case is an error.
    pub warnings: Vec<String>,
    /// Volumes, units mapped, units free, units of metadata, log batches replayed.
    pub summary: String,
}

/// What is wrong with the loaded volumes that checksums cannot catch (a record written
/// wrong, or damage whose checksum was recomputed): invalid or duplicate names, sizes
/// that are not a multiple of 4096 or past 1 PiB, mappings past a volume's end, and
/// written-block bits past a unit's blocks. Run by [`check`], and by open, which
/// refuses such a pool rather than serve and keep the damage.
fn volume_problems(st: &State, bpu: u64) -> Vec<String> {
    let mut problems = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (id, v) in &st.volumes {
        let name_ok = match v.name.split_once('@') {
            Some((vol, snap)) => v.snapshot && validate_name(vol).is_ok() && validate_name(snap).is_ok(),
            None => !v.snapshot && validate_name(&v.name).is_ok(),
        };
        if !name_ok || !names.insert(v.name.clone()) {
            problems.push(format!("volume {id} has an invalid or duplicate name '{}'", v.name));
        }
        if validate_size(v.size).is_err() {
            problems.push(format!("volume '{}' has an invalid size {}", v.name, v.size));
        }
        let units = st.units_of(v.size);
        for (lunit, e) in v.map.mapped() {
            if lunit >= units {
                problems.push(format!("volume '{}' maps logical unit {lunit} past its end", v.name));
            }
            if bpu < 32 && e.bitmap >> bpu != 0 {
                problems.push(format!(
                    "volume '{}' logical unit {lunit} has bitmap bits past the unit's {bpu} blocks",
                    v.name
                ));
            }
        }
    }
    problems
}

/// Verifies a stopped pool without writing to it: superblock, checkpoint and log
/// checksums, mappings against refcounts, and free-space accounting.
///
/// Errors: the file cannot be opened or read, or is not a pool at all
/// ([`ErrorKind::Corrupt`]); inconsistencies that do not stop loading are listed in
/// the report instead.
pub fn check(path: &Path) -> Result<CheckReport> {
    let file = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    lock(&file, false, path)?;
    let size = io::device_size(&file).map_err(|e| Error::io("size of pool", e))?;
    let mut read = read_at_file(&file);
    let loaded = journal::load(&mut read, size, journal::Accept::default())?;
    let mut problems = Vec::new();
    let warnings: Vec<String> = loaded.superblock_warning.iter().chain(loaded.log_warning.iter()).cloned().collect();
    for (u, stored, derived) in &loaded.refcount_mismatches {
        problems
            .push(format!("checkpoint refcount of data unit {u} is {stored} but {derived} mapping pages reference it"));
    }
    let st = &loaded.state;
    problems.extend(volume_problems(st, loaded.geo.blocks_per_unit()));
    let derived = journal::derive_refcounts(st.volumes.values().map(|v| &v.map), loaded.geo.unit_count as usize);
    let a = &st.alloc;
    let (mut used, mut meta, mut free) = (0u64, 0u64, 0u64);
    for u in 0..a.unit_count() as u32 {
        let (r, should) = (a.refcount(u), derived.refcount(u));
        match r {
            crate::meta::META => meta += 1,
            0 => free += 1,
            _ => used += 1,
        }
        if r != crate::meta::META && r != should {
            problems.push(format!("data unit {u} has refcount {r} but {should} mapping pages reference it"));
        }
    }
    if meta != loaded.checkpoint_units.len() as u64 {
        problems.push(format!(
            "{} units marked as metadata but the checkpoint has {}",
            meta,
            loaded.checkpoint_units.len()
        ));
    }
    if used + meta + free != loaded.geo.unit_count || a.free_count() != free {
        problems.push(format!(
            "free-space accounting: {used} used + {meta} metadata + {free} free != {} units (allocator free {})",
            loaded.geo.unit_count,
            a.free_count()
        ));
    }
    let summary = format!(
        "pool {}: {} volumes, {} units of {} KiB: {used} mapped, {meta} metadata, {free} free; {} log batches replayed",
        uuid::Uuid::from_bytes(loaded.geo.uuid),
        st.volumes.len(),
        loaded.geo.unit_count,
        loaded.geo.unit_size / 1024,
        loaded.batches
    );
    Ok(CheckReport { problems, warnings, summary })
}

/// One refcount [`repair`] changed: `(data unit, refcount found, refcount now)`, the
/// latter the number of distinct mapping pages that map the unit.
pub type RefcountRepair = (u32, u32, u32);

/// What [`repair`] did.
#[derive(Debug, Clone)]
pub struct RepairReport {
    /// Each refcount changed, in ascending unit order. Empty: nothing needed repair.
    pub changed: Vec<RefcountRepair>,
    /// Units referenced by no mapping that were held as used (leaked): free now.
    pub freed: u64,
    /// The summary of [`check`] on the repaired pool.
    pub summary: String,
}

/// Repairs a stopped pool whose refcounts disagree with its mappings (what `check`
/// reports as refcount mismatches, and open refuses): loads it as open does, rebuilds
/// every refcount from the mappings (the number of distinct mapping pages that map
/// each unit) and the free set from those, and writes a fresh checkpoint. Each change
/// is in the report. The mappings are the source of truth and are not changed; a
/// pool whose mappings or records are damaged is refused, and so is one `check`
/// finds nothing wrong with (nothing is written then).
///
/// Errors: [`ErrorKind::Corrupt`] when the pool does not load or its mappings are
/// damaged (the message says so: a repair cannot fix those); [`ErrorKind::InUse`] when
/// a server has it open; [`ErrorKind::Io`].
pub fn repair(path: &Path) -> Result<RepairReport> {
    let before = check(path)?;
    let mut changed = Vec::new();
    if !before.problems.is_empty() {
        let pool = Pool::open_inner(path, &IoOptions::default(), journal::Accept::default(), false, Some(&mut changed))
            .map_err(|e| e.op("repair pool"))?;
        pool.close().map_err(|e| e.op("repair pool"))?;
    }
    let after = check(path)?;
    if let Some(p) = after.problems.first() {
        return Err(Error::corrupt(format!(
            "{p} ({} problem(s) left that a repair of the refcounts cannot fix)",
            after.problems.len()
        ))
        .op("repair pool"));
    }
    let freed = changed.iter().filter(|(_, _, now)| *now == 0).count() as u64;
    Ok(RepairReport { changed, freed, summary: after.summary })
}

/// Replaces the refcounts of `st` (a loaded pool, its log replayed) by those its
/// mappings imply, and its free set by what follows from them; returns each change.
///
/// Errors: [`ErrorKind::Corrupt`] when a mapped unit is also a unit of the checkpoint
/// (`checkpoint_units`): the mappings are damaged.
fn rebuild_refcounts(st: &mut State, checkpoint_units: &[u32]) -> Result<Vec<RefcountRepair>> {
    let units = st.alloc.unit_count() as usize;
    let derived = journal::derive_refcounts(st.volumes.values().map(|v| &v.map), units);
    let mut changed = Vec::new();
    for u in 0..units as u32 {
        let (found, should) = (st.alloc.refcount(u), derived.refcount(u));
        if found == crate::meta::META {
            if should > 0 {
                return Err(Error::corrupt(format!(
                    "data unit {u} is mapped and holds the checkpoint: the mappings are damaged, and a repair \
                     rebuilds only what derives from them: restore the pool from a copy"
                )));
            }
        } else if found != should {
            changed.push((u, found, should));
        }
    }
    if !changed.is_empty() {
        let mut a = Allocator::new(units);
        for &u in checkpoint_units {
            a.set_loaded(u, crate::meta::META);
        }
        for (u, r) in derived.nonzero_refcounts() {
            a.set_loaded(u, r);
        }
        a.counts = st.alloc.counts;
        st.alloc = a;
        for &(u, found, should) in &changed {
            tracing::warn!(unit = u, found, now = should, "repaired the refcount of a data unit");
        }
    }
    Ok(changed)
}

impl Pool {
    /// Opens the pool at `path`, or creates it with `opts` if the file does not exist.
    ///
    /// Errors: see [`Pool::open`] and [`Pool::create`].
    pub fn open_or_create(path: &Path, opts: &PoolOptions) -> Result<Pool> {
        if path.exists() {
            Pool::open_inner(path, &opts.io, opts.accept(), opts.preallocate, None)
        } else {
            Pool::create(path, opts)
        }
    }

    /// Opens the pool on block device `path`, or, if neither superblock slot carries
    /// the pool magic, formats the whole device as a new pool (destroying what it
    /// held). A device with a damaged ferrovol superblock is refused, never formatted.
    ///
    /// Errors: as [`Pool::open`] and [`Pool::create`].
    pub fn open_or_format_device(path: &Path, opts: &PoolOptions) -> Result<Pool> {
        match Pool::open_inner(path, &opts.io, opts.accept(), opts.preallocate, None) {
            Err(e)
                if e.kind() == ErrorKind::Corrupt
                    && e.message().matches("superblock magic is missing").count() == 2 =>
            {
                tracing::warn!(path = %path.display(), "no ferrovol pool on the device; formatting it");
                Pool::create(path, opts)
            }
            r => r,
        }
    }

    /// Creates a pool: a new sparse file of `opts.size` bytes, or an existing block
    /// device (its whole size). Refuses to overwrite an existing regular file. A new
    /// file is formatted as `<path>.creating` and renamed to `path` once durable, so an
    /// interrupted create leaves no file at `path`.
    ///
    /// Errors: [`ErrorKind::AlreadyExists`] for an existing file,
    /// [`ErrorKind::InvalidArgument`] for a bad unit size or a pool too small,
    /// [`ErrorKind::Io`].
    pub fn create(path: &Path, opts: &PoolOptions) -> Result<Pool> {
        let unit = opts.unit_size;
        if !unit.is_power_of_two() || !(MIN_UNIT_SIZE..=MAX_UNIT_SIZE).contains(&unit) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("unit size {unit} must be a power of two from 16 KiB to 128 KiB"),
            ));
        }
        let is_dev = std::fs::metadata(path).map(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_block_device()
        });
        let is_dev = match is_dev {
            Ok(true) => true,
            Ok(false) => {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("{} exists; refusing to overwrite it", path.display()),
                ))
            }
            Err(_) => false,
        };
        // A new file is formatted under a temporary name beside `path` and moved into
        // place only once both superblocks are durable: a crash or kill during creation
        // never leaves a file at `path` that is not a pool (which every later start would
        // call corrupt). A leftover of such a crash is reused; its lock keeps two
        // creators apart.
        let creating = (!is_dev).then(|| creating_path(path));
        let target = creating.as_deref().unwrap_or(path);
        let (file, _direct) =
            io::open_pool_file(target, !is_dev).map_err(|e| Error::io(format!("create {}", target.display()), e))?;
        lock(&file, true, target)?;
        let remove_creating = || {
            if let Some(c) = &creating {
                let _ = std::fs::remove_file(c);
            }
        };
        let discard = |e: Error| {
            remove_creating();
            e
        };
        if !is_dev {
            file.set_len(0).map_err(|e| discard(Error::io("truncate a leftover pool file", e)))?;
        }
        let size = if is_dev { io::device_size(&file).map_err(|e| Error::io("size of device", e))? } else { opts.size };
        let log_size = (size / 64).clamp(4 * MAX_BATCH_BYTES as u64, 64 << 20) / BLOCK_SIZE * BLOCK_SIZE;
        let unit = u64::from(unit);
        let data_offset = (LOG_OFFSET + log_size).div_ceil(unit) * unit;
        let unit_count = size.saturating_sub(data_offset) / unit;
        if unit_count < 64 || unit_count >= u64::from(u32::MAX) {
            remove_creating();
            // The bounds in bytes, for this unit size (the log's size grows with the pool's).
            let offset_for = |log: u64| (LOG_OFFSET + log).div_ceil(unit) * unit;
            let message = if unit_count < 64 {
                let min = offset_for(4 * MAX_BATCH_BYTES as u64) + 64 * unit;
                format!(
                    "pool size {size} bytes is too small: with {unit}-byte data units a pool needs at least \
                     {min} bytes (its superblocks, log and 64 data units)"
                )
            } else {
                let max = offset_for(64 << 20) + (u64::from(u32::MAX) - 1) * unit;
                format!(
                    "pool size {size} bytes is too large: with {unit}-byte data units a pool holds at most \
                     2^32-2 units ({max} bytes); choose a larger unit size"
                )
            };
            return Err(Error::new(ErrorKind::InvalidArgument, message));
        }
        if !is_dev {
            // Checked above: a size past the unit count's bound never reaches the file
            // system (which says only "out of range").
            file.set_len(size).map_err(|e| discard(Error::io("size pool file", e)))?;
        }
        let mut sb = Superblock {
            magic: SUPERBLOCK_MAGIC,
            version: FORMAT_VERSION.into(),
            header_size: (size_of::<Superblock>() as u32).into(),
            pool_uuid: *uuid::Uuid::new_v4().as_bytes(),
            pool_size: size.into(),
            unit_size: (unit as u32).into(),
            block_size: (BLOCK_SIZE as u32).into(),
            log_offset: LOG_OFFSET.into(),
            log_size: log_size.into(),
            data_offset: data_offset.into(),
            unit_count: unit_count.into(),
            generation: 0.into(),
            checkpoint_unit: NO_UNIT.into(),
            checkpoint_chunks: 0.into(),
            checkpoint_seq: 0.into(),
            log_head: 0.into(),
            features: 0.into(),
            reserved: [0; 120],
            crc: 0.into(),
            pad: 0.into(),
        };
        let file = Arc::new(file);
        let ring = IoRing::new(file.clone(), 256, &IoOptions::default())
            .map_err(|e| discard(Error::io("set up io_uring", e)))?;
        // Zero the log, so that no stale batch of a former pool can look current and
        // the host file system holds blocks for all of it (a log write never needs room
        // there), then write both superblock slots (generations 0 and 1).
        let formatted = (|| {
            if opts.preallocate && !is_dev {
                io::allocate(&file, 0, size).map_err(|e| Error::io("preallocate the pool file", e))?;
            }
            let zeros = AlignedBuf::zeroed(1 << 20);
            let mut at = LOG_OFFSET;
            while at < LOG_OFFSET + log_size {
                let len = (LOG_OFFSET + log_size - at).min(1 << 20);
                write_blocks(&ring, at, &zeros.full()[..len as usize])?;
                at += len;
            }
            for g in 0..2u64 {
                sb.generation = g.into();
                sb.crc = sb.compute_crc().into();
                write_blocks(&ring, SUPERBLOCK_OFFSETS[(g % 2) as usize], sb.as_bytes())?;
            }
            sync(&ring)
        })();
        drop(ring);
        formatted.map_err(discard)?;
        if let Some(c) = &creating {
            // Only this creator holds the lock on `c`, and `path` did not exist above.
            if path.exists() {
                return Err(discard(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("{} appeared while the pool was created; refusing to overwrite it", path.display()),
                )));
            }
            std::fs::rename(c, path).map_err(|e| discard(Error::io(format!("create {}", path.display()), e)))?;
            sync_parent_dir(path).map_err(|e| Error::io(format!("sync the directory of {}", path.display()), e))?;
        }
        drop(file); // releases the lock for open()
        tracing::info!(path = %path.display(), size, unit_size = unit, "created pool");
        Pool::open_inner(path, &opts.io, journal::Accept::default(), opts.preallocate, None)
    }

    /// Opens an existing pool: reads the superblock and checkpoint, replays the log.
    /// Nothing is written before all of it validated.
    ///
    /// Errors: [`ErrorKind::Corrupt`] naming what is wrong (not a pool, checksum
    /// mismatch with its location, unsupported version, inconsistent refcounts, one
    /// superblock slot damaged when it may have held the newer generation: see
    /// [`PoolOptions::accept_superblock_rollback`]; a damaged log batch with a later
    /// commit behind it: see [`PoolOptions::accept_log_loss`]); [`ErrorKind::Io`].
    pub fn open(path: &Path) -> Result<Pool> {
        Pool::open_with(path, &IoOptions::default())
    }

    /// [`Pool::open`] with its io_uring set up as `io` says.
    ///
    /// Errors: as [`Pool::open`].
    pub fn open_with(path: &Path, io: &IoOptions) -> Result<Pool> {
        Pool::open_inner(path, io, journal::Accept::default(), false, None)
    }

    /// Opens the pool; with `repair`, rebuilds its refcounts from its mappings first
    /// (instead of refusing a pool whose refcounts disagree with them) and lists each
    /// change there: [`repair`].
    fn open_inner(
        path: &Path,
        io: &IoOptions,
        accept: journal::Accept,
        preallocate: bool,
        repair: Option<&mut Vec<RefcountRepair>>,
    ) -> Result<Pool> {
        let (file, direct) =
            io::open_pool_file(path, false).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
        lock(&file, true, path)?;
        let size = io::device_size(&file).map_err(|e| Error::io("size of pool", e))?;
        let is_dev = {
            use std::os::unix::fs::FileTypeExt;
            file.metadata().map_err(|e| Error::io("stat pool", e))?.file_type().is_block_device()
        };
        let mut bytes_read = 0u64;
        let loaded = {
            let plain = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
            let mut read_file = read_at_file(&plain);
            let mut read = |off: u64, len: usize| {
                bytes_read += len as u64;
                read_file(off, len)
            };
            journal::load(&mut read, size, accept).map_err(|e| e.op("open pool"))?
        };
        for w in loaded.superblock_warning.iter().chain(loaded.log_warning.iter()) {
            tracing::warn!(path = %path.display(), "{w}");
        }
        let mut loaded = loaded;
        let damaged = volume_problems(&loaded.state, loaded.geo.blocks_per_unit());
        if let Some(first) = damaged.first() {
            let what = if repair.is_some() {
                "; the mappings themselves are damaged, and a repair rebuilds only what derives from them: \
                 restore the pool from a copy"
            } else {
                "; run `ferrovol check`"
            };
            return Err(Error::corrupt(format!(
                "{first} ({} problem(s) in the volumes' records){what}",
                damaged.len()
            ))
            .op("open pool"));
        }
        if let Some(changes) = repair {
            *changes = rebuild_refcounts(&mut loaded.state, &loaded.checkpoint_units)?;
        } else if let Some((u, stored, derived)) = loaded.refcount_mismatches.first() {
            return Err(Error::corrupt(format!(
                "checkpoint refcount of data unit {u} is {stored} but {derived} mapping pages reference it ({} mismatches); \
                 stop the server and run `ferrovol check --repair`, which rebuilds the refcounts from the mappings",
                loaded.refcount_mismatches.len()
            )));
        }
        if !direct {
            tracing::warn!(path = %path.display(), "file system refuses O_DIRECT; using buffered I/O");
        }
        if preallocate && !is_dev {
            io::allocate(&file, 0, size).map_err(|e| Error::io("preallocate the pool file", e).op("open pool"))?;
        }
        let file = Arc::new(file);
        let ring = IoRing::new(file.clone(), 256, io).map_err(|e| Error::io("set up io_uring", e))?;
        let journal::Loaded { sb, geo, state, log, checkpoint_units, batches, highest_seq, .. } = loaded;
        let upgrade = sb.version.get() < FORMAT_VERSION;
        let State { volumes, next_volume, mut alloc, .. } = state;
        debug_assert_eq!(
            alloc.counts,
            crate::meta::MetaCounts::of(volumes.values().map(|v| (&v.map, v.name.len()))),
            "metadata counts kept through replay"
        );
        alloc.checkpoint_units = checkpoint_units.len() as u64;
        let vols = volumes
            .into_iter()
            .map(|(id, v)| {
                let vs = VolState::new(id, v.name.clone(), v.snapshot, v.created, v.size, v.map);
                (v.name, Arc::new(vs))
            })
            .collect::<BTreeMap<_, _>>();
        let pins = StripedCounts::new();
        tracing::info!(path = %path.display(), volumes = vols.len(), batches, bytes_read, direct, "opened pool");
        let inner = Arc::new(PoolInner {
            path: path.to_owned(),
            file,
            backed_all: AtomicBool::new(is_dev || preallocate),
            host_full: AtomicBool::new(false),
            ring,
            direct,
            geo,
            volumes: RwLock::new(vols),
            next_volume: AtomicU64::new(next_volume),
            refcounts: alloc.refcount_table(),
            settling: alloc.settling_table(),
            alloc: Mutex::new(alloc),
            journal: Mutex::new(Journal::default()),
            pins,
            writes_since_sync: AtomicU64::new(0),
            recovery: Recovery { batches_replayed: batches, bytes_read },
            records_logged: AtomicU64::new(0),
            records_durable: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            // 4096, so that a trim of a whole mapping page (512 units) holds an eighth
            // of them at a time, not all.
            stripes: (0..4096).map(|_| tokio::sync::RwLock::new(())).collect(),
            cow_stripes: (0..256).map(|_| tokio::sync::Mutex::new(())).collect(),
            commits: Arc::new(Commits::default()),
            log: tokio::sync::Mutex::new(LogState { cursor: log, sb, checkpoint_units }),
            committer: Mutex::new(None),
            sync_turn: tokio::sync::Mutex::new(()),
            syncs_started: AtomicU64::new(0),
            syncs_done: AtomicU64::new(0),
            cycles_started: AtomicU64::new(0),
            cycles_done: AtomicU64::new(0),
        });
        // Checkpoint at once, moving the log's sequence numbers past any batch that a
        // crash may have left beyond the end of the replayed log (a batch written while
        // an earlier one of the same commit was torn), and past every valid batch in
        // the log region (after a rollback, those of the generation it dropped).
        // Replay then never reaches one.
        let jump = (inner.geo.log_size / BLOCK_SIZE + 1).max(highest_seq - log.seq + 1);
        // The spare first: the checkpoint takes its units from it (room.rs).
        inner.prepare_at_open().map_err(|e| e.op("open pool"))?;
        inner.checkpoint(jump).map_err(|e| e.op("open pool"))?;
        if upgrade {
            // The checkpoint wrote one slot in this build's format; write the other
            // too, so that no slot is left that an older build could open from.
            inner.rewrite_superblock().map_err(|e| e.op("open pool"))?;
        }
        let weak = Arc::downgrade(&inner);
        let commits = inner.commits.clone();
        let handle = std::thread::Builder::new()
            .name("ferrovol-commit".into())
            .spawn(move || committer(weak, commits))
            .map_err(|e| Error::io("start committer", e))?;
        *inner.committer.lock() = Some(handle);
        Ok(Pool { inner })
    }

    /// Creates a thin volume of `size` bytes (a multiple of 4096). Durable on return.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (name, size), [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::Failed`]/[`ErrorKind::Io`] if the commit fails.
    pub async fn create_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("create volume").volume(name);
        validate_name(name).map_err(err)?;
        validate_size(size).map_err(err)?;
        self.inner.check_writable().map_err(err)?;
        let mut tries = Tries::default();
        loop {
            let need = {
                let mut vols = self.inner.volumes.write();
                if vols.contains_key(name) {
                    return Err(err(Error::new(ErrorKind::AlreadyExists, "a volume of that name exists")));
                }
                check_no_orphan_snapshots(&vols, name).map_err(err)?;
                let extra = room::volume_record_bytes(name.len());
                let mut a = self.inner.alloc.lock();
                if self.inner.has_room(&a, extra) {
                    let id = self.inner.next_volume.fetch_add(1, Ordering::SeqCst);
                    let created = now();
                    let vs = VolState::new(id, name.to_owned(), false, created, size, MapTable::new());
                    self.inner.log_record(&Record::Volume { volume: id, size, created, name: name.to_owned() });
                    a.counts.volumes += 1;
                    a.counts.name_bytes += name.len() as u64;
                    self.inner.after_growth(&a);
                    drop(a);
                    vols.insert(name.to_owned(), Arc::new(vs));
                    break;
                }
                NeedRoom { units: 0, extra }
            };
            if !self.inner.make_room(need, &mut tries).await.map_err(err)? {
                return Err(err(metadata_full()));
            }
        }
        self.inner.commit().await.map_err(err)?;
        tracing::info!(volume = name, size, "created volume");
        self.volume_info(name)
    }

    /// Deletes a volume and frees the data units only it referenced (after the delete
    /// is durable); its snapshots and clones stay intact. Open handles fail with
    /// [`ErrorKind::NotFound`] from then on. Costs in-memory metadata work proportional
    /// to the volume's mapped pages and one log record; no data is read or rewritten.
    /// In a pool too full to allocate, also asks for a checkpoint in the background,
    /// which gives back the room the deleted metadata held (a snapshot, clone or write
    /// that needs the room before then takes a checkpoint itself).
    ///
    /// Errors: [`ErrorKind::NotFound`] (also for a snapshot name: use
    /// [`Pool::delete_snapshot`]), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn delete_volume(&self, name: &str) -> Result<()> {
        if name.contains('@') {
            return Err(Error::new(ErrorKind::NotFound, "no such volume (a snapshot is deleted with snapshot delete)")
                .op("delete volume")
                .volume(name));
        }
        self.delete_any(name, "delete volume").await
    }

    /// Deletes snapshot `snapshot` of `volume`; space only it held is freed at once
    /// (its metadata's share by a checkpoint in a pool too full to allocate, as
    /// [`Pool::delete_volume`]).
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        self.delete_any(&format!("{volume}@{snapshot}"), "delete snapshot").await
    }

    async fn delete_any(&self, name: &str, op: &'static str) -> Result<()> {
        let err = |e: Error| e.op(op).volume(name);
        self.inner.check_writable().map_err(err)?;
        {
            let mut vols = self.inner.volumes.write();
            let vs =
                vols.remove(name).ok_or_else(|| err(Error::new(ErrorKind::NotFound, "no such volume or snapshot")))?;
            let mut map = vs.map.write();
            vs.deleted.store(true, Ordering::SeqCst);
            // The record first: a commit that releases the settling marks and frees the
            // release causes also carries it (on-disk-format.md 6.1 rules 2, 9, 12).
            self.inner.log_record(&Record::VolumeDelete { volume: vs.id });
            let mut alloc = self.inner.alloc.lock();
            map.release_all(&mut alloc);
            alloc.counts.volumes -= 1;
            alloc.counts.name_bytes -= vs.name.len() as u64;
            self.inner.trim_spare(&mut alloc);
        }
        self.inner.commit().await.map_err(err)?;
        tracing::info!(name, op, "deleted");
        // In a pool too full to allocate, the units the current checkpoint holds beyond
        // what the next needs come back only with a checkpoint (room.rs). A change that
        // needs them checkpoints by itself; this asks for one in the background as well,
        // so that the room shows as free soon. Deletes made while it is pending share
        // it: a burst of deletes costs one or two checkpoints, not one each.
        let tight = {
            let a = self.inner.alloc.lock();
            a.free_count() == 0 && self.inner.checkpoint_lowers_need(&a)
        };
        if tight {
            self.inner.request_checkpoint();
        }
        Ok(())
    }

    /// Takes snapshot `snapshot` of `volume`: a read-only volume named
    /// `VOLUME@SNAPSHOT` that shares every mapping page (no data copied; the cost
    /// grows with the number of mapped pages, not with the size). It holds every write
    /// acknowledged before the call and none issued after the reply; writes in flight
    /// on this volume are waited for. Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`] (name), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn create_snapshot(&self, volume: &str, snapshot: &str) -> Result<VolumeInfo> {
        let full = format!("{volume}@{snapshot}");
        let err = |e: Error| e.op("create snapshot").volume(&full);
        validate_name(snapshot).map_err(err)?;
        self.share_or_checkpoint(volume, &full, true).await.map_err(err)
    }

    /// Writes a checkpoint now (docs/on-disk-format.md 6.3): the log is emptied, and the
    /// room held back for metadata is computed afresh from what the metadata takes.
    /// The engine checkpoints by itself when the log fills, when an allocation or a
    /// snapshot finds the room held back inflated by metadata changes since the last
    /// checkpoint, and (in the background) after a delete in a pool too full to
    /// allocate; this is for tools and tests.
    ///
    /// Errors: [`ErrorKind::Failed`] or [`ErrorKind::NoSpace`]: the pool failed
    /// earlier, is closing, or failed in this checkpoint (see `PoolInner::checkpoint_async`).
    pub async fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint_async().await.map_err(|e| e.op("checkpoint"))
    }

    /// [`Self::share`], making room for the metadata it adds when it finds none
    /// ([`PoolInner::make_room`]).
    async fn share_or_checkpoint(&self, source: &str, target: &str, snapshot: bool) -> Result<VolumeInfo> {
        let mut tries = Tries::default();
        loop {
            match self.share(source, target, snapshot).await? {
                Ok(info) => return Ok(info),
                Err(need) => {
                    if !self.inner.make_room(need, &mut tries).await? {
                        return Err(metadata_full());
                    }
                }
            }
        }
    }

    /// Creates writable volume `name` from `source` (`VOLUME@SNAPSHOT` or `VOLUME`),
    /// sharing its pages; the clone has its own lifetime (deleting the source leaves it
    /// intact). Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`] (name), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn clone_volume(&self, source: &str, name: &str) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("clone volume").volume(name);
        validate_name(name).map_err(err)?;
        self.share_or_checkpoint(source, name, false).await.map_err(err)
    }

    /// Shares `source` as `target`; `Ok(Err(need))` when the metadata it adds finds no
    /// room (nothing changed).
    async fn share(
        &self,
        source: &str,
        target: &str,
        snapshot: bool,
    ) -> Result<std::result::Result<VolumeInfo, NeedRoom>> {
        self.inner.check_writable()?;
        let src = self
            .inner
            .volumes
            .read()
            .get(source)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no volume or snapshot '{source}'")))?;
        if snapshot && src.snapshot {
            return Err(Error::new(ErrorKind::InvalidArgument, "snapshots are taken of volumes, not of snapshots"));
        }
        // Wait for writes in flight on the source, and hold new ones back briefly.
        let _quiet = src.gate.write().await;
        {
            let mut vols = self.inner.volumes.write();
            if vols.contains_key(target) {
                return Err(Error::new(ErrorKind::AlreadyExists, "a volume or snapshot of that name exists"));
            }
            if !snapshot {
                check_no_orphan_snapshots(&vols, target)?;
            }
            if src.deleted.load(Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::NotFound, format!("'{source}' was deleted")));
            }
            let map = src.map.read();
            // The new volume's record, and a reference to each page it shares.
            let extra = room::volume_record_bytes(target.len()) + room::PAGE_REF_BYTES * map.pages().count() as u64;
            let mut alloc = self.inner.alloc.lock();
            if !self.inner.has_room(&alloc, extra) {
                return Ok(Err(NeedRoom { units: 0, extra }));
            }
            let id = self.inner.next_volume.fetch_add(1, Ordering::SeqCst);
            let created = now();
            let size = src.size.load(Ordering::SeqCst);
            let shared = map.share(&mut alloc);
            alloc.counts.volumes += 1;
            alloc.counts.name_bytes += target.len() as u64;
            self.inner.after_growth(&alloc);
            drop(alloc);
            self.inner.log_record(&Record::Share {
                source: src.id,
                target: id,
                size,
                created,
                snapshot,
                name: target.to_owned(),
            });
            vols.insert(
                target.to_owned(),
                Arc::new(VolState::new(id, target.to_owned(), snapshot, created, size, shared)),
            );
        }
        drop(_quiet);
        self.inner.commit().await?;
        tracing::info!(source, target, snapshot, "shared");
        self.volume_info(target).map(Ok)
    }

    /// Snapshots, of `volume` or of all volumes, sorted by name.
    pub fn list_snapshots(&self, volume: Option<&str>) -> Vec<VolumeInfo> {
        let prefix = volume.map(|v| format!("{v}@"));
        self.inner
            .volumes
            .read()
            .values()
            .filter(|v| v.snapshot && prefix.as_ref().is_none_or(|p| v.name.starts_with(p.as_str())))
            .map(|v| self.inner.info(v))
            .collect()
    }

    /// Byte ranges `(offset, length)` whose content may differ between `a` and `b`
    /// (volumes or snapshots, e.g. two snapshots of one volume, or a snapshot and the
    /// live volume), found from the mappings alone: ranges where one side has written
    /// blocks the other lacks, or both map different data units. Pages the two share
    /// are skipped without a look. The ranges are sorted, disjoint, 4 KiB-aligned, and
    /// cover up to the larger size.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn diff(&self, a: &str, b: &str) -> Result<Vec<(u64, u64)>> {
        let get = |n: &str| {
            self.inner
                .volumes
                .read()
                .get(n)
                .cloned()
                .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume or snapshot").op("diff").volume(n))
        };
        let (va, vb) = (get(a)?, get(b)?);
        let (ma, mb) = (va.map.read().clone(), vb.map.read().clone());
        let bpu = self.inner.geo.blocks_per_unit();
        let us = self.inner.geo.unit_size;
        // Pages present on either side, in order.
        let present: std::collections::BTreeSet<usize> = ma.pages().chain(mb.pages()).map(|(p, _)| p).collect();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut push = |off: u64, len: u64| match out.last_mut() {
            Some((o, l)) if *o + *l == off => *l += len,
            _ => out.push((off, len)),
        };
        for p in present {
            if let (Some(x), Some(y)) = (ma.page(p), mb.page(p)) {
                if Arc::ptr_eq(x, y) {
                    continue;
                }
            }
            for i in 0..PAGE_ENTRIES as u64 {
                let lunit = p as u64 * PAGE_ENTRIES as u64 + i;
                let (ea, eb) = (ma.get(lunit), mb.get(lunit));
                for blk in 0..bpu {
                    let bit = 1u32 << blk;
                    let wa = ea.is_mapped() && ea.bitmap & bit != 0;
                    let wb = eb.is_mapped() && eb.bitmap & bit != 0;
                    if wa != wb || (wa && ea.punit != eb.punit) {
                        push(lunit * us + blk * BLOCK_SIZE, BLOCK_SIZE);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Grows a volume to `size` bytes (a multiple of 4096). Durable on return. Requests
    /// are checked against the new size at once, but an NBD client learns an export's
    /// size only in its handshake: connected clients see the growth after reconnecting.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::InvalidArgument`] (shrink, bad size, or a snapshot).
    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("resize volume").volume(name);
        validate_size(size).map_err(err)?;
        self.inner.check_writable().map_err(err)?;
        {
            let vols = self.inner.volumes.read();
            let vs = match vols.get(name) {
                Some(v) if v.snapshot => {
                    return Err(err(Error::new(ErrorKind::InvalidArgument, "a snapshot cannot be resized")))
                }
                Some(v) => v,
                None => return Err(err(Error::new(ErrorKind::NotFound, "no such volume"))),
            };
            // Held so that the resize record is logged in order with this volume's
            // mapping records.
            let _map = vs.map.write();
            let old = vs.size.load(Ordering::SeqCst);
            if size < old {
                return Err(err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("shrinking from {old} to {size} bytes is not supported"),
                )));
            }
            if size != old {
                self.inner.log_record(&Record::VolumeResize { volume: vs.id, size });
                vs.size.store(size, Ordering::SeqCst);
            }
        }
        self.inner.commit().await.map_err(err)?;
        self.volume_info(name)
    }

    /// A handle for I/O on the volume `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn volume(&self, name: &str) -> Result<Volume> {
        let vols = self.inner.volumes.read();
        let vs = vols.get(name).ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume").volume(name))?;
        Ok(Volume::new(self.inner.clone(), vs.clone()))
    }

    /// Information on one volume.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn volume_info(&self, name: &str) -> Result<VolumeInfo> {
        let vols = self.inner.volumes.read();
        let vs = vols
            .get(name)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume").op("volume info").volume(name))?;
        Ok(self.inner.info(vs))
    }

    /// Names of every volume and snapshot (`VOL@SNAP`), sorted. Cheap: unlike
    /// [`Pool::list_volumes`] it computes no space accounting.
    pub fn names(&self) -> Vec<String> {
        self.inner.volumes.read().keys().cloned().collect()
    }

    /// All volumes (not snapshots), sorted by name.
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        self.inner.volumes.read().values().filter(|v| !v.snapshot).map(|v| self.inner.info(v)).collect()
    }

    /// Space accounting of the pool.
    pub fn status(&self) -> PoolStatus {
        // The registry before the allocator, never while holding it: deletes and
        // snapshots take the allocator while holding the registry.
        let volumes = self.inner.volumes.read().len() as u64;
        let a = self.inner.alloc.lock();
        let us = self.inner.geo.unit_size;
        let unit_count = a.unit_count();
        PoolStatus {
            uuid: uuid::Uuid::from_bytes(self.inner.geo.uuid).to_string(),
            path: self.inner.path.clone(),
            capacity: unit_count * us,
            used: a.used * us,
            metadata: a.meta * us,
            free: (unit_count - a.used - a.meta) * us,
            freeing: a.pending_free.len() as u64 * us,
            reserved: (a.spare.len() as u64).max(self.inner.spare_needed(&a, 0)).min(unit_count - a.used - a.meta) * us,
            unit_size: us as u32,
            volumes,
            direct_io: self.inner.direct,
            failed: self.inner.failed.load(Ordering::SeqCst),
        }
    }

    /// Makes every write completed before the call durable (group commit across volumes).
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool failed (now or earlier).
    pub async fn flush(&self) -> Result<()> {
        self.inner.commit().await
    }

    /// What the open of this pool read: log batches replayed and bytes read.
    pub fn recovery(&self) -> Recovery {
        self.inner.recovery
    }

    /// Stops the committer and writes a checkpoint; the pool then opens without replay.
    /// Writes, trims and flushes through outstanding [`Volume`] handles fail afterwards
    /// (reads still work); the pool file stays open until the last handle is dropped.
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool had failed (no checkpoint is written);
    /// [`ErrorKind::Io`] if the final checkpoint cannot be written (the pool is then
    /// marked failed; the log still holds every committed change).
    pub fn close(self) -> Result<()> {
        let inner = self.inner;
        inner.closed.store(true, Ordering::SeqCst);
        {
            let mut q = inner.commits.queue.lock();
            q.shutdown = true;
            inner.commits.cv.notify_all();
        }
        if let Some(h) = inner.committer.lock().take() {
            let _ = h.join();
        }
        if inner.failed.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::Failed, "pool failed; not writing a final checkpoint"));
        }
        inner.checkpoint(0).map_err(|e| {
            inner.fail(&e);
            e.op("close pool")
        })
    }
}

impl PoolInner {
    pub fn info(&self, v: &VolState) -> VolumeInfo {
        let (mut mapped, mut exclusive) = (0u64, 0u64);
        for (_, page) in v.map.read().pages() {
            mapped += u64::from(page.mapped);
            if !page.is_shared() {
                exclusive += page.units().filter(|&u| self.refcounts.is_exclusive(u)).count() as u64;
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
        }
    }

    pub fn check_writable(&self) -> Result<()> {
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
    pub fn log_record(&self, r: &Record) {
        let mut j = self.journal.lock();
        r.encode(&mut j.bytes);
        self.records_logged.fetch_add(1, Ordering::SeqCst);
        if j.bytes.len() >= BACKGROUND_COMMIT_BYTES {
            drop(j);
            let mut q = self.commits.queue.lock();
            if !q.background {
                q.background = true;
                self.commits.cv.notify_one();
            }
        }
    }

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
    pub async fn commit(self: &Arc<Self>) -> Result<()> {
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
            let inner = Arc::clone(self);
            let seen = self.cycles_started.load(Ordering::SeqCst);
            match rt.spawn(async move { inner.commit_on_task(seen).await }).await {
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
    pub async fn checkpoint_async(&self) -> Result<()> {
        self.on_committer(true).await
    }

    /// Asks the committer for a checkpoint and does not wait for it; requests made
    /// while one is pending are served by one checkpoint. A failed checkpoint fails the
    /// pool, which every later change reports.
    fn request_checkpoint(&self) {
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
    async fn sync_data(&self) -> Result<()> {
        let seen = self.syncs_started.load(Ordering::SeqCst);
        let _turn = self.sync_turn.lock().await;
        let Some(number) = self.sync_turn_begins(seen)? else { return Ok(()) };
        let r = self.ring.fdatasync().await;
        self.sync_turn_ends(number, r)
    }

    /// [`Self::sync_data`] for a caller on no runtime (the committer, open, close).
    ///
    /// Errors: as [`Self::sync_data`].
    fn sync_data_blocking(&self) -> Result<()> {
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

    /// Fail-stop: after a write, `fdatasync` or commit to the pool device failed, the
    /// pool refuses writes, trims and management changes (reads keep working) until it
    /// is restarted; `status().failed` reports it. Nothing is written to a device that
    /// may have lost data, so nothing acknowledged later can depend on it.
    pub fn fail(&self, e: &Error) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::error!(error = %e, path = %self.path.display(), "pool I/O failed; the pool now refuses writes");
        }
    }

    /// A commit cycle on the calling task, for [`Self::commit`] (`seen`: the value of
    /// `cycles_started` when that call began). Returns `None`, having changed nothing,
    /// when a checkpoint is due or the records do not fit in the log: the committer
    /// must run it.
    async fn commit_on_task(&self, seen: u64) -> Option<Result<()>> {
        let mut log = self.log.lock().await;
        // Both looked at under the lock: a cycle or checkpoint that failed did so while
        // holding it, and close() writes its checkpoint under it after setting `closed`.
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
            if self.data_sync_needed(&records) {
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
    fn commit_cycle(&self) -> Result<()> {
        self.with_log_locked(|log| self.commit_cycle_locked(log))
    }

    /// Runs `f` holding the log lock (a blocking wait for it), unless the pool has
    /// failed; a failure of `f` fails the pool before the lock is released, so the next
    /// holder sees it.
    fn with_log_locked(&self, f: impl FnOnce(&mut LogState) -> Result<()>) -> Result<()> {
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
        if self.checkpoint_due(log) {
            return self.checkpoint_locked(log, 0);
        }
        let (pending, records, upto) = self.take_records();
        let Some(plan) = self.place_batches(log, &records)? else {
            // No room in the log: a checkpoint captures these records' effects (they
            // are already applied in memory) and empties the log.
            return self.checkpoint_locked(log, 0);
        };
        if self.data_sync_needed(&records) {
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
        Ok(())
    }

    /// Whether the next cycle must be a checkpoint: the live log plus twice the
    /// pending records pass half the log (on-disk-format.md 6.2).
    fn checkpoint_due(&self, log: &LogState) -> bool {
        let pending = self.journal.lock().bytes.len() as u64;
        log.cursor.pos - log.cursor.head + pending * 2 > self.geo.log_size / 2
    }

    /// C1 (on-disk-format.md 6.2): how far the pending frees and settles reach, the
    /// journal's records (the journal is left empty), and how many records were logged
    /// so far. Call with the log locked.
    fn take_records(&self) -> (PendingMark, Vec<u8>, u64) {
        let pending = self.alloc.lock().pending_mark();
        let mut j = self.journal.lock();
        (pending, std::mem::take(&mut j.bytes), self.records_logged.load(Ordering::SeqCst))
    }

    /// Puts records taken by [`Self::take_records`] back in front of the journal
    /// (they are older than anything logged since). Call with the log still locked.
    fn untake_records(&self, records: Vec<u8>) {
        let mut j = self.journal.lock();
        let newer = std::mem::replace(&mut j.bytes, records);
        j.bytes.extend_from_slice(&newer);
    }

    /// C3's placement: `records` as log batches numbered from the cursor's sequence
    /// number, each at its byte offset in the pool (wrap rule, 4.2). `None` if they do
    /// not all fit in the live log. Errors: a malformed pending record (an engine bug).
    fn place_batches(&self, log: &LogState, records: &[u8]) -> Result<Option<LogPlan>> {
        let batches = journal::encode_batches(records, log.cursor.seq + 1, self.geo.pool_tag())?;
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
        self.alloc.lock().release_pending(pending, &self.pins);
    }

    /// True when every log record appended so far is durable: a FUA write that changes
    /// no mapping may then rely on `RWF_DSYNC` alone (the mapping it writes through is
    /// already on the medium).
    pub fn metadata_settled(&self) -> bool {
        self.records_durable.load(Ordering::SeqCst) >= self.records_logged.load(Ordering::SeqCst)
    }

    /// Writes a checkpoint (see the module docs) whose sequence number is `seq_jump`
    /// past the last log batch (at least 1 past it).
    /// A failure fails the pool before the log lock is released.
    fn checkpoint(&self, seq_jump: u64) -> Result<()> {
        // Held throughout: no commit cycle takes records or moves the log meanwhile.
        self.with_log_locked(|log| self.checkpoint_locked(log, seq_jump))
    }

    /// Writes the current superblock again into the other slot, one generation on: both
    /// slots then name the same checkpoint. Used when an open upgrades the format
    /// version. A failure fails the pool before the log lock is released.
    fn rewrite_superblock(&self) -> Result<()> {
        self.with_log_locked(|log| self.switch_superblock(log, log.sb.clone()))
    }

    /// Makes `sb` the current superblock: numbers it one generation past the current
    /// one, writes it into that generation's slot and syncs it. Call with the log
    /// locked (`log`).
    fn switch_superblock(&self, log: &mut LogState, mut sb: Superblock) -> Result<()> {
        sb.generation = (log.sb.generation.get() + 1).into();
        sb.crc = sb.compute_crc().into();
        write_blocks(&self.ring, SUPERBLOCK_OFFSETS[(sb.generation.get() % 2) as usize], sb.as_bytes())?;
        self.sync_data_blocking()?;
        log.sb = sb;
        Ok(())
    }

    /// [`Self::checkpoint`] with the log lock held by the caller.
    fn checkpoint_locked(&self, log: &mut LogState, seq_jump: u64) -> Result<()> {
        // 1. A consistent snapshot: all volume maps, the allocator and the journal.
        let (snapshot, pending, upto, mut reserved) = {
            let vols = self.volumes.read();
            let maps: Vec<_> = vols.values().map(|v| (v.clone(), v.map.read())).collect();
            let mut alloc = self.alloc.lock();
            // The units this checkpoint takes at most, from the spare (room.rs): they
            // are backed, and the rule that sizes the spare guarantees them.
            let bound = journal::checkpoint_units_bound(
                journal::checkpoint_bytes_bound(&alloc.counts, alloc.used),
                self.geo.unit_size,
            );
            let reserved: std::collections::VecDeque<u32> = (0..bound).map_while(|_| alloc.alloc_meta()).collect();
            if (reserved.len() as u64) < bound {
                tracing::error!(
                    bound,
                    spare = reserved.len(),
                    "the spare holds fewer units than a checkpoint may take"
                );
            }
            alloc.checkpoint_units = bound;
            let mut j = self.journal.lock();
            j.bytes.clear(); // captured by the snapshot itself
            let volumes = maps
                .iter()
                .map(|(v, m)| {
                    let meta = VolumeMeta {
                        name: v.name.clone(),
                        snapshot: v.snapshot,
                        size: v.size.load(Ordering::SeqCst),
                        created: v.created,
                        map: (**m).clone(),
                    };
                    (v.id, meta)
                })
                .collect();
            // Its tables are resident only where units are in use, like the live ones.
            let mut copy = Allocator::new(alloc.unit_count() as usize);
            for (u, r) in alloc.nonzero_refcounts() {
                // Checkpoint units and copy-on-write targets not yet mapped are free in it.
                if r != crate::meta::META && !alloc.cow_inflight.contains(&u) {
                    copy.set_loaded(u, r);
                }
            }
            let st = State {
                volumes,
                next_volume: self.next_volume.load(Ordering::SeqCst),
                alloc: copy,
                unit_size: self.geo.unit_size,
            };
            (st, alloc.pending_mark(), self.records_logged.load(Ordering::SeqCst), reserved)
        };
        self.writes_since_sync.store(0, Ordering::SeqCst);
        // 2. Encode and write the chunks one at a time, each into a freshly allocated
        //    unit (the unit of the next chunk is taken before a chunk is written, since
        //    its header names it), with at most CHUNKS_IN_FLIGHT writes outstanding:
        //    memory stays a few chunks whatever the size of the checkpoint.
        const CHUNKS_IN_FLIGHT: usize = 8;
        let payload = self.geo.unit_size as usize - size_of::<ChunkHeader>();
        let mut alloc_meta = || match reserved.pop_front() {
            Some(u) => Ok(u),
            None => {
                // Past the bound: an engine bug, which the tests are to catch.
                debug_assert!(false, "a checkpoint took more units than its bound");
                let mut a = self.alloc.lock();
                a.alloc_meta()
                    .or_else(|| a.alloc_meta_from_free())
                    .ok_or_else(|| Error::new(ErrorKind::NoSpace, "no free unit for the checkpoint").op("checkpoint"))
            }
        };
        // At least one past the last batch: the log that follows this checkpoint never
        // continues the sequence of the one before it, so a replay from the previous
        // checkpoint (a rollback to the older superblock slot) stops where this one was
        // taken, instead of going on into batches written after it without the records
        // it absorbed (on-disk-format.md 4.3).
        let seq = log.cursor.seq + seq_jump.max(1);
        let mut units: Vec<u32> = Vec::new();
        let mut inflight = std::collections::VecDeque::new();
        let wait = |rx: oneshot::Receiver<io::RwResult>| match rx.blocking_recv() {
            Ok((_, Ok(()))) => Ok(()),
            Ok((_, Err(e))) => Err(Error::io("write checkpoint", e)),
            Err(_) => Err(worker_gone()),
        };
        let mut emit = |body: &[u8], last: bool| -> Result<()> {
            if units.is_empty() {
                units.push(alloc_meta()?);
            }
            let next = if last { NO_UNIT } else { u64::from(alloc_meta()?) };
            let index = units.len() as u64 - 1;
            let h = ChunkHeader {
                magic: CHECKPOINT_MAGIC.into(),
                crc: 0.into(),
                checkpoint_seq: seq.into(),
                index: index.into(),
                next_unit: next.into(),
                payload_len: (body.len() as u32).into(),
                pad: 0.into(),
                pool_uuid: self.geo.uuid,
                reserved: 0.into(),
            };
            let crc = crc32c::crc32c_append(crc(h.as_bytes()), body);
            let h = ChunkHeader { crc: crc.into(), ..h };
            let unit = units[index as usize];
            if next != NO_UNIT {
                units.push(next as u32);
            }
            if inflight.len() == CHUNKS_IN_FLIGHT {
                wait(inflight.pop_front().expect("a write in flight"))?;
            }
            inflight.push_back(write_blocks_async(
                &self.ring,
                self.geo.unit_offset(u64::from(unit)),
                &[h.as_bytes(), body],
                false,
            ));
            Ok(())
        };
        let encoded = snapshot.encode_checkpoint(payload, &mut emit);
        drop(snapshot);
        let result = inflight.into_iter().fold(encoded.map(|_| ()), |r, rx| r.and(wait(rx)));
        let result = result.and_then(|()| self.sync_data_blocking());
        {
            // What the bound held beyond what the checkpoint took goes back to the spare.
            let mut a = self.alloc.lock();
            for u in reserved.drain(..) {
                a.retire_meta(u);
            }
            a.checkpoint_units = units.len() as u64;
            if result.is_err() {
                for &u in &units {
                    a.retire_meta(u);
                }
                a.checkpoint_units = log.checkpoint_units.len() as u64;
            }
        }
        result?;
        // 3. The sync above made the data and the chunks durable; switch superblocks.
        let mut sb = log.sb.clone();
        sb.version = FORMAT_VERSION.into();
        sb.checkpoint_unit = u64::from(units[0]).into();
        sb.checkpoint_chunks = (units.len() as u64).into();
        sb.checkpoint_seq = seq.into();
        sb.log_head = log.cursor.pos.into();
        self.switch_superblock(log, sb)?;
        // 4. The old checkpoint's units and the snapshot's frees are now free.
        // Still under the log lock: pending marks stay valid only while takes and
        // releases of them are serialised.
        let old = std::mem::replace(&mut log.checkpoint_units, units);
        log.cursor.head = log.cursor.pos;
        log.cursor.seq = seq;
        let mut a = self.alloc.lock();
        for u in old {
            a.retire_meta(u);
        }
        self.trim_spare(&mut a);
        a.release_pending(pending, &self.pins);
        drop(a);
        self.records_durable.fetch_max(upto, Ordering::SeqCst);
        Ok(())
    }
}

/// Fails the pool when dropped while armed (see [`PoolInner::commit_on_task`]).
struct FailOnDrop<'a>(Option<&'a PoolInner>);

impl FailOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for FailOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(pool) = self.0 {
            pool.fail(&Error::new(ErrorKind::Failed, "a commit cycle was stopped before it finished"));
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

/// Synchronous write of `data` (padded to whole blocks) at byte `offset` through the ring.
fn write_blocks(ring: &IoRing, offset: u64, data: &[u8]) -> Result<()> {
    let (_, r) = write_blocks_async(ring, offset, &[data], false).blocking_recv().map_err(|_| worker_gone())?;
    r.map_err(|e| Error::io(format!("write at byte {offset}"), e))
}

/// Writes `parts` back to back (padded with zeros to whole blocks) at byte `offset`
/// through the ring: a checkpoint chunk is its header then its payload.
fn write_blocks_async(ring: &IoRing, offset: u64, parts: &[&[u8]], dsync: bool) -> oneshot::Receiver<io::RwResult> {
    let mut buf = AlignedBuf::zeroed(parts.iter().map(|p| p.len()).sum());
    let mut at = 0;
    for p in parts {
        buf.full_mut()[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    // The data rounded up to whole blocks; never the buffer's capacity, which may be
    // larger (a power of two) and would write zeros over what follows.
    let len = at.div_ceil(io::ALIGN) * io::ALIGN;
    ring.rw(Dir::Write { dsync }, buf, vec![Segment { file_offset: offset, buf_offset: 0, len }])
}

fn sync(ring: &IoRing) -> Result<()> {
    ring.fdatasync().blocking_recv().map_err(|_| worker_gone())?.map_err(|e| Error::io("fdatasync pool", e))
}

/// The committer thread: serves commit requests in groups; checkpoints when half the
/// log is used or a commit would not fit. Exits when the pool is closed or dropped.
fn committer(pool: std::sync::Weak<PoolInner>, commits: Arc<Commits>) {
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
        let Some(inner) = pool.upgrade() else {
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
            let result = if shutdown { Err(ErrorKind::Failed) } else { inner.grow_spare().map_err(kind) };
            for w in grow_waiters {
                let _ = w.send(result);
            }
        }
        if cycle {
            // A failed pool is refused, and a failing cycle fails the pool, inside.
            let result = if checkpoint { inner.checkpoint(0) } else { inner.commit_cycle() };
            let result = result.map_err(kind);
            // Release the pool before answering, so a caller that drops its last handle
            // after the flush closes the pool file at once.
            drop(inner);
            for w in waiters {
                let _ = w.send(result);
            }
        }
        if shutdown && commits.queue.lock().waiters.is_empty() {
            return;
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Without close(): a crash-equivalent stop; the log has everything committed.
        self.commits.queue.lock().shutdown = true;
        self.commits.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_writes_cover_their_data_and_nothing_after() {
        // I/O buffers have power-of-two capacities; a write of 3 blocks (a log batch,
        // say) must still write 3 blocks, not 4, or it zeroes what follows it in the
        // log or the first data unit.
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = io::open_pool_file(&dir.path().join("f"), true).unwrap();
        let f = Arc::new(f);
        let ring = IoRing::new(f.clone(), 8, &IoOptions::default()).unwrap();
        let bs = io::ALIGN;
        let all = || vec![Segment { file_offset: 0, buf_offset: 0, len: 8 * bs }];
        for (blocks, tail) in [(3usize, 0usize), (2, 100), (5, 0)] {
            // Eight blocks of 0xee, then the write into blocks 1.. of them.
            let mut fill = AlignedBuf::zeroed(8 * bs);
            fill.full_mut().fill(0xee);
            ring.rw(Dir::Write { dsync: false }, fill, all()).blocking_recv().unwrap().1.unwrap();
            let data = vec![0x11; blocks * bs - tail];
            write_blocks(&ring, bs as u64, &data).unwrap();
            let (back, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(8 * bs), all()).blocking_recv().unwrap();
            r.unwrap();
            let b = back.full();
            assert!(b[..bs].iter().all(|&x| x == 0xee), "block before the write changed");
            assert!(b[bs..bs + data.len()].iter().all(|&x| x == 0x11));
            assert!(b[bs + data.len()..(1 + blocks) * bs].iter().all(|&x| x == 0), "padding is not zero");
            assert!(
                b[(1 + blocks) * bs..].iter().all(|&x| x == 0xee),
                "a {blocks}-block write changed the blocks after it"
            );
        }
    }
}
