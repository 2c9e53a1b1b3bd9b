//! Room for metadata: the units the pool sets aside so that it can always write its
//! next checkpoints, the one check every change that adds metadata makes, and the pool
//! file's backing on the host file system.
//!
//! Lives here: the rule that sizes the *spare* (units for checkpoints, never taken by
//! data, each backed by blocks of the host file system), the make-room protocol every
//! change that adds metadata follows ([`Store::with_room`]: try under the change's
//! locks; when there is no room, release them, commit, grow the spare or checkpoint,
//! and try again), growing the spare (on the committer thread), and preparing the
//! spare and the log's backing at open. Not here: the checkpoint itself (checkpoint.rs), the bound on its size
//! (`journal::checkpoint_bytes_bound`), the counts it is computed from (`meta`).
//!
//! # The rule
//! Let `N` be the units a checkpoint of the current metadata writes at most, when it
//! writes every page (from [`MetaCounts`](crate::meta::MetaCounts):
//! `journal::checkpoint_units_bound`), `M` the units of the checkpoint that is current,
//! its directory and page chunks (or, while one is being written, what it will hold at
//! most: `Allocator::checkpoint_units`), and `T` the units metadata holds: checkpoint
//! units (`Allocator::meta`) plus the spare. Every change that adds metadata (a data
//! unit allocated, a mapping page copied, a volume, snapshot or clone created) is made
//! only if, after it,
//!
//! ```text
//! T >= max(M, 2N) + N + SLACK_UNITS
//! ```
//!
//! A checkpoint takes `N` units from the spare when it starts, hands back those its
//! plan does not need and those it did not use, and once its superblock is durable
//! gives the old directory and the page chunks it dropped to the spare: `T` is
//! unchanged, and since the new `M` is at most `2N` (the page chunks it keeps are at
//! least half live; docs/on-disk-format.md 9), the rule still holds after it if it
//! held before. So every checkpoint finds its units in the spare (a checkpoint never
//! fails for want of room, nor does the checkpoint at open), and as the spare's units
//! are backed, the host file system being full cannot stop one either. Data allocates
//! only from the free set; the spare grows from it (in the background, ahead of need)
//! and gives back what it holds beyond its target; data takes only the free units
//! beyond what the spare lacks of its target ([`Store::data_room`]), so that headroom
//! is kept even when the background growth is late. When the free set cannot give it
//! enough, the change is refused with `NoSpace`: the pool is full, whichever of the
//! pool or the host ran out first. The checkpoint bytes a change adds are counted
//! with the older form's record sizes (a page record of 36 bytes and 16 per entry, a
//! 28-byte page reference), which exceed what page bodies and page locations take.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Store;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{PageEntry, PageRec, PageRefRec, RecordHeader, VolumeRec, BLOCK_SIZE};
use crate::io::{self, AlignedBuf};
use crate::journal::{checkpoint_bytes_bound, checkpoint_units_bound, leaf_body_bytes};
use crate::meta::{Allocator, MapTable, LEAF_PAGES};

/// Units of the rule kept beyond the bound (module docs).
pub(crate) const SLACK_UNITS: u64 = 4;

/// Checkpoint bytes a mapping page with `mapped` entries takes: its record.
pub(crate) const fn page_record_bytes(mapped: u64) -> u64 {
    (size_of::<RecordHeader>() + size_of::<PageRec>()) as u64 + mapped * size_of::<PageEntry>() as u64
}

/// Checkpoint bytes a volume or snapshot named with `name_len` bytes adds by itself.
pub(crate) fn volume_record_bytes(name_len: usize) -> u64 {
    (size_of::<RecordHeader>() + size_of::<VolumeRec>() + name_len) as u64
}

/// Checkpoint bytes one more table holding a leaf, or one more leaf holding a page, adds.
pub(crate) const PAGE_REF_BYTES: u64 = (size_of::<RecordHeader>() + size_of::<PageRefRec>()) as u64;

/// Checkpoint bytes a new mapped unit adds by itself: its page entry and its refcount.
const UNIT_BYTES: u64 = 32;

