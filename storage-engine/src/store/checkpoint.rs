//! Checkpoints (docs/on-disk-format.md 6.3): the pages that changed written into new
//! page chunks and the directory into a chain of chunks, all in units of the spare, then
//! the superblock switched to it; and the block writes checkpoints, the log and pool
//! creation use. Not here: when to checkpoint (commit.rs), the room for
//! one (room.rs).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use tokio::sync::oneshot;
use zerocopy::IntoBytes;

use super::{worker_gone, LogState, Store};
use crate::error::{Error, ErrorKind, Result};
use crate::format::*;
use crate::io::{self, AlignedBuf, Dir, IoRing, Segment};
use crate::journal::{self, State, VolumeMeta};
use crate::meta::{Allocator, MetaCounts, PendingMark};

/// What K1 of a checkpoint took ([`Store::snapshot_for_checkpoint`]).
struct Snapshot {
    /// The metadata to write.
    state: State,
    /// Its counts, for the bound on what the checkpoint writes.
    counts: MetaCounts,
    /// How far the pending frees and settles reached.
    pending: PendingMark,
    /// Records logged so far: durable once the checkpoint is.
    upto: u64,
    /// Units of the spare the checkpoint may take: as many as a checkpoint writing
    /// every page takes at most, copies included.
    reserved: VecDeque<u32>,
}

impl Store {
    /// Writes a checkpoint (see the module docs) whose sequence number is `seq_jump`
    /// past the last log batch (at least 1 past it).
    /// A failure fails the pool before the log lock is released.
    pub(crate) fn checkpoint(&self, seq_jump: u64) -> Result<()> {
        // Held throughout: no commit cycle takes records or moves the log meanwhile.
        self.with_log_locked(|log| self.checkpoint_locked(log, seq_jump))
    }

    /// Makes `sb` the current superblock: numbers it one generation past the current
    /// one, writes it into that generation's slot and syncs it; then, when it names
    /// ditto copies ([`INCOMPAT_DITTO`]), writes the same bytes into the other slot and
    /// syncs again, so that both slots hold it (docs/on-disk-format.md 6.3, K3). Call
    /// with the log locked (`log`).
    pub(super) fn switch_superblock(&self, log: &mut LogState, mut sb: Superblock) -> Result<()> {
        sb.generation = (log.sb.generation.get() + 1).into();
        sb.crc = sb.compute_crc().into();
        let first = (sb.generation.get() % 2) as usize;
        write_blocks(&self.ring, SUPERBLOCK_OFFSETS[first], sb.as_bytes())?;
        self.sync_data_blocking()?;
        if journal::has_ditto(&sb) {
            // Only once the first is durable: a cut between the two leaves the other
            // slot one generation older, whose checkpoint is still whole (its units are
            // freed only after this), and the next open writes both again.
            write_blocks(&self.ring, SUPERBLOCK_OFFSETS[1 - first], sb.as_bytes())?;
            self.sync_data_blocking()?;
        }
        log.sb = sb;
        Ok(())
    }

