//! In-memory metadata: mapping tables of thin volumes, and the data-unit allocator.
//!
//! Lives here: [`MapTable`] (logical unit -> data unit + written-block bitmap, in
//! 512-entry pages that snapshots and clones share and that copy on write),
//! [`Allocator`] (per-unit refcounts, the free set, frees waiting to become durable),
//! and [`writable_in_place`], the copy-on-write decision of the data path.
//!
//! Refcounting is lazy, as in qcow2 and btrfs: a data unit's refcount counts the
//! *pages* that reference it, and a page's `owners` counts the tables (volumes,
//! snapshots) that hold it. Sharing a table bumps only `owners`; when an owner changes a
//! page held by others, it copies the page and increments the refcount of every unit
//! the page maps. A unit is exclusive to a table when its page has one owner and the
//! unit a refcount of one; otherwise a write must copy the unit first.
//!
//! # The sharing signals and their order
//! The data path decides "may this write go in place?" without the allocator's lock,
//! from three signals read in this order: the page's `owners`, the unit's refcount, the
//! unit's settling count ([`writable_in_place`]). Every change of them keeps one rule:
//! **a signal that says "shared" is raised before any signal that said "shared" is
//! lowered**, so that a reader that sees one lowered sees the other raised:
//! - copying a shared page ([`MapTable::set`]) gives each unit of the copy its
//!   reference *before* the original page loses this table as an owner;
//! - a unit whose refcount falls to one is marked settling *before* the refcount is
//!   stored ([`Allocator::decref`]);
//! - a page left to a single owner by a delete has its units marked settling *before*
//!   its owner count falls ([`MapTable::release_all`]).
//!
//! A settling mark is released only once the change that made the unit exclusive is
//! durable (on-disk-format.md 6.1 rule 9), so a unit never looks exclusive while another
//! table can still reach it, in memory or after a crash. Every change of a page's owner
//! count happens with the allocator locked (the `&mut Allocator` these calls take), so
//! "is the page shared?" and the change that follows are one step: two holders copying
//! a page at once, or one copying while the other is deleted, see each other, and
//! whoever takes a page's owner count to zero drops its units' references.
//! `tests/sharing_model.rs` checks these interleavings with a deterministic scheduler.
//!
//! Not here: I/O, logging, locking (the pool wraps these in its locks). Public so that
//! benchmarks, tools and the concurrency checks can exercise them; the pool is their
//! only writer.

use std::collections::HashMap;
use std::sync::Arc;

/// The atomics of the sharing state machine: std's, or shuttle's when the engine is
/// built for the deterministic concurrency checks (feature `shuttle`), so that its
/// schedulers can interleave threads at every load and store of owners, refcounts and
/// settling counts.
mod sync {
    #[cfg(feature = "shuttle")]
    pub use shuttle::sync::atomic::{AtomicU32, AtomicU8};
    pub use std::sync::atomic::Ordering;
    #[cfg(not(feature = "shuttle"))]
    pub use std::sync::atomic::{AtomicU32, AtomicU8};

    /// `n` atomics of value 0. With std's, one zeroed allocation (`calloc`: pages the
    /// kernel hands out zeroed, resident only once touched).
    #[cfg(not(feature = "shuttle"))]
    pub fn zeroed<T: zerocopy::FromZeros>(n: usize) -> Box<[T]> {
        use zerocopy::FromZeros;
        <[T]>::new_box_zeroed_with_elems(n).expect("allocating a zeroed table")
    }

    /// `n` atomics of value 0.
    #[cfg(feature = "shuttle")]
    pub fn zeroed<T: Default>(n: usize) -> Box<[T]> {
        (0..n).map(|_| T::default()).collect()
    }
}
use sync::{AtomicU32, AtomicU8, Ordering};

use crate::format::PAGE_ENTRIES;

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
pub struct RefcountTable(Box<[AtomicU8]>);

impl RefcountTable {
    /// The byte of a refcount of 254 or more (exact value kept apart).
    pub const BIG: u8 = 254;
    /// The byte of a checkpoint unit.
    pub const META: u8 = 255;

    fn new(units: usize) -> RefcountTable {
        RefcountTable(sync::zeroed(units))
    }

