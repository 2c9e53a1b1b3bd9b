//! The data units' allocator: [`Allocator`] (refcounts, the free set and the spare,
//! pending frees and settling marks), its lock-free tables ([`RefcountTable`],
//! [`StripedCounts`]), and [`MetaCounts`]. Not here: the tables that map units (map.rs),
//! the rule that sizes the spare (the store's room.rs).

use std::collections::HashMap;
use std::sync::Arc;

use super::sync::{self, AtomicU32, AtomicU8, Ordering};
use super::{Leaf, MapPage, MapTable};

/// Per-unit refcounts, one byte per data unit, readable without the allocator's lock
/// (the allocator is the only writer).
///
/// A byte of 0 ..= 253 is the refcount itself; [`RefcountTable::BIG`] (254) means 254 or
/// more, with the exact value in the allocator's overflow map; [`RefcountTable::META`]
/// (255) marks a unit holding checkpoint metadata. Lock-free readers only ask "exactly
/// one" or "more than one", which the byte answers alone.
///
/// Allocated zeroed (`calloc`, fresh pages from the kernel), so units never used cost no
/// resident memory: 16 MiB per TiB of 64 KiB units, resident only where units are in use.
/// Kept in segments of [`RefcountTable::SEGMENT`] units, so that the table grows with
/// the pool ([`Allocator::grow`]) without moving: a segment, once made, stays where it
/// is for the table's life, and one past the length reads as 0.
pub struct RefcountTable {
    /// Segment `i` holds units `i * SEGMENT ..`; made in order, none past `len`'s.
    segments: Box<[std::sync::OnceLock<Box<[AtomicU8]>>]>,
    /// Number of units (only grows, under the allocator's lock).
    len: std::sync::atomic::AtomicUsize,
}

impl RefcountTable {
    /// The byte of a refcount of 254 or more (exact value kept apart).
    pub const BIG: u8 = 254;
    /// The byte of a checkpoint unit.
    pub const META: u8 = 255;
    /// Units per segment: 64 Mi (4 TiB of 64 KiB units). A segment is 64 MiB of address
    /// space, above the C library's largest threshold for mapping an allocation on its
    /// own, so it comes zeroed from the kernel and only the pages of units in use become
    /// resident (with 1 MiB segments, which may come from the heap and be cleared by
    /// hand, opening a 4 TiB pool went past 128 MiB resident). Few under the
    /// concurrency checker, whose atomics are costly to create.
    pub const SEGMENT: usize = if cfg!(feature = "shuttle") { 64 } else { 1 << 26 };

    /// A table of `units` zeros that can grow to `max_units`.
    fn new(units: usize, max_units: usize) -> RefcountTable {
        let max_units = max_units.max(units);
        let t = RefcountTable {
            segments: (0..max_units.div_ceil(Self::SEGMENT)).map(|_| std::sync::OnceLock::new()).collect(),
            len: std::sync::atomic::AtomicUsize::new(0),
        };
        t.grow(units);
        t
    }

    /// Makes the table `units` long (at least its length; at most what it was made to
    /// grow to). Called by the only writer.
    fn grow(&self, units: usize) {
        assert!(units <= self.segments.len() * Self::SEGMENT, "refcount table grown past its bound");
        for seg in &self.segments[..units.div_ceil(Self::SEGMENT)] {
            seg.get_or_init(|| sync::zeroed(Self::SEGMENT));
        }
        self.len.fetch_max(units, std::sync::atomic::Ordering::Release);
    }