    /// [`Self::checkpoint`] with the log lock held by the caller.
    pub(super) fn checkpoint_locked(&self, log: &mut LogState, seq_jump: u64) -> Result<()> {
        let began = std::time::Instant::now();
        // K1: a consistent snapshot of all volume maps, the allocator and the journal.
        let Snapshot { state, counts, pending, upto, mut reserved } =
            self.snapshot_for_checkpoint(journal::page_chunk_units(&log.page_chunks), !journal::has_ditto(&log.sb));
        let hold = began.elapsed();
        self.writes_since_sync.store(0, Ordering::SeqCst);
        // At least one past the last batch: the log that follows this checkpoint never
        // continues the sequence of the one before it, so a replay from the previous
        // checkpoint (a rollback to the older superblock slot) stops where this one was
        // taken, instead of going on into batches written after it without the records
        // it absorbed (on-disk-format.md 4.3).
        let seq = log.cursor.seq + seq_jump.max(1);
        // K2: what to write (the pages stored nowhere and those of the page chunks it
        // cleans), and the units that takes at most, of those K1 took; the rest goes
        // back to the spare.
        let fill = journal::chunk_fill(self.geo.unit_size);
        let plan = state.plan_checkpoint(&log.page_chunks, fill);
        // Each kind of page chunk may end with one less full.
        let kind_units = |bytes: u64| if bytes == 0 { 0 } else { bytes.div_ceil(fill) + 1 };
        let page_units = kind_units(plan.page_bytes()) + kind_units(plan.leaf_bytes());
        let dir_bytes = journal::directory_bytes_bound(&counts, plan.kept.len() as u64 + page_units);
        // Each chunk in two units (ditto copies).
        let bound = journal::CHUNK_COPIES * (page_units + dir_bytes.div_ceil(fill) + 1);
        let kept_units = journal::page_chunk_units(&plan.kept);
        {
            let mut a = self.alloc.lock();
            while reserved.len() as u64 > bound {
                a.retire_meta(reserved.pop_back().expect("more than the bound"));
            }
            // What the checkpoint holds once durable, at most (room.rs).
            a.checkpoint_units = kept_units + bound;
        }
        // The chunks, written and synced with the data they refer to.
        // Fewer than the bound only where the rule held for one copy: a pool of an older
        // build, converted by the checkpoint at open (K1 warned). Its chunks then take
        // free units beyond the spare as they need them.
        let short = (reserved.len() as u64) < bound;
        let mut w = ChunkWrites::new(self, seq, &mut reserved, short);
        let written = w.write_all(&state, &plan);
        let (units, page_units_new, bytes) = (std::mem::take(&mut w.dirs), std::mem::take(&mut w.pages), w.bytes);
        drop(w);
        drop(state);
        let result = written.and_then(|()| self.sync_data_blocking());
        {
            // What the bound held beyond what the checkpoint took goes back to the spare.
            let mut a = self.alloc.lock();
            for u in reserved.drain(..) {
                a.retire_meta(u);
            }
            a.checkpoint_units = kept_units + journal::CHUNK_COPIES * page_units_new.len() as u64 + units.len() as u64;
            if result.is_err() {
                for &u in units.iter().chain(page_units_new.iter().flat_map(|(p, c)| [p, c])) {
                    a.retire_meta(u);
                }
                a.checkpoint_units = log.checkpoint_units.len() as u64 + journal::page_chunk_units(&log.page_chunks);
                // The pages and leaves noted as in those chunks are in none.
                plan.forget_stored();
            }
        }
        result?;
        // K3: the sync above made the data and the chunks durable; switch superblocks.
        let mut sb = log.sb.clone();
        sb.version = FORMAT_VERSION.into();
        // No refcounts, and pages and leaves in page chunks: a build that does not know
        // these must refuse the pool.
        sb.incompat_features = (sb.incompat_features.get()
            | INCOMPAT_DERIVED_REFCOUNTS
            | INCOMPAT_PAGE_CHUNKS
            | INCOMPAT_SHARED_LEAVES
            | INCOMPAT_DITTO)
            .into();
        sb.checkpoint_unit = u64::from(units[0]).into();
        sb.checkpoint_copy_unit = u64::from(units[1]).into();
        sb.checkpoint_chunks = (units.len() as u64 / journal::CHUNK_COPIES).into();
        sb.checkpoint_seq = seq.into();
        sb.log_head = log.cursor.pos.into();
        self.switch_superblock(log, sb)?;
        // K4: the old checkpoint's chain and the page chunks it dropped go to the spare,
        // the snapshot's frees are free. Still under the log lock: pending marks stay
        // valid only while takes and releases of them are serialised.
        let old = std::mem::replace(&mut log.checkpoint_units, units);
        let mut chunks = plan.kept;
        chunks.extend(page_units_new.iter().map(|&(u, copy)| (u, journal::PageChunk::written(seq, copy))));
        log.page_chunks = chunks;
        log.cursor.head = log.cursor.pos;
        log.cursor.seq = seq;
        let mut a = self.alloc.lock();
        for u in old.into_iter().chain(plan.dropped) {
            a.retire_meta(u);
        }
        self.trim_spare(&mut a);
        drop(a);
        self.release_pending(pending);
        self.records_durable.fetch_max(upto, Ordering::SeqCst);
        self.costs.checkpoint(began.elapsed(), hold, bytes);
        Ok(())
    }