    /// Number of units.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the table has no units.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The byte of `unit` (see the type's docs).
    #[inline]
    pub fn byte(&self, unit: u32) -> u8 {
        self.0[unit as usize].load(Ordering::Acquire)
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

/// Whether a write may go in place into data unit `punit`, mapped at `lunit` of `map`:
/// no other table holds its page, no other page maps it, and it is not settling (it did
/// not become exclusive by a change that is not durable yet). Otherwise the write must
/// copy the unit first. Call with `map` locked (shared is enough); needs no other lock.
///
/// Reads the page's owners, then the refcount, then the settling count: the order that
/// the transitions of the module docs ("The sharing signals and their order") are
/// written against.
pub fn writable_in_place(
    map: &MapTable,
    lunit: u64,
    punit: u32,
    refcounts: &RefcountTable,
    settling: &StripedCounts,
) -> bool {
    !map.page_shared(lunit) && refcounts.is_exclusive(punit) && !settling.is_set(punit)
}

/// "Unmapped" in [`Entry::punit`].
pub const UNMAPPED: u32 = u32::MAX;
/// Refcount value marking a unit that holds checkpoint metadata.
pub const META: u32 = u32::MAX;

/// One mapping entry: 8 bytes, so a lookup touches a single cache line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Data unit, or [`UNMAPPED`].
    pub punit: u32,
    /// Bit `i` set: block `i` of the unit holds written data; clear: reads as zeros.
    pub bitmap: u32,
}

impl Entry {
    /// The unmapped entry.
    pub const EMPTY: Entry = Entry { punit: UNMAPPED, bitmap: 0 };
    /// Whether the entry names a data unit.
    pub fn is_mapped(&self) -> bool {
        self.punit != UNMAPPED
    }
}

/// 512 consecutive mapping entries (4 KiB), shared by `owners` tables.
pub struct MapPage {
    /// The entries, by index in the page.
    pub entries: [Entry; PAGE_ENTRIES],
    /// Number of mapped entries.
    pub mapped: u32,
    /// Tables (volumes, snapshots) holding this page; more than one means shared.
    pub owners: AtomicU32,
}

impl Clone for MapPage {
    /// A private copy (one owner) with the same entries.
    fn clone(&self) -> MapPage {
        MapPage { entries: self.entries, mapped: self.mapped, owners: AtomicU32::new(1) }
    }
}

impl MapPage {
    /// An empty page with one owner.
    pub fn new() -> MapPage {
        MapPage { entries: [Entry::EMPTY; PAGE_ENTRIES], mapped: 0, owners: AtomicU32::new(1) }
    }

    /// Whether more than one table holds the page.
    pub fn is_shared(&self) -> bool {
        self.owners.load(Ordering::Acquire) > 1
    }

    /// Data units the page maps (one per mapped entry).
    pub fn units(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries.iter().filter(|e| e.is_mapped()).map(|e| e.punit)
    }
}

impl Default for MapPage {
    fn default() -> Self {
        MapPage::new()
    }
}

/// Mapping pages per leaf of a [`MapTable`]: a leaf (4 KiB of page pointers) covers
/// 512 pages, 262,144 logical units.
const LEAF_PAGES: usize = 512;

/// One leaf of a [`MapTable`]: page pointers by `page index % LEAF_PAGES`.
type Leaf = [Option<Arc<MapPage>>; LEAF_PAGES];

/// A volume's mapping: pages indexed by `lunit / 512`; an absent page is all unmapped.
///
/// The pages sit in a two-level table: leaves of 512 page pointers, present only where
/// a page is, under a vector of leaf pointers that reaches only as far as the last
/// present leaf. A 1 TiB volume written in its first GiB holds one 4 KiB leaf; one
/// written only at its last byte holds one leaf and 8 bytes per 16 GiB before it
/// (with 64 KiB units), not 8 bytes per 32 MiB. The volume checks ranges against its
/// size; the table takes any logical unit.
#[derive(Clone, Default)]
pub struct MapTable {
    leaves: Vec<Option<Box<Leaf>>>,
}

impl MapTable {
    /// An empty table.
    pub fn new() -> MapTable {
        MapTable::default()
    }

    /// The page of index `p` (logical units `p * 512 ..`), if present.
    #[inline]
    pub fn page(&self, p: usize) -> Option<&Arc<MapPage>> {
        self.leaves.get(p / LEAF_PAGES)?.as_ref()?[p % LEAF_PAGES].as_ref()
    }