    /// Number of units.
    pub fn len(&self) -> usize {
        self.len.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the table has no units.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn slot(&self, unit: u32) -> Option<&AtomicU8> {
        let u = unit as usize;
        self.segments.get(u / Self::SEGMENT)?.get().map(|s| &s[u % Self::SEGMENT])
    }

    /// The byte of `unit` (see the type's docs); 0 past the table.
    #[inline]
    pub fn byte(&self, unit: u32) -> u8 {
        self.slot(unit).map_or(0, |b| b.load(Ordering::Acquire))
    }

    /// Stores the byte of `unit` (the only writer; `unit` within the table).
    fn store(&self, unit: u32, byte: u8) {
        self.slot(unit).expect("a refcount past the table").store(byte, Ordering::Release)
    }

    /// The non-zero bytes, in unit order.
    fn nonzero(&self) -> impl Iterator<Item = u32> + '_ {
        let len = self.len();
        self.segments
            .iter()
            .map_while(|s| s.get())
            .enumerate()
            .flat_map(|(i, s)| s.iter().enumerate().map(move |(j, b)| ((i * Self::SEGMENT + j) as u32, b)))
            .take(len)
            .filter(|(_, b)| b.load(Ordering::Relaxed) != 0)
            .map(|(u, _)| u)
    }

    /// Whether more than one mapping page references `unit` (a write must copy it).
    #[inline]
    pub fn is_shared(&self, unit: u32) -> bool {
        matches!(self.byte(unit), 2..=Self::BIG)
    }

    /// Whether exactly one mapping page references `unit`.
    #[inline]
    pub fn is_exclusive(&self, unit: u32) -> bool {
        self.byte(unit) == 1
    }
}

/// Counters for "some I/O or change concerns this data unit" that must be cheap to
/// keep for every unit of a huge pool: a fixed table of [`StripedCounts::STRIPES`]
/// counters (256 KiB), unit `u` counting in stripe `u mod STRIPES`.
///
/// A zero count proves no unit of the stripe is counted; a non-zero count only says
/// that one of them may be. Users must treat "may be" as "is" (delay a free, copy on
/// write), which is always safe and, with few units counted at once, rarely costs.
pub struct StripedCounts(Box<[AtomicU32]>);

impl StripedCounts {
    /// Number of counters (few under the concurrency checker, whose atomics are costly
    /// to create, so that collisions are easy to reach there too).
    pub const STRIPES: usize = if cfg!(feature = "shuttle") { 64 } else { 1 << 16 };

    /// All counts zero.
    pub fn new() -> StripedCounts {
        StripedCounts(sync::zeroed(Self::STRIPES))
    }

    /// Whether `unit` may be counted (its stripe's count is non-zero).
    #[inline]
    pub fn is_set(&self, unit: u32) -> bool {
        self.0[unit as usize % Self::STRIPES].load(Ordering::Acquire) != 0
    }

    /// Counts `unit` once more.
    #[inline]
    pub fn add(&self, unit: u32) {
        self.0[unit as usize % Self::STRIPES].fetch_add(1, Ordering::AcqRel);
    }

    /// Counts `unit` once less (it must have been added).
    #[inline]
    pub fn sub(&self, unit: u32) {
        let before = self.0[unit as usize % Self::STRIPES].fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "unit {unit} was not counted");
    }
}

impl Default for StripedCounts {
    fn default() -> Self {
        StripedCounts::new()
    }
}

/// Refcount value marking a unit that holds checkpoint metadata.
pub const META: u32 = u32::MAX;

/// Lengths of [`Allocator`]'s pending lists at the start of a commit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingMark {
    /// Entries of `pending_free` covered.
    pub free: usize,
    /// Entries of `pending_settle` covered.
    pub settle: usize,
}