    /// K1 (on-disk-format.md 6.3), under the registry, every volume's map lock, the
    /// allocator and the journal: the metadata as a plain [`State`] (pages shared with
    /// the live maps; refcounts of checkpoint units and copy-on-write targets not yet
    /// mapped as free) and its counts, the journal cleared (its records are in the
    /// snapshot), how far the pending lists reach, how many records it covers, and
    /// the units of the spare a checkpoint writing every page takes at most (taken
    /// here, under the allocator lock, so that no change, a delete trimming the spare
    /// say, can take them before the plan says how many it needs).
    /// `page_chunks`: the current checkpoint's, all of which the plan may keep.
    /// `converting`: the current checkpoint is stored once (an older build's), so the
    /// spare was sized for one copy and may hold fewer units than this bound.
    fn snapshot_for_checkpoint(&self, page_chunks: u64, converting: bool) -> Snapshot {
        let vols = self.volumes.read();
        let maps: Vec<_> = vols.values().map(|v| (v.clone(), v.map.read())).collect();
        // Read under the map locks, which their changes hold (`VolState::props`).
        let props: Vec<_> = maps.iter().map(|(v, _)| v.props()).collect();
        let mut alloc = self.alloc.lock();
        // Backed, and guaranteed by the rule that sizes the spare (room.rs).
        let bound = journal::checkpoint_units_bound(
            journal::checkpoint_bytes_bound(&alloc.counts, self.geo.unit_size),
            self.geo.unit_size,
        );
        let reserved: VecDeque<u32> = (0..bound).map_while(|_| alloc.alloc_meta()).collect();
        if (reserved.len() as u64) < bound {
            if converting {
                tracing::warn!(
                    bound,
                    spare = reserved.len(),
                    "converting a pool stored once to two copies with fewer spare units than a checkpoint may take: \
                     it takes free units as it needs them"
                );
            } else {
                tracing::error!(
                    bound,
                    spare = reserved.len(),
                    "the spare holds fewer units than a checkpoint may take"
                );
            }
        }
        // What the checkpoint holds once durable, at most: twice the bound (room.rs), or
        // every current page chunk (its units) and the bound, whichever is more.
        alloc.checkpoint_units = (2 * bound).max(page_chunks + bound);
        let mut j = self.journal.lock();
        j.bytes.clear(); // captured by the snapshot itself
        j.glued.clear();
        let volumes = maps
            .iter()
            .zip(props)
            .map(|((v, m), props)| {
                let meta = VolumeMeta {
                    name: v.name.clone(),
                    snapshot: v.snapshot,
                    size: v.size.load(Ordering::SeqCst),
                    created: v.created,
                    map: (**m).clone(),
                    written: v.written.load(Ordering::SeqCst),
                    props: (*props).clone(),
                };
                (v.id, meta)
            })
            .collect::<std::collections::BTreeMap<u64, VolumeMeta>>();
        // No refcounts: the checkpoint stores none (the open derives them). In debug
        // builds (the tests), the live refcounts, which decide frees and writes in
        // place, are checked against what the mappings imply, as the stored ones were
        // at every open.
        #[cfg(debug_assertions)]
        check_live_refcounts(&alloc, volumes.values().map(|v| &v.map));
        let st =
            State { volumes, next_volume: self.next_volume(), alloc: Allocator::new(0), unit_size: self.geo.unit_size };
        Snapshot {
            state: st,
            counts: alloc.counts,
            pending: alloc.pending_mark(),
            upto: self.records_logged.load(Ordering::SeqCst),
            reserved,
        }
    }
}