/// Checkpoint bytes a copy on write may add once it installs its unit, counted when it
/// allocates the unit: the unit's refcount entry, and copies of a full leaf and a full
/// mapping page (if they are shared by then).
pub(crate) const COW_GROWTH: u64 =
    16 + page_record_bytes(crate::format::PAGE_ENTRIES as u64) + leaf_body_bytes(LEAF_PAGES as u32);

/// Checkpoint bytes that mapping the unmapped logical units `lunits` of `map` adds at
/// most: each unit's entry and refcount; for each leaf they fall in, a new leaf's
/// record and location if it has none, or a copy of it if other tables hold it; and
/// for each page, a new page's record if it has none, or a copy of it if its leaf or
/// the page is shared.
pub(crate) fn allocation_growth(map: &MapTable, lunits: &[u64]) -> u64 {
    let per_page = crate::format::PAGE_ENTRIES as u64;
    let mut growth = lunits.len() as u64 * UNIT_BYTES;
    let (mut last_page, mut last_leaf) = (None, None);
    for &l in lunits {
        let p = (l / per_page) as usize;
        if last_page == Some(p) {
            continue;
        }
        last_page = Some(p);
        let leaf = map.leaf(p / LEAF_PAGES);
        if last_leaf != Some(p / LEAF_PAGES) {
            last_leaf = Some(p / LEAF_PAGES);
            growth += match leaf {
                None => leaf_body_bytes(0) + PAGE_REF_BYTES,
                Some(leaf) if leaf.is_shared() => leaf_body_bytes(leaf.present()),
                Some(_) => 0,
            };
        }
        let leaf_shared = leaf.is_some_and(|leaf| leaf.is_shared());
        growth += match map.page(p) {
            None => page_record_bytes(0),
            Some(page) if leaf_shared || page.is_shared() => page_record_bytes(u64::from(page.mapped)),
            Some(_) => 0,
        };
    }
    growth
}

/// What a change that found no room needs: data units from the free set, and bytes of
/// checkpoint it adds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NeedRoom {
    /// Data units it allocates.
    pub units: u64,
    /// Checkpoint bytes it adds at most.
    pub extra: u64,
}

/// What one attempt of a change that adds metadata found ([`Store::with_room`]).
#[derive(Debug)]
pub(crate) enum Room<T> {
    /// The change was made (under its locks, with room); its answer.
    Done(T),
    /// No room: nothing changed, and this is what the change needs.
    Need(NeedRoom),
}

/// The remedies a change has tried so far ([`Store::make_room`]).
#[derive(Debug, Default)]
struct Tries {
    done: Vec<Remedy>,
    attempts: u32,
}

/// What may give a change room ([`Store::make_room`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Remedy {
    /// Frees wait for a commit to become durable.
    Commit,
    /// Freed units wait for their hole punch (punch.rs): free them unpunched, and wait
    /// for the batch being punched.
    Unpunch,
    /// The spare can grow from the free set.
    GrowSpare,
    /// The current checkpoint holds more than twice the next one's bound (deletes): a
    /// checkpoint lowers `max(M, 2N)`.
    Checkpoint,
}

impl Store {
    /// `N`: units a checkpoint of the metadata takes at most, with `extra` more bytes.
    pub(crate) fn checkpoint_need(&self, a: &Allocator, extra: u64) -> u64 {
        let bytes = checkpoint_bytes_bound(&a.counts, self.geo.unit_size) + a.pending_growth + extra;
        checkpoint_units_bound(bytes, self.geo.unit_size)
    }

    /// Units the spare must hold for the rule (module docs) with `extra` more bytes.
    pub(crate) fn spare_needed(&self, a: &Allocator, extra: u64) -> u64 {
        let n = self.checkpoint_need(a, extra);
        (a.checkpoint_units.max(2 * n) + n + SLACK_UNITS).saturating_sub(a.meta)
    }