/// Refcounts and free space of the data units.
///
/// A unit is *free* (allocatable) only when its refcount is 0, it holds no checkpoint
/// metadata, and the record that dropped its last reference is durable: a freed unit
/// first waits in `pending_free` until the commit that carries its free completes.
///
/// Likewise a unit is *exclusive* (written in place) only when the records that made it
/// so are durable: a unit whose refcount falls to 1, or whose mapping page loses its
/// other owners, stays *settling* (counted in [`Allocator::settling_table`], listed in
/// `pending_settle`) until the commit that carries those records completes. Until then
/// writes copy it on write, because after a crash the volume or snapshot that let go of
/// it may still map it.
pub struct Allocator {
    /// Per-unit refcounts; changed only through `&mut self`, readable without the
    /// allocator's lock through [`Allocator::refcount_table`].
    refcount: Arc<RefcountTable>,
    /// Exact refcounts of the units whose byte is [`RefcountTable::BIG`].
    pub(super) big: HashMap<u32, u32>,
    /// Units allocated for copy-on-write whose mapping is not installed yet; a
    /// checkpoint counts them as free.
    pub cow_inflight: std::collections::HashSet<u32>,
    free_bits: Vec<u64>,
    free_count: u64,
    cursor: usize,
    /// Units whose refcount fell to 0, in the order their records were logged.
    pub pending_free: Vec<u32>,
    /// Units that became exclusive, in the order their records were logged.
    pub pending_settle: Vec<u32>,
    /// How many entries of `pending_settle` name each unit (non-zero: may be settling).
    settling: Arc<StripedCounts>,
    /// Units with refcount > 0 (data).
    pub used: u64,
    /// Units holding checkpoint metadata (the current checkpoint's, and those a
    /// checkpoint being written holds).
    pub meta: u64,
    /// What a checkpoint of the metadata would hold, kept up to date by every change
    /// of the tables ([`MapTable::set`], [`MapTable::share`], [`MapTable::release_all`])
    /// and of the volume list (the pool): the basis of the bound on its size.
    pub counts: MetaCounts,
    /// Units set aside for checkpoints, in no table and not in the free set: data never
    /// takes them. Each is *backed*: the pool file holds blocks for all of it (written,
    /// or a block device), so a checkpoint written there never needs room from the host
    /// file system. Taken from the front and given back at the back, so that the units
    /// of the last checkpoint, which the older superblock slot still names, are the last
    /// to be written over (a rollback to that slot then still finds them).
    pub spare: std::collections::VecDeque<u32>,
    /// Units of the checkpoint that will be current once the one being written (if
    /// any) is durable: the current checkpoint's otherwise.
    pub checkpoint_units: u64,
    /// Checkpoint bytes that changes in flight will add when they finish (a copy on
    /// write installs its unit, maybe copying a mapping page), counted when they began.
    pub pending_growth: u64,
    /// Free units known to be backed (given back from the spare): the first to take
    /// when the spare must grow. May name units taken since; check before use.
    pub backed_free: Vec<u32>,
    /// Units whose frees are durable, waiting for their blocks to be given back to the
    /// host file system (hole punching) before they become allocatable.
    pub punch_queue: Vec<u32>,
    /// Units taken from `punch_queue` and being punched now.
    pub punching: u64,
    /// Batches of punched units freed so far: a search for backed units that began
    /// before a change of it may have seen a unit's blocks that are gone.
    pub punch_epoch: u64,
}

/// What a checkpoint of the metadata holds, counted: enough to bound its size in bytes
/// (`journal::checkpoint_bytes_bound`). Refcount entries are one per used unit
/// ([`Allocator::used`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaCounts {
    /// Volumes and snapshots.
    pub volumes: u64,
    /// Bytes of their variable parts: their names and their property records (labels
    /// and attachments, `REC_PROPS`).
    pub volume_bytes: u64,
    /// Distinct mapping pages (a page several leaves hold counts once).
    pub pages: u64,
    /// Pages held, counted once per distinct leaf holding each.
    pub page_refs: u64,
    /// Distinct leaves (a leaf several tables hold counts once).
    pub leaves: u64,
    /// Leaves held, counted once per table holding each.
    pub leaf_refs: u64,
    /// Mapped entries of the distinct pages.
    pub entries: u64,
}