    /// Entry of `lunit` (unmapped when out of the table).
    #[inline]
    pub fn get(&self, lunit: u64) -> Entry {
        let (p, i) = split(lunit);
        match self.page(p) {
            Some(page) => page.entries[i],
            None => Entry::EMPTY,
        }
    }

    /// Whether the page holding `lunit` is shared with another table.
    #[inline]
    pub fn page_shared(&self, lunit: u64) -> bool {
        let (p, _) = split(lunit);
        self.page(p).is_some_and(|page| page.is_shared())
    }

    /// The slot of page `p`, creating its leaf when `create`; `None` if the leaf is
    /// absent and not created.
    fn slot_mut(&mut self, p: usize, create: bool) -> Option<&mut Option<Arc<MapPage>>> {
        let l = p / LEAF_PAGES;
        if l >= self.leaves.len() {
            if !create {
                return None;
            }
            self.leaves.resize_with(l + 1, || None);
        }
        let leaf = &mut self.leaves[l];
        if leaf.is_none() {
            if !create {
                return None;
            }
            *leaf = Some(Box::new([const { None }; LEAF_PAGES]));
        }
        leaf.as_mut().map(|leaf| &mut leaf[p % LEAF_PAGES])
    }

    /// Drops page `p`'s slot content, and its leaf once empty, and trailing absent leaves.
    fn clear_slot(&mut self, p: usize) {
        let l = p / LEAF_PAGES;
        if let Some(Some(leaf)) = self.leaves.get_mut(l) {
            leaf[p % LEAF_PAGES] = None;
            if leaf.iter().all(|s| s.is_none()) {
                self.leaves[l] = None;
            }
        }
        while let Some(None) = self.leaves.last() {
            self.leaves.pop();
        }
    }

    /// Sets the entry of `lunit`, with the allocator locked (`a`). If other tables hold
    /// its page, this table first gets a copy of its own: every data unit the copy maps
    /// gains a reference, and only then does the original page lose this table as an
    /// owner (module docs). Returns the previous entry; the refcounts of the entry's own
    /// units (the new one, the one replaced) are the caller's to change.
    pub fn set(&mut self, lunit: u64, e: Entry, a: &mut Allocator) -> Entry {
        let (p, i) = split(lunit);
        let Some(slot) = self.slot_mut(p, e.is_mapped()) else {
            return Entry::EMPTY;
        };
        if slot.is_none() {
            if !e.is_mapped() {
                return Entry::EMPTY;
            }
            *slot = Some(Arc::new(MapPage::new()));
            a.counts.pages += 1;
            a.counts.page_refs += 1;
        }
        let held = slot.as_ref().expect("page present");
        // Under the allocator lock, no other table changes this page's owners meanwhile.
        if held.is_shared() {
            let copy = (**held).clone();
            copy.units().for_each(|u| a.incref(u));
            a.counts.pages += 1;
            a.counts.entries += u64::from(copy.mapped);
            held.owners.fetch_sub(1, Ordering::AcqRel);
            *slot = Some(Arc::new(copy));
        }
        // Unique logically; a checkpoint in progress may still hold the Arc, in which
        // case make_mut copies it in memory only.
        let page = Arc::make_mut(slot.as_mut().expect("page present"));
        let old = std::mem::replace(&mut page.entries[i], e);
        match (old.is_mapped(), e.is_mapped()) {
            (false, true) => {
                page.mapped += 1;
                a.counts.entries += 1;
            }
            (true, false) => {
                page.mapped -= 1;
                a.counts.entries -= 1;
            }
            _ => {}
        }
        if page.mapped == 0 {
            self.clear_slot(p);
            a.counts.pages -= 1;
            a.counts.page_refs -= 1;
        }
        old
    }

    /// The present pages with their indexes, in order: for checkpoints and walks.
    pub fn pages(&self) -> impl Iterator<Item = (usize, &Arc<MapPage>)> + '_ {
        self.leaves.iter().enumerate().filter_map(|(l, leaf)| leaf.as_ref().map(|leaf| (l, leaf))).flat_map(
            |(l, leaf)| {
                leaf.iter().enumerate().filter_map(move |(i, page)| page.as_ref().map(|pg| (l * LEAF_PAGES + i, pg)))
            },
        )
    }

    /// Installs a page read from a checkpoint.
    pub fn put_page(&mut self, index: usize, page: Arc<MapPage>) {
        if let Some(slot) = self.slot_mut(index, true) {
            *slot = Some(page);
        }
    }