    /// Whether a change adding `extra` checkpoint bytes keeps the rule.
    pub(crate) fn has_room(&self, a: &Allocator, extra: u64) -> bool {
        a.spare.len() as u64 >= self.spare_needed(a, extra)
    }

    /// What the spare grows to in the background: the rule's need and three times what
    /// a checkpoint takes (at least 16 units), so that changes rarely wait for it and a
    /// full pool still has room for its metadata to change: it can grow to about twice
    /// its size (a snapshot of every volume and a change in every mapping page) before
    /// such changes get `NoSpace` (the rule's `2N + N` grows by three units per unit of
    /// `N`). At steady state metadata then holds about six checkpoints' worth of units:
    /// the current one at up to twice its compact size, the next, and this headroom.
    fn spare_target(&self, a: &Allocator) -> u64 {
        self.spare_needed(a, 0) + self.headroom(a)
    }

    /// Units of the free set the spare is owed: what it lacks of its target.
    fn spare_owed(&self, a: &Allocator) -> u64 {
        self.spare_target(a).saturating_sub(a.spare.len() as u64)
    }

    /// Whether data may take `units` units of the free set now: only those beyond what
    /// the spare is owed. So a full pool keeps the spare's headroom for its metadata to
    /// change (snapshots, mapping pages copied on write) whatever the timing of the
    /// spare's growth in the background; before, data writes could take the units the
    /// committer had not yet moved to the spare, and a full pool then had less headroom
    /// on some runs than on others.
    /// (A change that allocates no data, `units` 0, always has it.)
    pub(crate) fn data_room(&self, a: &Allocator, units: u64) -> bool {
        units == 0 || a.free_count() >= units + self.spare_owed(a)
    }

    /// Units of the free units (the free set and the spare) that data may not take:
    /// the spare, or its target when it is below it. `Pool::status` reports them as
    /// reserved, so that free minus reserved is what data writes can still take.
    pub(crate) fn data_reserve(&self, a: &Allocator) -> u64 {
        (a.spare.len() as u64).max(self.spare_target(a))
    }

    fn headroom(&self, a: &Allocator) -> u64 {
        (3 * self.checkpoint_need(a, 0)).max(16)
    }

    /// After a change that added metadata: asks the committer to grow the spare when
    /// it falls below halfway between the need and the target.
    pub(crate) fn after_growth(&self, a: &Allocator) {
        let need = self.spare_needed(a, 0);
        let low = need + (self.spare_target(a) - need) / 2;
        if (a.spare.len() as u64) < low && a.free_count() > 0 {
            self.request_grow_spare();
        }
    }

    /// Gives back to the free set what the spare holds beyond its target and half the
    /// headroom again: after a checkpoint and after deletes.
    pub(crate) fn trim_spare(&self, a: &mut Allocator) {
        let keep = self.spare_target(a) + self.headroom(a) / 2;
        if a.spare.len() as u64 > keep {
            let n = a.spare.len() - keep as usize;
            a.shrink_spare(n);
        }
    }

    /// Whether a checkpoint now would lower what the rule needs: the current checkpoint
    /// holds more than twice the next one's bound (deletes since made the metadata
    /// smaller, and a checkpoint drops or cleans the page chunks they emptied).
    pub(crate) fn checkpoint_lowers_need(&self, a: &Allocator) -> bool {
        a.checkpoint_units > 2 * self.checkpoint_need(a, 0)
    }

    fn remedy(&self, a: &Allocator, need: NeedRoom, tried: &[Remedy]) -> Option<Remedy> {
        let untried = |r: Remedy| (!tried.contains(&r)).then_some(r);
        let short = self.spare_needed(a, need.extra).saturating_sub(a.spare.len() as u64);
        // Data short of units: the free set has too few beyond what the spare is owed.
        let data_short = !self.data_room(a, need.units);
        if short == 0 && !data_short {
            return None; // room enough; nothing to do (the caller retries anyway)
        }
        if short > 0 && a.free_count() >= need.units + short {
            if let Some(r) = untried(Remedy::GrowSpare) {
                return Some(r);
            }
        }
        // A checkpoint lowers what the rule needs, and so the spare's target.
        if self.checkpoint_lowers_need(a) {
            if let Some(r) = untried(Remedy::Checkpoint) {
                return Some(r);
            }
        }
        if !a.punch_queue.is_empty() || a.punching > 0 {
            if let Some(r) = untried(Remedy::Unpunch) {
                return Some(r);
            }
        }
        if !a.pending_free.is_empty() {
            return untried(Remedy::Commit);
        }
        None
    }