impl MetaCounts {
    /// The same counts with `volumes` volumes of `volume_bytes` bytes of variable parts.
    pub fn with_volumes(self, volumes: u64, volume_bytes: u64) -> MetaCounts {
        MetaCounts { volumes, volume_bytes, ..self }
    }

    /// The counts of `tables` (each a volume's or snapshot's table, with the bytes of
    /// its variable parts: name and property record): walks every leaf and page once.
    pub fn of<'a>(tables: impl IntoIterator<Item = (&'a MapTable, u64)>) -> MetaCounts {
        let mut c = MetaCounts::default();
        let mut seen: std::collections::HashSet<*const MapPage> = Default::default();
        let mut seen_leaves: std::collections::HashSet<*const Leaf> = Default::default();
        for (map, own_bytes) in tables {
            c.volumes += 1;
            c.volume_bytes += own_bytes;
            for (_, leaf) in map.leaves() {
                c.leaf_refs += 1;
                if !seen_leaves.insert(Arc::as_ptr(leaf)) {
                    continue;
                }
                c.leaves += 1;
                for (_, page) in leaf.pages() {
                    c.page_refs += 1;
                    if seen.insert(Arc::as_ptr(page)) {
                        c.pages += 1;
                        c.entries += u64::from(page.mapped);
                    }
                }
            }
        }
        c
    }
}

impl Allocator {
    /// The most units an allocator can grow to: the format's bound (a unit number is
    /// 32 bits, `u32::MAX` excluded); under the concurrency checker, no growth.
    pub const MAX_UNITS: usize = if cfg!(feature = "shuttle") { 0 } else { u32::MAX as usize - 1 };

    /// An allocator over `units` data units, all free. Its per-unit tables are zeroed
    /// and untouched, so they cost resident memory only where units come into use.
    /// It can [grow](Self::grow) to [`Self::MAX_UNITS`].
    pub fn new(units: usize) -> Allocator {
        let mut free_bits = vec![u64::MAX; units.div_ceil(64)];
        if !units.is_multiple_of(64) {
            free_bits[units / 64] = (1 << (units % 64)) - 1;
        }
        Allocator {
            refcount: Arc::new(RefcountTable::new(units, Self::MAX_UNITS)),
            big: HashMap::new(),
            cow_inflight: Default::default(),
            free_bits,
            free_count: units as u64,
            cursor: 0,
            pending_free: Vec::new(),
            pending_settle: Vec::new(),
            settling: Arc::new(StripedCounts::new()),
            used: 0,
            meta: 0,
            counts: MetaCounts::default(),
            spare: Default::default(),
            checkpoint_units: 0,
            pending_growth: 0,
            backed_free: Vec::new(),
            punch_queue: Vec::new(),
            punching: 0,
            punch_epoch: 0,
        }
    }

    /// An allocator over `refcount.len()` units with these refcounts (META for
    /// checkpoint units); everything else is free.
    pub fn from_refcounts(refcount: Vec<u32>) -> Allocator {
        let mut a = Allocator::new(refcount.len());
        for (u, &r) in refcount.iter().enumerate().filter(|(_, r)| **r != 0) {
            a.set_loaded(u as u32, r);
        }
        a
    }

    /// Gives the free unit `u` the refcount `r` (non-zero; [`META`] for a checkpoint
    /// unit), as read from a checkpoint or copied into a checkpoint's snapshot.
    pub fn set_loaded(&mut self, u: u32, r: u32) {
        debug_assert!(r != 0 && self.rc(u) == 0);
        self.set_rc(u, r);
        self.free_bits[u as usize / 64] &= !(1 << (u % 64));
        self.free_count -= 1;
        if r == META {
            self.meta += 1;
        } else {
            self.used += 1;
        }
    }