    /// Every mapped entry with its logical unit, in order.
    pub fn mapped(&self) -> impl Iterator<Item = (u64, Entry)> + '_ {
        self.pages().flat_map(|(p, pg)| {
            pg.entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.is_mapped())
                .map(move |(i, e)| ((p * PAGE_ENTRIES + i) as u64, *e))
        })
    }

    /// Drops every page, with the allocator locked (`a`): a page this table held alone
    /// takes its units' references with it ([`Allocator::decref`]); a page left to a
    /// single other owner first marks its units settling (they may be exclusive to that
    /// owner now, but not before this change is durable), then loses this owner.
    pub fn release_all(&mut self, a: &mut Allocator) {
        for leaf in self.leaves.drain(..).flatten() {
            for page in leaf.into_iter().flatten() {
                a.counts.page_refs -= 1;
                match page.owners.load(Ordering::Acquire) {
                    1 => {
                        page.owners.store(0, Ordering::Release);
                        page.units().for_each(|u| a.decref(u));
                        a.counts.pages -= 1;
                        a.counts.entries -= u64::from(page.mapped);
                    }
                    n => {
                        if n == 2 {
                            page.units().for_each(|u| a.unsettle(u));
                        }
                        page.owners.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            }
        }
    }

    /// A new table sharing every page with this one (no data or entries copied), with
    /// the allocator locked (`a`, as for every change of owners): the basis of snapshots
    /// and clones. Costs the leaves (4 KiB per 512 pages). The caller holds back writes
    /// to this table meanwhile (the volume's gate): a page becomes shared only while no
    /// write may be going in place into it.
    pub fn share(&self, a: &mut Allocator) -> MapTable {
        let mut held = 0;
        let leaves = self
            .leaves
            .iter()
            .map(|leaf| {
                leaf.as_ref().map(|leaf| {
                    Box::new(std::array::from_fn(|i| {
                        leaf[i].as_ref().map(|page| {
                            page.owners.fetch_add(1, Ordering::AcqRel);
                            held += 1;
                            page.clone()
                        })
                    }))
                })
            })
            .collect();
        a.counts.page_refs += held;
        MapTable { leaves }
    }
}

/// Lengths of [`Allocator`]'s pending lists at the start of a commit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingMark {
    /// Entries of `pending_free` covered.
    pub free: usize,
    /// Entries of `pending_settle` covered.
    pub settle: usize,
}

#[inline]
fn split(lunit: u64) -> (usize, usize) {
    ((lunit / PAGE_ENTRIES as u64) as usize, (lunit % PAGE_ENTRIES as u64) as usize)
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
    big: HashMap<u32, u32>,
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
}

/// What a checkpoint of the metadata holds, counted: enough to bound its size in bytes
/// (`journal::checkpoint_bytes_bound`). Refcount entries are one per used unit
/// ([`Allocator::used`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaCounts {
    /// Volumes and snapshots.
    pub volumes: u64,
    /// Bytes of their names.
    pub name_bytes: u64,
    /// Distinct mapping pages (a page several tables hold counts once).
    pub pages: u64,
    /// Pages held, counted once per table holding each.
    pub page_refs: u64,
    /// Mapped entries of the distinct pages.
    pub entries: u64,
}

impl MetaCounts {
    /// The same counts with `volumes` volumes of `name_bytes` bytes of names.
    pub fn with_volumes(self, volumes: u64, name_bytes: u64) -> MetaCounts {
        MetaCounts { volumes, name_bytes, ..self }
    }

    /// The counts of `tables` (each a volume's or snapshot's table, with its name's
    /// length): walks every page once.
    pub fn of<'a>(tables: impl IntoIterator<Item = (&'a MapTable, usize)>) -> MetaCounts {
        let mut c = MetaCounts::default();
        let mut seen: std::collections::HashSet<*const MapPage> = Default::default();
        for (map, name_len) in tables {
            c.volumes += 1;
            c.name_bytes += name_len as u64;
            for (_, page) in map.pages() {
                c.page_refs += 1;
                if seen.insert(Arc::as_ptr(page)) {
                    c.pages += 1;
                    c.entries += u64::from(page.mapped);
                }
            }
        }
        c
    }
}