/// K2's writes: the page chunks of a plan, then the chain of directory chunks, each
/// into two of the units reserved for it (ditto copies: the first from the front of
/// the reserved units, the copy from the back, so that the two are apart in the pool
/// when the spare is; the units of the next directory chunk are taken before a chunk
/// is written, since its header names them), with at most [`Self::IN_FLIGHT`] writes
/// outstanding, so that memory holds a few chunks whatever the checkpoint's size.
struct ChunkWrites<'a> {
    store: &'a Store,
    seq: u64,
    reserved: &'a mut VecDeque<u32>,
    /// `reserved` holds fewer units than the plan's bound (a pool being converted to
    /// ditto copies): taking units past it is then expected, not a bug.
    short: bool,
    inflight: VecDeque<oneshot::Receiver<io::RwResult>>,
    /// Units of the page chunks written, in order: the chunk's and its copy's.
    pages: Vec<(u32, u32)>,
    /// Units of the directory's chain, in order, each chunk's then its copy's (the last
    /// pair taken, not yet written).
    dirs: Vec<u32>,
    /// Bytes written (whole blocks).
    bytes: u64,
}

impl<'a> ChunkWrites<'a> {
    const IN_FLIGHT: usize = 8;

    fn new(store: &'a Store, seq: u64, reserved: &'a mut VecDeque<u32>, short: bool) -> Self {
        ChunkWrites {
            store,
            seq,
            reserved,
            short,
            inflight: VecDeque::new(),
            pages: Vec::new(),
            dirs: Vec::new(),
            bytes: 0,
        }
    }

    /// The page chunks of pages, then those of leaves (which name where the pages
    /// are), then the directory (which names where the leaves are): all written (not
    /// yet synced) or an error.
    fn write_all(&mut self, state: &State, plan: &journal::CheckpointPlan) -> Result<()> {
        let payload = self.store.geo.unit_size as usize - size_of::<ChunkHeader>();
        let mut emit = |body: &[u8]| {
            let units = self.take()?;
            let index = self.pages.len() as u64;
            self.pages.push(units);
            self.write(PAGE_CHUNK_MAGIC, units, index, (NO_UNIT, NO_UNIT), body)?;
            Ok(units.0)
        };
        let written = journal::encode_bodies(&plan.dirty, payload, &mut emit)
            .and_then(|_| journal::encode_bodies(&plan.dirty_leaves, payload, &mut emit));
        let result = written.and_then(|_| self.write_directory(state, plan));
        // Every write waited for, also after an error: the caller gives the units back.
        std::mem::take(&mut self.inflight).into_iter().fold(result, |r, rx| r.and(wait(rx)))
    }

    /// The directory, naming the kept page chunks and those just written.
    fn write_directory(&mut self, state: &State, plan: &journal::CheckpointPlan) -> Result<()> {
        let payload = self.store.geo.unit_size as usize - size_of::<ChunkHeader>();
        let mut chunks = plan.kept.clone();
        chunks.extend(self.pages.iter().map(|&(u, copy)| (u, journal::PageChunk::written(self.seq, copy))));
        let encoded = state.encode_directory(&chunks, payload, &mut |body, last| {
            if self.dirs.is_empty() {
                let (u, copy) = self.take()?;
                self.dirs.extend([u, copy]);
            }
            let next = if last {
                (NO_UNIT, NO_UNIT)
            } else {
                let (u, copy) = self.take()?;
                (u64::from(u), u64::from(copy))
            };
            let index = self.dirs.len() / 2 - 1;
            let units = (self.dirs[2 * index], self.dirs[2 * index + 1]);
            if next.0 != NO_UNIT {
                self.dirs.extend([next.0 as u32, next.1 as u32]);
            }
            self.write(CHECKPOINT_MAGIC, units, index as u64, next, body)
        });
        encoded.map(|_| ())
    }

    /// The units of the next chunk and its copy.
    fn take(&mut self) -> Result<(u32, u32)> {
        let first = self.take_one(false)?;
        Ok((first, self.take_one(true)?))
    }

    /// The next reserved unit, from the back for a copy.
    fn take_one(&mut self, copy: bool) -> Result<u32> {
        let next = if copy { self.reserved.pop_back() } else { self.reserved.pop_front() };
        match next {
            Some(u) => Ok(u),
            None => {
                // Past the bound (unless the spare was short of it): an engine bug,
                // which the tests are to catch.
                debug_assert!(self.short, "a checkpoint took more units than its bound");
                let mut a = self.store.alloc.lock();
                a.alloc_meta()
                    .or_else(|| a.alloc_meta_from_free())
                    .ok_or_else(|| Error::new(ErrorKind::NoSpace, "no free unit for the checkpoint").op("checkpoint"))
            }
        }
    }