    /// The make-room protocol, which every change that adds metadata follows: runs
    /// `attempt`, which under its locks either makes the change, if the free set and the
    /// rule (module docs) have room for it, or changes nothing and says what it needs;
    /// then makes room ([`Self::make_room`]: a commit, growing the spare, a checkpoint,
    /// each tried once) and runs `attempt` again, until it is done or nothing can help.
    /// `attempt` takes no lock across an await of its own that this waits on: it is
    /// called again from scratch, so it re-reads all it decides on.
    ///
    /// Errors: `full()` when nothing can give the change room (the pool is full);
    /// those of `attempt`; those of [`Self::make_room`] (a full host file system, a
    /// failed commit or checkpoint).
    pub(crate) async fn with_room<T, F: Future<Output = Result<Room<T>>>>(
        self: &Arc<Self>,
        mut attempt: impl FnMut() -> F,
        full: impl FnOnce() -> Error,
    ) -> Result<T> {
        let mut tries = Tries::default();
        loop {
            match attempt().await? {
                Room::Done(answer) => return Ok(answer),
                Room::Need(need) => {
                    if !Box::pin(self.make_room(need, &mut tries)).await? {
                        return Err(full());
                    }
                }
            }
        }
    }

    /// After a change found no room for `need`: does the first thing not yet `tried`
    /// that may give it room (a commit when frees wait for one, growing the spare from
    /// the free set, a checkpoint that lowers the need) and returns `Ok(true)` for the
    /// change to try again, or `Ok(false)` when nothing can help: the pool is full.
    ///
    /// Errors: [`ErrorKind::NoSpace`] when the spare could not grow because the host
    /// file system is full; [`ErrorKind::Failed`] when the commit or checkpoint failed.
    async fn make_room(self: &Arc<Self>, need: NeedRoom, tried: &mut Tries) -> Result<bool> {
        tried.attempts += 1;
        if tried.attempts > 8 {
            return Ok(false);
        }
        let r = {
            let a = self.alloc.lock();
            match self.remedy(&a, need, &tried.done) {
                // Room may have come meanwhile (another change's remedy): try again.
                None => return Ok(self.data_room(&a, need.units) && self.has_room(&a, need.extra)),
                Some(r) => r,
            }
        };
        tried.done.push(r);
        match r {
            Remedy::Commit => {
                self.commit().await?;
                // The frees it made durable are needed now: not after their punch.
                self.unpunch().await;
            }
            Remedy::Unpunch => self.unpunch().await,
            Remedy::GrowSpare => self.grow_spare_async().await?,
            Remedy::Checkpoint => self.checkpoint_async().await?,
        }
        Ok(true)
    }