impl Allocator {
    /// An allocator over `units` data units, all free. Its per-unit tables are zeroed
    /// and untouched, so they cost resident memory only where units come into use.
    pub fn new(units: usize) -> Allocator {
        let mut free_bits = vec![u64::MAX; units.div_ceil(64)];
        if !units.is_multiple_of(64) {
            free_bits[units / 64] = (1 << (units % 64)) - 1;
        }
        Allocator {
            refcount: Arc::new(RefcountTable::new(units)),
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
        self.refcount.0[unit as usize].store(byte, Ordering::Release)
    }

    /// Refcount of `unit` ([`META`] for checkpoint units).
    pub fn refcount(&self, unit: u32) -> u32 {
        self.rc(unit)
    }

    /// The units with a non-zero refcount, in ascending order, with their refcounts
    /// ([`META`] for checkpoint units). Reads every counter; allocates nothing.
    pub fn nonzero_refcounts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.refcount.0.iter().enumerate().filter_map(|(u, r)| match r.load(Ordering::Relaxed) {
            0 => None,
            _ => Some((u as u32, self.rc(u as u32))),
        })
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
            } else {
                self.set_free(u);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_table_pages_appear_and_vanish() {
        let mut a = Allocator::new(16);
        let settling = a.settling_table();
        let (u7, u8) = (a.alloc().unwrap(), a.alloc().unwrap());
        let mut t = MapTable::new();
        assert_eq!(t.get(1500), Entry::EMPTY);
        t.set(1500, Entry { punit: u7, bitmap: 1 }, &mut a);
        t.set(1501, Entry { punit: u8, bitmap: 1 }, &mut a);
        assert_eq!(t.get(1500).punit, u7);
        assert!(t.page(2).is_some());
        let mut shared = t.share(&mut a);
        assert!(t.page_shared(1500) && shared.page_shared(1501));
        assert_eq!((a.refcount(u7), a.refcount(u8)), (1, 1), "one page maps both");
        let old = t.set(1500, Entry::EMPTY, &mut a);
        a.decref(old.punit);
        assert_eq!((a.refcount(u7), a.refcount(u8)), (1, 2), "the copy references the unit it keeps");
        assert!(!t.page_shared(1501) && !shared.page_shared(1500));
        assert_eq!(shared.get(1500).punit, u7, "the sharer keeps its page");
        assert_eq!(shared.mapped().count(), 2);
        assert!(settling.is_set(u7), "left to the sharer's page alone: settling");
        t.release_all(&mut a);
        assert_eq!(a.refcount(u8), 1);
        assert!(settling.is_set(u8));
        let mut third = shared.share(&mut a);
        a.release_pending(a.pending_mark(), &StripedCounts::new());
        shared.release_all(&mut a);
        assert_eq!((a.refcount(u7), a.refcount(u8)), (1, 1), "the page stays, with its one remaining owner");
        assert!(settling.is_set(u7) && settling.is_set(u8), "left to one owner: exclusive only once durable");
        third.release_all(&mut a);
        assert_eq!((a.refcount(u7), a.refcount(u8), a.used), (0, 0, 0));
        assert_eq!(a.pending_free, vec![u7, u8]);
    }

    #[test]
    fn a_far_mapping_costs_one_leaf_and_a_pointer_per_leaf_before_it() {
        // One entry 1000 TiB into a volume of 64 KiB units: page 32,000,000.
        let lunit = (1000u64 << 40) >> 16;
        let mut a = Allocator::new(16);
        let mut t = MapTable::new();
        t.set(lunit, Entry { punit: 3, bitmap: 1 }, &mut a);
        let (p, _) = split(lunit);
        assert_eq!(t.leaves.len(), p / LEAF_PAGES + 1, "leaf pointers reach the last leaf only");
        assert_eq!(t.leaves.iter().flatten().count(), 1, "one leaf present");
        assert_eq!(t.pages().map(|(i, _)| i).collect::<Vec<_>>(), vec![p]);
        assert_eq!(t.get(lunit).punit, 3);
        assert_eq!(t.get(lunit - 1), Entry::EMPTY);
        let shared = t.share(&mut a);
        assert!(t.page_shared(lunit) && shared.leaves.iter().flatten().count() == 1);
        t.set(lunit, Entry::EMPTY, &mut a);
        assert!(t.leaves.is_empty(), "the last page gone takes its leaf and the pointers");
        assert_eq!(shared.get(lunit).punit, 3, "the sharer keeps its page");
    }

    #[test]
    fn refcounts_past_a_byte_stay_exact() {
        let mut a = Allocator::from_refcounts(vec![0, 0, 300, META]);
        let table = a.refcount_table();
        assert_eq!((a.refcount(2), a.refcount(3)), (300, META));
        assert!(table.is_shared(2) && !table.is_shared(3) && !table.is_exclusive(3));
        let u = a.alloc().unwrap();
        for _ in 0..299 {
            a.incref(u);
        }
        assert_eq!(a.refcount(u), 300);
        assert!(table.is_shared(u));
        for _ in 0..299 {
            a.decref(u);
        }
        assert_eq!(a.refcount(u), 1);
        assert!(table.is_exclusive(u));
        assert_eq!(a.big.len(), 1, "only unit 2 keeps an exact count apart");
        assert_eq!(a.nonzero_refcounts().collect::<Vec<_>>(), vec![(0, 1), (2, 300), (3, META)]);
    }

    #[test]
    fn allocator_holds_frees_until_released() {
        let pins = StripedCounts::new();
        let mut a = Allocator::from_refcounts(vec![0; 4]);
        let u = a.alloc().unwrap();
        assert_eq!(a.free_count(), 3);
        a.decref(u);
        assert_eq!(a.free_count(), 3, "not free until durable");
        pins.add(u);
        let mark = a.pending_mark();
        a.release_pending(mark, &pins);
        assert_eq!(a.free_count(), 3, "pinned by in-flight I/O");
        assert!(pins.is_set(u + StripedCounts::STRIPES as u32), "a unit of the same stripe may be pinned");
        pins.sub(u);
        a.release_pending(PendingMark { free: 1, settle: 0 }, &pins);
        assert_eq!(a.free_count(), 4);
        let (spare, backed) = a.take_for_spare().unwrap();
        assert!(!backed, "nothing is known to be backed yet");
        a.spare.push_back(spare);
        assert!((0..3).all(|_| a.alloc().is_some()));
        assert_eq!(a.alloc(), None, "data never takes the spare");
        let m = a.alloc_meta().unwrap();
        assert_eq!((m, a.meta, a.spare.len()), (spare, 1, 0));
        a.retire_meta(m);
        a.shrink_spare(1);
        assert_eq!(a.take_for_spare(), Some((spare, true)), "given back by the spare: known to be backed");
    }

    #[test]
    fn counts_follow_pages_entries_and_shares() {
        let mut a = Allocator::new(64);
        let mut t = MapTable::new();
        for l in [0u64, 1, 600] {
            let p = a.alloc().unwrap();
            t.set(l, Entry { punit: p, bitmap: 1 }, &mut a);
        }
        let want = |pages, page_refs, entries| MetaCounts { volumes: 0, name_bytes: 0, pages, page_refs, entries };
        assert_eq!(a.counts, want(2, 2, 3));
        let mut s = t.share(&mut a);
        assert_eq!(a.counts, want(2, 4, 3), "a share adds references, not pages");
        let old = s.set(1, Entry::EMPTY, &mut a);
        a.decref(old.punit);
        assert_eq!(a.counts, want(3, 4, 4), "the copy is a page of its own, with one entry fewer than the original");
        assert_eq!(a.counts, MetaCounts::of([(&t, 0), (&s, 0)]).with_volumes(0, 0));
        s.release_all(&mut a);
        assert_eq!(a.counts, want(2, 2, 3));
        t.release_all(&mut a);
        assert_eq!(a.counts, want(0, 0, 0));
    }

    #[test]
    fn a_unit_left_to_one_owner_settles_only_when_durable() {
        let pins = StripedCounts::new();
        let mut a = Allocator::from_refcounts(vec![0; 4]);
        let u = a.alloc().unwrap();
        a.incref(u);
        let settling = a.settling_table();
        a.decref(u);
        assert_eq!((a.refcount(u), settling.is_set(u)), (1, true), "settling");
        let mark = a.pending_mark();
        a.unsettle(u); // a later change, not covered by the commit that started at `mark`
        a.release_pending(mark, &pins);
        assert!(settling.is_set(u), "still settling for the later change");
        a.release_pending(a.pending_mark(), &pins);
        assert!(!settling.is_set(u));
    }
}