    /// Adds units `unit_count() .. units`, free (a pool grown: docs/on-disk-format.md
    /// 6.4). `units` at most [`Self::MAX_UNITS`] (the caller checks); fewer than
    /// [`Self::unit_count`] change nothing.
    pub fn grow(&mut self, units: usize) {
        let old = self.unit_count() as usize;
        if units <= old {
            return;
        }
        self.refcount.grow(units);
        // Whole words at once: a grow by 2^30 units takes milliseconds, not seconds.
        let (first_word, last_word) = (old / 64, units.div_ceil(64));
        self.free_bits.resize(last_word, u64::MAX);
        if !old.is_multiple_of(64) {
            self.free_bits[first_word] |= u64::MAX << (old % 64);
        }
        if !units.is_multiple_of(64) {
            self.free_bits[last_word - 1] &= (1 << (units % 64)) - 1;
        }
        self.free_count += (units - old) as u64;
    }

    /// Number of data units managed.
    pub fn unit_count(&self) -> u64 {
        self.refcount.len() as u64
    }

    /// Units allocatable now.
    pub fn free_count(&self) -> u64 {
        self.free_count
    }

    #[inline]
    fn rc(&self, unit: u32) -> u32 {
        match self.refcount.byte(unit) {
            RefcountTable::META => META,
            RefcountTable::BIG => self.big[&unit],
            b => u32::from(b),
        }
    }

    #[inline]
    fn set_rc(&mut self, unit: u32, v: u32) {
        let byte = if v == META {
            RefcountTable::META
        } else if v >= u32::from(RefcountTable::BIG) {
            self.big.insert(unit, v);
            RefcountTable::BIG
        } else {
            v as u8
        };
        if byte != RefcountTable::BIG && self.refcount.byte(unit) == RefcountTable::BIG {
            self.big.remove(&unit);
        }
        self.refcount.store(unit, byte)
    }

    /// Refcount of `unit` ([`META`] for checkpoint units).
    pub fn refcount(&self, unit: u32) -> u32 {
        self.rc(unit)
    }

