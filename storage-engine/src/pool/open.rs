//! Creating and opening a pool: [`Pool::create`], [`Pool::open`] and the variants that
//! create a missing file or format a device, the advisory lock on the pool file, and
//! the open a repair makes. Not here: what a loaded pool is (`journal`), its state
//! (`store`).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use zerocopy::IntoBytes;

use super::{Pool, PoolOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::format::*;
use crate::info::Recovery;
use crate::io::{self, AlignedBuf, IoOptions, IoRing};
use crate::journal::{self, read_at_file, rebuild_refcounts, volume_problems, RefcountRepair, State};
use crate::store::{LogState, Parts, Store, VolState};

/// Locks the pool file, retrying for up to 3 s: after a process is killed with I/O in
/// flight, the kernel releases its files (and their locks) a little after it is reaped.
pub(crate) fn lock(file: &File, exclusive: bool, path: &Path) -> Result<()> {
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

impl Pool {
    /// Opens the pool at `path`, or creates it with `opts` if the file does not exist.
    ///
    /// Errors: see [`Pool::open`] and [`Pool::create`].
    pub fn open_or_create(path: &Path, opts: &PoolOptions) -> Result<Pool> {
        if path.exists() {
            Pool::open_inner(path, &opts.io, opts.accept(), opts.preallocate, opts.discard, None)
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
        match Pool::open_inner(path, &opts.io, opts.accept(), opts.preallocate, opts.discard, None) {
            Err(e) if e.is_not_a_pool() => {
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
        let (log_size, data_offset, unit_count) = match layout(size, u64::from(unit)) {
            Ok(l) => l,
            Err(e) => {
                remove_creating();
                return Err(e);
            }
        };
        let unit = u64::from(unit);
        if !is_dev {
            // Checked above: a size past the unit count's bound never reaches the file
            // system (which says only "out of range").
            file.set_len(size).map_err(|e| discard(Error::io("size pool file", e)))?;
        }
        let sb = new_superblock(size, unit, log_size, data_offset, unit_count);
        let formatted = (|| {
            if opts.preallocate && !is_dev {
                io::allocate(&file, 0, size).map_err(|e| Error::io("preallocate the pool file", e))?;
            }
            format(&file, sb, log_size)
        })();
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
        Pool::open_inner(path, &opts.io, journal::Accept::default(), opts.preallocate, opts.discard, None)
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
        Pool::open_inner(path, io, journal::Accept::default(), false, false, None)
    }

    /// Opens the pool; with `repair`, rebuilds its refcounts from its mappings first
    /// (instead of refusing a pool whose refcounts disagree with them) and lists each
    /// change there: [`repair`].
    pub(crate) fn open_inner(
        path: &Path,
        io: &IoOptions,
        accept: journal::Accept,
        preallocate: bool,
        discard: bool,
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
            // A repair reads both copies of every chunk, and so writes again those
            // with a damaged copy.
            let accept = journal::Accept { both_copies: accept.both_copies || repair.is_some(), ..accept };
            journal::load(&mut read, size, accept).map_err(|e| e.op("open pool"))?
        };
        let unknown = journal::unknown_ro_compat(&loaded.sb);
        if unknown != 0 {
            return Err(Error::corrupt(format!(
                "pool uses read-only-compatible features {unknown:#x} this build does not know: it can check the \
                 pool (`ferrovol check`) but not open it, since opening writes; use the newer ferrovol that wrote it"
            ))
            .op("open pool"));
        }
        for w in loaded.superblock_warning.iter().chain(loaded.log_warning.iter()).chain(&loaded.copy_warnings) {
            tracing::warn!(path = %path.display(), "{w}");
        }
        let mut loaded = loaded;
        // Opens that must write a checkpoint (below): the others write none.
        let salvaged =
            loaded.superblock_warning.is_some() || loaded.log_warning.is_some() || !loaded.copy_warnings.is_empty();
        let repairing = repair.is_some();
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
        let journal::Loaded { sb, geo, state, log, mut checkpoint_units, page_chunks, batches, highest_seq, .. } =
            loaded;
        let upgrade = sb.version.get() < FORMAT_VERSION;
        let first = sb.checkpoint_unit.get() == NO_UNIT;
        // A checkpoint of an older build, stored once: the checkpoint at open writes
        // every chunk in two copies and the superblock into both slots.
        let single = !journal::has_ditto(&sb);
        let State { volumes, next_volume, mut alloc, .. } = state;
        debug_assert_eq!(
            alloc.counts,
            crate::meta::MetaCounts::of(volumes.values().map(|v| (&v.map, v.own_bytes()))),
            "metadata counts kept through replay"
        );
        alloc.checkpoint_units = checkpoint_units.len() as u64;
        // The log state keeps the chain's units and the page chunks apart.
        let paged: std::collections::HashSet<u32> = page_chunks.iter().flat_map(|(&u, c)| c.units(u)).collect();
        checkpoint_units.retain(|u| !paged.contains(u));
        let vols = volumes
            .into_iter()
            .map(|(id, v)| (v.name.clone(), Arc::new(VolState::new(id, v))))
            .collect::<BTreeMap<_, _>>();
        tracing::info!(path = %path.display(), volumes = vols.len(), batches, bytes_read, direct, "opened pool");
        let store = Store::assemble(Parts {
            path: path.to_owned(),
            file,
            backed_all: is_dev || preallocate,
            discard_device: discard && is_dev,
            ring,
            direct,
            geo,
            volumes: vols,
            next_volume,
            alloc,
            recovery: Recovery { batches_replayed: batches, bytes_read },
            log: LogState { cursor: log, sb, checkpoint_units, page_chunks },
        });
        // The spare first: a checkpoint takes its units from it (room.rs).
        store.prepare_at_open().map_err(|e| e.op("open pool"))?;
        // A checkpoint at open (docs/on-disk-format.md 7.6) only when one is needed:
        // - a valid batch lies in the log region past the replayed end (a batch written
        //   while an earlier one of the same commit was torn, or after a rollback, those
        //   of the generation it dropped), or the header of a torn one (whose other
        //   blocks a later batch of the same seq could complete): the checkpoint moves
        //   the sequence numbers past every one, so that replay never reaches one;
        // - the pool is of an older version (upgraded), has no checkpoint yet (its
        //   creation), opened with an accepted loss or around a damaged copy (a
        //   superblock slot or a chunk: the checkpoint writes them again), had its
        //   refcounts repaired, or was written by a build that stored it once.
        // Otherwise (a clean close, or a crash that left nothing past the end) the
        // checkpoint and the log describe the pool, and commits go on from the end.
        let stale_batches = highest_seq > log.seq;
        if stale_batches || upgrade || first || salvaged || repairing || single {
            let jump = (store.geo().log_size / BLOCK_SIZE + 1).max(highest_seq - log.seq + 1);
            store.checkpoint(jump).map_err(|e| match e.kind() {
                // Its spare was sized for one copy; the chunks took free units past it
                // and found none (a failed checkpoint leaves the pool as it was).
                ErrorKind::NoSpace if single => Error::new(
                    ErrorKind::NoSpace,
                    format!(
                        "the pool was written by an older build, which stored its checkpoint once, and is too full \
                         to convert to two copies (docs/on-disk-format.md 5.5): {e}; nothing was changed. Free space \
                         in it with that build (delete snapshots or volumes, or `ferrovol pool grow`), then open it \
                         again"
                    ),
                )
                .op("open pool"),
                _ => e.op("open pool"),
            })?;
            // The checkpoint wrote both slots (ditto copies), so no slot of an older
            // version is left that an older build could open from.
        }
        // Free units a crash or a close left holding blocks of the pool file go back
        // to the host file system, as the units every run frees do.
        let leftover = store.queue_leftover_punches().map_err(|e| e.op("open pool"))?;
        if leftover > 0 {
            tracing::info!(path = %path.display(), units = leftover, "giving free units back to the host file system");
        }
        store.start_committer()?;
        Ok(Pool { store })
    }
}

/// The layout of a new pool of `size` bytes and `unit`-byte data units: the log's size
/// (1/64 of the pool, from 4 batches to 64 MiB), where the data area begins, and how
/// many units it holds (docs/on-disk-format.md 3.1).
///
/// Errors: [`ErrorKind::InvalidArgument`] naming the bound, when the pool holds fewer
/// than 64 units or 2^32-1 or more.
fn layout(size: u64, unit: u64) -> Result<(u64, u64, u64)> {
    let log_size = (size / 64).clamp(4 * MAX_BATCH_BYTES as u64, 64 << 20) / BLOCK_SIZE * BLOCK_SIZE;
    let data_offset = (LOG_OFFSET + log_size).div_ceil(unit) * unit;
    let unit_count = size.saturating_sub(data_offset) / unit;
    if unit_count < 64 || unit_count >= u64::from(u32::MAX) {
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
    Ok((log_size, data_offset, unit_count))
}

/// The superblock of a new pool, generation 0, naming no checkpoint.
fn new_superblock(size: u64, unit: u64, log_size: u64, data_offset: u64, unit_count: u64) -> Superblock {
    Superblock {
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
        incompat_features: 0.into(),
        compat_features: 0.into(),
        ro_compat_features: 0.into(),
        checkpoint_copy_unit: 0.into(),
        reserved: [0; 96],
        crc: 0.into(),
        pad: 0.into(),
    }
}

/// Formats a new pool in `file`: zeros over the log (so that no stale batch of a
/// former pool can look current, and the host file system holds blocks for all of it,
/// so that a log write never needs room there), then both superblock slots (generations
/// 0 and 1 of `sb`), then `fdatasync`.
///
/// Plain writes, not the ring: these are the first writes into the holes of a new
/// file ([`io::write_zeros`], as room.rs fills the log's holes at open); once, on the
/// creating thread, before any data-plane I/O. The buffers are block-aligned, as the
/// file may be open with `O_DIRECT`.
///
/// Errors: [`ErrorKind::Io`].
fn format(file: &File, mut sb: Superblock, log_size: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    io::write_zeros(file, LOG_OFFSET, LOG_OFFSET + log_size)
        .map_err(|(at, e)| Error::io(format!("write at byte {at}"), e))?;
    let mut block = AlignedBuf::zeroed(BLOCK_SIZE as usize);
    for g in 0..2u64 {
        sb.generation = g.into();
        sb.crc = sb.compute_crc().into();
        let at = SUPERBLOCK_OFFSETS[(g % 2) as usize];
        let bytes = sb.as_bytes();
        block.full_mut()[..bytes.len()].copy_from_slice(bytes);
        file.write_all_at(block.full(), at).map_err(|e| Error::io(format!("write at byte {at}"), e))?;
    }
    file.sync_data().map_err(|e| Error::io("fdatasync pool", e))
}