    /// Grows the spare to its target from the free set: first with units known to be
    /// backed, then with others, which are backed by writing zeros over them (a unit
    /// that is not in the spare or in use reads as nothing, so this changes no data).
    /// Called on the committer thread ([`Self::grow_spare_async`] asks it).
    ///
    /// Errors: [`ErrorKind::NoSpace`] when the host file system has no room to back
    /// the units (those written are kept); [`ErrorKind::Io`] on another write error
    /// (the pool then fails).
    pub(crate) fn grow_spare(&self) -> Result<()> {
        let to_back: Vec<u32> = {
            let mut a = self.alloc.lock();
            let want = self.spare_target(&a).saturating_sub(a.spare.len() as u64);
            let mut to_back = Vec::new();
            for _ in 0..want {
                match a.take_for_spare() {
                    // Known to be backed (a punched unit is no longer noted so).
                    Some((u, backed)) if backed || self.backed_all.load(Ordering::Relaxed) => a.spare.push_back(u),
                    Some((u, _)) => to_back.push(u),
                    None => break,
                }
            }
            to_back
        };
        if to_back.is_empty() {
            return Ok(());
        }
        let backed = self.back_units(&to_back);
        let mut a = self.alloc.lock();
        let mut host_full = false;
        let mut other = None;
        for (u, r) in to_back.into_iter().zip(backed) {
            match r {
                Ok(()) => a.spare.push_back(u),
                Err(e) => {
                    a.untake(u, false);
                    if e.raw_os_error() == Some(libc::ENOSPC) {
                        host_full = true;
                    } else {
                        other.get_or_insert(e);
                    }
                }
            }
        }
        drop(a);
        if let Some(e) = other {
            let e = Error::io("back a spare unit", e);
            self.fail(&e);
            return Err(e);
        }
        if host_full {
            self.host_full.store(true, Ordering::Relaxed);
            return Err(host_full_error());
        }
        Ok(())
    }

    /// Writes zeros over each of `units` (whole units), so that the host file system
    /// holds blocks for them; one result per unit. Refuses at once (`ENOSPC` for all)
    /// when the host reports less room than they take.
    ///
    /// Plain writes from the calling thread (the opening thread, or the committer), not
    /// the ring: at open these are a new ring's first writes, into holes of the pool
    /// file, and such writes were seen never to complete (two hangs of `Pool::open` in
    /// the tests, the kernel holding the entries with no completion). Backing units is
    /// rare and off the data path, so nothing is lost by writing them one by one.
    fn back_units(&self, units: &[u32]) -> Vec<std::io::Result<()>> {
        let us = self.geo.unit_size;
        let enospc = || Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        if io::available_bytes(&self.file).is_ok_and(|room| room < units.len() as u64 * us) {
            return units.iter().map(|_| enospc()).collect();
        }
        let zeros = AlignedBuf::zeroed(us as usize);
        let zeros = &zeros.full()[..us as usize];
        units
            .iter()
            .map(|&u| std::os::unix::fs::FileExt::write_all_at(&*self.file, zeros, self.geo.unit_offset(u64::from(u))))
            .collect()
    }