    /// The units with a non-zero refcount, in ascending order, with their refcounts
    /// ([`META`] for checkpoint units). Reads every counter; allocates nothing.
    pub fn nonzero_refcounts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.refcount.nonzero().map(|u| (u, self.rc(u)))
    }

    /// The refcount table itself, for lock-free reads (a value may be stale by the
    /// time it is used; callers only use it where that is harmless).
    pub fn refcount_table(&self) -> Arc<RefcountTable> {
        self.refcount.clone()
    }

    fn set_free(&mut self, u: u32) {
        let (w, b) = (u as usize / 64, u % 64);
        debug_assert!(self.free_bits[w] & (1 << b) == 0);
        self.free_bits[w] |= 1 << b;
        self.free_count += 1;
    }

    fn take_free(&mut self) -> Option<u32> {
        if self.free_count == 0 {
            return None;
        }
        let words = self.free_bits.len();
        let start = self.cursor / 64;
        for k in 0..=words {
            let w = (start + k) % words;
            let bits = self.free_bits[w];
            if bits != 0 {
                let b = bits.trailing_zeros();
                self.free_bits[w] &= !(1 << b);
                self.free_count -= 1;
                let u = w * 64 + b as usize;
                self.cursor = u + 1;
                return Some(u as u32);
            }
        }
        None
    }

    /// Allocates a data unit with refcount 1 from the free set (never the spare).
    /// `None` when the free set is empty. Whether the metadata it adds has room is the
    /// caller's check (the pool's).
    pub fn alloc(&mut self) -> Option<u32> {
        // A unit known to be backed first: writing it needs no room from the host.
        let u = match self.take_backed() {
            Some(u) => u,
            None => self.take_free()?,
        };
        self.set_rc(u, 1);
        self.used += 1;
        Some(u)
    }

    /// Takes a unit out of the free set for the spare (or for backing it first):
    /// preferably one known to be backed. `None` when the free set is empty; the flag
    /// says whether the unit is known to be backed.
    pub fn take_for_spare(&mut self) -> Option<(u32, bool)> {
        match self.take_backed() {
            Some(u) => Some((u, true)),
            None => self.take_free().map(|u| (u, false)),
        }
    }

    /// Takes a free unit of `backed_free` out of the free set, if one is still free.
    fn take_backed(&mut self) -> Option<u32> {
        while let Some(u) = self.backed_free.pop() {
            let (w, b) = (u as usize / 64, u % 64);
            if self.free_bits[w] & (1 << b) != 0 {
                self.free_bits[w] &= !(1 << b);
                self.free_count -= 1;
                return Some(u);
            }
        }
        None
    }

    /// Notes that the free unit `u` is known to be backed (if it is free).
    pub fn note_backed(&mut self, u: u32) {
        let (w, b) = (u as usize / 64, u % 64);
        if self.free_bits[w] & (1 << b) != 0 {
            self.backed_free.push(u);
        }
    }

    /// Takes the free unit `u` out of the free set, if it is in it.
    pub fn take_unit(&mut self, u: u32) -> bool {
        let (w, b) = (u as usize / 64, u % 64);
        if self.rc(u) != 0 || self.free_bits[w] & (1 << b) == 0 {
            return false;
        }
        self.free_bits[w] &= !(1 << b);
        self.free_count -= 1;
        true
    }

    /// Gives back to the free set a unit taken by [`Self::take_for_spare`] or
    /// [`Self::take_unit`] that did not go to the spare; `backed` if it is known to be.
    pub fn untake(&mut self, u: u32, backed: bool) {
        self.set_free(u);
        if backed {
            self.backed_free.push(u);
        }
    }

    /// Moves `n` units of the spare (at most all) back to the free set.
    pub fn shrink_spare(&mut self, n: usize) {
        for _ in 0..n.min(self.spare.len()) {
            let u = self.spare.pop_front().expect("a spare unit");
            self.untake(u, true);
        }
    }

    /// Takes a unit of the spare for checkpoint metadata. `None` when the spare is empty.
    pub fn alloc_meta(&mut self) -> Option<u32> {
        let u = self.spare.pop_front()?;
        self.set_rc(u, META);
        self.meta += 1;
        Some(u)
    }

    /// Takes a free unit for checkpoint metadata when the spare has none left (the
    /// bound on a checkpoint's size is meant to make this unneeded): it may not be
    /// backed. `None` when the free set is empty too.
    pub fn alloc_meta_from_free(&mut self) -> Option<u32> {
        let u = self.take_free()?;
        self.set_rc(u, META);
        self.meta += 1;
        Some(u)
    }

    /// Gives a checkpoint unit back to the spare once no durable superblock refers to
    /// it (or its checkpoint was not written): it stays backed.
    pub fn retire_meta(&mut self, u: u32) {
        debug_assert_eq!(self.rc(u), META);
        self.set_rc(u, 0);
        self.meta -= 1;
        self.spare.push_back(u);
    }

    /// One more reference to a data unit (a replayed mapping, or sharing).
    pub fn incref(&mut self, u: u32) {
        let r = self.rc(u);
        if r == 0 {
            // Taken out of the free set by replay.
            let (w, b) = (u as usize / 64, u % 64);
            if self.free_bits[w] & (1 << b) != 0 {
                self.free_bits[w] &= !(1 << b);
                self.free_count -= 1;
            }
            self.used += 1;
        }
        self.set_rc(u, r + 1);
    }

    /// One reference fewer; at zero the unit waits in `pending_free`, at one it is
    /// settling (see the type's docs).
    pub fn decref(&mut self, u: u32) {
        let r = self.rc(u);
        debug_assert!(r > 0 && r != META);
        if r == 2 {
            // Settling before the refcount reads one (module docs): a lock-free reader
            // that sees the one sees the mark.
            self.unsettle(u);
        }
        self.set_rc(u, r - 1);
        if r == 1 {
            self.used -= 1;
            self.pending_free.push(u);
        }
    }

    /// Marks `u` settling: it may have become exclusive by a change not yet durable.
    pub fn unsettle(&mut self, u: u32) {
        self.settling.add(u);
        self.pending_settle.push(u);
    }

    /// Settling counts, for lock-free reads on the write path: a unit that may be
    /// settling must be copied on write.
    pub fn settling_table(&self) -> Arc<StripedCounts> {
        self.settling.clone()
    }

    /// How far the pending lists reach now; a commit that starts here makes everything
    /// before the mark durable, and then calls [`Allocator::release_pending`] with it.
    pub fn pending_mark(&self) -> PendingMark {
        PendingMark { free: self.pending_free.len(), settle: self.pending_settle.len() }
    }

    /// Makes the pending frees and settles before `mark` final (their records are
    /// durable): the units become allocatable, except units that in-flight I/O still
    /// pins, which stay pending; settling units may be written in place again.
    pub fn release_pending(&mut self, mark: PendingMark, pins: &StripedCounts) {
        self.release_pending_punching(mark, pins, false);
    }

    /// [`Self::release_pending`], except that with `punch` the units it would free go
    /// to [`Self::punch_queue`] instead: the pool gives their blocks back to the host
    /// first ([`Self::take_punch_batch`], [`Self::finish_punch`]), so that no write to
    /// a unit taken again can be punched away.
    pub fn release_pending_punching(&mut self, mark: PendingMark, pins: &StripedCounts, punch: bool) {
        let s = mark.settle.min(self.pending_settle.len());
        for u in self.pending_settle.drain(..s) {
            self.settling.sub(u);
        }
        let n = mark.free.min(self.pending_free.len());
        let done: Vec<u32> = self.pending_free.drain(..n).collect();
        for u in done {
            if self.rc(u) != 0 {
                continue; // re-referenced by replay of a later record
            }
            if pins.is_set(u) {
                self.pending_free.push(u);
            } else if punch {
                self.punch_queue.push(u);
            } else {
                self.set_free(u);
            }
        }
    }

    /// Takes up to `max` units of the punch queue to punch now; they count in
    /// [`Self::punching`] until [`Self::finish_punch`].
    pub fn take_punch_batch(&mut self, max: usize) -> Vec<u32> {
        let n = max.min(self.punch_queue.len());
        let batch: Vec<u32> = self.punch_queue.drain(..n).collect();
        self.punching += batch.len() as u64;
        batch
    }

    /// Frees the units of a batch [`Self::take_punch_batch`] gave, now punched: they
    /// are no longer known to be backed (a unit noted in `backed_free` may have been
    /// taken and freed since).
    pub fn finish_punch(&mut self, batch: &[u32]) {
        if !self.backed_free.is_empty() {
            let mut sorted = batch.to_vec();
            sorted.sort_unstable();
            self.backed_free.retain(|u| sorted.binary_search(u).is_err());
        }
        for &u in batch {
            debug_assert_eq!(self.rc(u), 0);
            self.set_free(u);
        }
        self.punching -= batch.len() as u64;
        self.punch_epoch += 1;
    }

    /// Frees the units still waiting in the punch queue without punching them (room is
    /// needed now, or the host cannot punch); returns how many.
    pub fn free_punch_queue(&mut self) -> usize {
        let queue = std::mem::take(&mut self.punch_queue);
        for &u in &queue {
            self.set_free(u);
        }
        queue.len()
    }

    /// After replay: every pending free and settle is durable (it came from the log).
    pub fn release_all(&mut self) {
        for u in std::mem::take(&mut self.pending_settle) {
            self.settling.sub(u);
        }
        let pending = std::mem::take(&mut self.pending_free);
        for u in pending {
            if self.rc(u) == 0 {
                let (w, b) = (u as usize / 64, u % 64);
                if self.free_bits[w] & (1 << b) == 0 {
                    self.set_free(u);
                }
            }
        }
    }
}