    /// Writes one chunk, its header (naming the next chunk's units `next`, or
    /// [`NO_UNIT`] twice) then `body`, into both `units`: the same bytes.
    fn write(&mut self, magic: u32, units: (u32, u32), index: u64, next: (u64, u64), body: &[u8]) -> Result<()> {
        let h = ChunkHeader {
            magic: magic.into(),
            crc: 0.into(),
            checkpoint_seq: self.seq.into(),
            index: index.into(),
            next_unit: next.0.into(),
            payload_len: (body.len() as u32).into(),
            pad: 0.into(),
            pool_uuid: self.store.geo.uuid,
            next_copy_unit: next.1.into(),
        };
        let crc = crc32c::crc32c_append(crc(h.as_bytes()), body);
        let h = ChunkHeader { crc: crc.into(), ..h };
        for unit in [units.0, units.1] {
            if self.inflight.len() == Self::IN_FLIGHT {
                wait(self.inflight.pop_front().expect("a write in flight"))?;
            }
            self.bytes += (size_of::<ChunkHeader>() + body.len()).div_ceil(io::ALIGN) as u64 * io::ALIGN as u64;
            let offset = self.store.geo.unit_offset(u64::from(unit));
            self.inflight.push_back(write_blocks_async(&self.store.ring, offset, &[h.as_bytes(), body], false));
        }
        Ok(())
    }
}

/// Waits for one chunk write.
fn wait(rx: oneshot::Receiver<io::RwResult>) -> Result<()> {
    match rx.blocking_recv() {
        Ok((_, Ok(()))) => Ok(()),
        Ok((_, Err(e))) => Err(Error::io("write checkpoint", e)),
        Err(_) => Err(worker_gone()),
    }
}

/// Synchronous write of `data` (padded to whole blocks) at byte `offset` through the ring.
pub(crate) fn write_blocks(ring: &IoRing, offset: u64, data: &[u8]) -> Result<()> {
    let (_, r) = write_blocks_async(ring, offset, &[data], false).blocking_recv().map_err(|_| worker_gone())?;
    r.map_err(|e| Error::io(format!("write at byte {offset}"), e))
}

/// Writes `parts` back to back (padded with zeros to whole blocks) at byte `offset`
/// through the ring: a checkpoint chunk is its header then its payload.
pub(super) fn write_blocks_async(
    ring: &IoRing,
    offset: u64,
    parts: &[&[u8]],
    dsync: bool,
) -> oneshot::Receiver<io::RwResult> {
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

/// Panics when a live refcount differs from the number of distinct pages of `maps`
/// that map its unit (checkpoint units and copy-on-write targets not yet mapped
/// excepted): a leaked or lost reference, which the derived refcounts of the next open
/// would silently correct after it had done its harm.
#[cfg(debug_assertions)]
fn check_live_refcounts<'a>(alloc: &Allocator, maps: impl IntoIterator<Item = &'a crate::meta::MapTable>) {
    let derived = journal::derive_refcounts(maps, alloc.unit_count() as usize);
    let skip = |u: u32| alloc.refcount(u) == crate::meta::META || alloc.cow_inflight.contains(&u);
    for (u, r) in alloc.nonzero_refcounts().filter(|&(u, _)| !skip(u)) {
        assert_eq!(derived.refcount(u), r, "data unit {u}: live refcount {r}, mapped by {} pages", derived.refcount(u));
    }
    for (u, r) in derived.nonzero_refcounts() {
        assert!(alloc.refcount(u) != crate::meta::META, "data unit {u} is mapped and holds the checkpoint");
        if !alloc.cow_inflight.contains(&u) {
            assert_eq!(alloc.refcount(u), r, "data unit {u}: mapped by {r} pages, live refcount {}", alloc.refcount(u));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::IoOptions;
    use std::sync::Arc;

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