    /// Before the checkpoint at open: writes zeros into the holes of the superblocks
    /// and the log (they read as zeros already), so that no log batch ever needs room
    /// from the host; then fills the spare, first with free units that the pool file
    /// already holds blocks for (a full host file system keeps them: the spare of the
    /// run before is among them), then by backing others.
    ///
    /// Errors: [`ErrorKind::NoSpace`] when the host file system is too full to back
    /// even the units the checkpoint at open takes; [`ErrorKind::Io`].
    pub(crate) fn prepare_at_open(&self) -> Result<()> {
        let backed_all = self.backed_all.load(Ordering::Relaxed);
        if !backed_all {
            if let Err(e) = self.fill_holes(0, self.geo.data_offset) {
                if e.kind() != ErrorKind::NoSpace {
                    return Err(e);
                }
                tracing::warn!(
                    path = %self.path.display(),
                    "the host file system is full and the pool's log has holes it cannot back; commits may fail \
                     (and the pool stop) until it has room"
                );
            }
        }
        {
            let mut a = self.alloc.lock();
            let want = self.spare_target(&a) as usize;
            if backed_all {
                while a.spare.len() < want {
                    match a.take_for_spare() {
                        Some((u, _)) => a.spare.push_back(u),
                        None => break,
                    }
                }
            } else {
                let us = self.geo.unit_size;
                let start = self.geo.data_offset;
                let end = self.geo.unit_offset(a.unit_count());
                let ranges = io::data_ranges(&self.file, start, end, 1 << 20)
                    .map_err(|e| Error::io("look for the pool file's holes", e))?;
                'ranges: for (off, len) in ranges {
                    let first = (off - start).div_ceil(us);
                    let last = (off + len - start) / us;
                    for u in first..last {
                        if a.spare.len() >= want {
                            break 'ranges;
                        }
                        if a.take_unit(u as u32) {
                            a.spare.push_back(u as u32);
                        }
                    }
                }
            }
        }
        match self.grow_spare() {
            Err(e) if e.kind() == ErrorKind::NoSpace => {
                let a = self.alloc.lock();
                if (a.spare.len() as u64) < self.checkpoint_need(&a, 0) {
                    return Err(Error::new(
                        ErrorKind::NoSpace,
                        format!(
                            "the host file system holding the pool is full: the pool needs {} free units for its \
                             checkpoint and the host has room for {}; free space on it and open again",
                            self.checkpoint_need(&a, 0),
                            a.spare.len()
                        ),
                    ));
                }
                tracing::warn!(
                    path = %self.path.display(),
                    "the host file system holding the pool is full: writes that need new space get ENOSPC until it \
                     has room"
                );
                Ok(())
            }
            r => r,
        }
    }

    /// With the host file system full, the free units the pool file already holds
    /// blocks for are the ones writes can still take (units the pool freed, once written
    /// whole): when none is known, finds some (`SEEK_DATA`), for [`Allocator::alloc`] to
    /// take first. Once the host has room again (16 units' worth), the pool stops
    /// looking. Called on the data path before an allocation while `host_full` is set.
    pub(crate) fn refill_backed_free(&self) {
        let us = self.geo.unit_size;
        if io::available_bytes(&self.file).is_ok_and(|room| room >= 16 * us) {
            self.host_full.store(false, Ordering::Relaxed);
            return;
        }
        let (epoch, unit_count) = {
            let a = self.alloc.lock();
            if !a.backed_free.is_empty() {
                return;
            }
            (a.punch_epoch, a.unit_count())
        };
        let start = self.geo.data_offset;
        let end = self.geo.unit_offset(unit_count);
        let Ok(ranges) = io::data_ranges(&self.file, start, end, 4096) else { return };
        let mut a = self.alloc.lock();
        if a.punch_epoch != epoch {
            // Units freed by a punch since the search may be holes now; the next
            // allocation searches again.
            return;
        }
        for (off, len) in ranges {
            for u in (off - start).div_ceil(us)..(off + len - start) / us {
                if a.backed_free.len() >= 4096 {
                    return;
                }
                a.note_backed(u as u32);
            }
        }
    }

    /// Writes zeros into the holes of bytes `[start, end)` of the pool file.
    ///
    /// Errors: [`ErrorKind::NoSpace`] when the host file system has no room for them;
    /// [`ErrorKind::Io`].
    fn fill_holes(&self, start: u64, end: u64) -> Result<()> {
        let data = io::data_ranges(&self.file, start, end, usize::MAX)
            .map_err(|e| Error::io("look for the pool file's holes", e))?;
        let mut holes = Vec::new();
        let mut pos = start;
        for (off, len) in data.into_iter().chain(std::iter::once((end, 0))) {
            // Whole blocks only: a block partly data is allocated.
            let (h0, h1) = (pos.div_ceil(BLOCK_SIZE) * BLOCK_SIZE, off / BLOCK_SIZE * BLOCK_SIZE);
            if h1 > h0 {
                holes.push((h0, h1));
            }
            pos = off + len;
        }
        for (h0, h1) in holes {
            // Plain writes, not the ring: this runs once, at open, on the opening
            // thread, before any data-plane I/O (a one-off that gains nothing from the
            // ring).
            io::write_zeros(&self.file, h0, h1).map_err(|(at, e)| match e.raw_os_error() {
                Some(libc::ENOSPC) => host_full_error(),
                _ => Error::io(format!("fill the hole at byte {at} of the pool file"), e),
            })?;
        }
        Ok(())
    }
}

/// The error of a change that needs room the host file system does not have.
pub(crate) fn host_full_error() -> Error {
    Error::new(
        ErrorKind::NoSpace,
        "the host file system holding the pool is full (the pool itself has room): free space on it",
    )
}
