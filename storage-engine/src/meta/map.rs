//! Mapping tables: [`MapTable`] of [`Leaf`]s of 512-entry [`MapPage`]s, both shared
//! copy-on-write between a volume and its snapshots and clones, and [`writable_in_place`], the decision the
//! data path makes from them (the module docs of `meta` give the order of the signals).
//! Not here: refcounts and free space (alloc.rs).

use std::sync::Arc;

use super::sync::{AtomicU32, AtomicU64, Ordering};
use super::{Allocator, RefcountTable, StripedCounts};
use crate::format::PAGE_ENTRIES;

/// Whether a write may go in place into data unit `punit`, mapped at `lunit` of `map`:
/// no other table holds its page, no other page maps it, and it is not settling (it did
/// not become exclusive by a change that is not durable yet). Otherwise the write must
/// copy the unit first. Call with `map` locked (shared is enough); needs no other lock.
///
/// Reads the leaf's owners, the page's owners, then the refcount, then the settling
/// count: the order that
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

/// 512 consecutive mapping entries (4 KiB), shared by `owners` leaves.
pub struct MapPage {
    /// The entries, by index in the page.
    pub entries: [Entry; PAGE_ENTRIES],
    /// Number of mapped entries.
    pub mapped: u32,
    /// Leaves holding this page; more than one means shared.
    pub owners: AtomicU32,
    /// Where the current checkpoint holds these entries ([`PageStored`]), or
    /// [`NOT_STORED`]: set by the checkpoint that writes or loads the page, cleared by
    /// any change ([`MapTable::set`]), so a later checkpoint keeps it where it is.
    stored: AtomicU64,
}

/// "Not in any checkpoint" in [`MapPage`]'s stored place.
const NOT_STORED: u64 = u64::MAX;

/// Where a checkpoint holds a page's entries: a page chunk's data unit and the byte
/// offset of the page's record in that chunk's payload (docs/on-disk-format.md 5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageStored {
    /// Data unit of the page chunk.
    pub unit: u32,
    /// Byte offset of the page's record in the chunk's payload.
    pub offset: u32,
}

impl Clone for MapPage {
    /// A private copy (one owner) with the same entries, stored nowhere yet.
    fn clone(&self) -> MapPage {
        MapPage {
            entries: self.entries,
            mapped: self.mapped,
            owners: AtomicU32::new(1),
            stored: AtomicU64::new(NOT_STORED),
        }
    }
}

impl MapPage {
    /// An empty page with one owner, stored nowhere.
    pub fn new() -> MapPage {
        MapPage {
            entries: [Entry::EMPTY; PAGE_ENTRIES],
            mapped: 0,
            owners: AtomicU32::new(1),
            stored: AtomicU64::new(NOT_STORED),
        }
    }

    /// Where the current checkpoint holds these entries, if it holds them as they are.
    pub fn stored(&self) -> Option<PageStored> {
        load_stored(&self.stored)
    }

    /// Forgets where a checkpoint that failed wrote these entries.
    pub fn clear_stored(&self) {
        self.stored.store(NOT_STORED, Ordering::Release);
    }

    /// Notes where a checkpoint wrote (or an open read) these entries. Only the
    /// checkpoint's writer and the loader call it, on pages no table changes meanwhile
    /// (a change copies a page a checkpoint still holds, [`MapTable::set`]).
    pub fn set_stored(&self, at: PageStored) {
        store_stored(&self.stored, at);
    }

    /// Whether more than one leaf holds the page.
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
pub const LEAF_PAGES: usize = 512;

/// One leaf of a [`MapTable`]: 512 page pointers, by `page index % LEAF_PAGES`, shared
/// by `owners` tables as pages are shared by leaves (module docs of `meta`): a snapshot
/// or clone shares a volume's leaves, and a table copies a leaf others hold before it
/// changes one of its pointers.
pub struct Leaf {
    pages: [Option<Arc<MapPage>>; LEAF_PAGES],
    /// Present pages.
    present: u32,
    /// Tables (volumes, snapshots) holding this leaf; more than one means shared.
    pub owners: AtomicU32,
    /// Where the current checkpoint holds this leaf's page locations ([`PageStored`]),
    /// or [`NOT_STORED`]: cleared by any change of the leaf or of one of its pages.
    stored: AtomicU64,
}

impl Clone for Leaf {
    /// A private copy (one owner) holding the same pages, stored nowhere yet. The
    /// pages' owners are the caller's to count.
    fn clone(&self) -> Leaf {
        Leaf {
            pages: self.pages.clone(),
            present: self.present,
            owners: AtomicU32::new(1),
            stored: AtomicU64::new(NOT_STORED),
        }
    }
}

impl Default for Leaf {
    fn default() -> Self {
        Leaf::new()
    }
}

impl Leaf {
    /// An empty leaf with one owner, stored nowhere.
    pub fn new() -> Leaf {
        Leaf {
            pages: [const { None }; LEAF_PAGES],
            present: 0,
            owners: AtomicU32::new(1),
            stored: AtomicU64::new(NOT_STORED),
        }
    }

    /// The present pages with their index in the leaf (0 … 511), in order.
    pub fn pages(&self) -> impl Iterator<Item = (usize, &Arc<MapPage>)> + '_ {
        self.pages.iter().enumerate().filter_map(|(i, p)| p.as_ref().map(|p| (i, p)))
    }

    /// The page at index `i` of the leaf (`i < LEAF_PAGES`), if present.
    pub fn page(&self, i: usize) -> Option<&Arc<MapPage>> {
        self.pages[i].as_ref()
    }

    /// Number of present pages.
    pub fn present(&self) -> u32 {
        self.present
    }

    /// Installs `page` at index `i` (`i < LEAF_PAGES`) of a leaf being loaded; returns
    /// `false`, changing nothing, if a page is there already.
    pub fn put(&mut self, i: usize, page: Arc<MapPage>) -> bool {
        if self.pages[i].is_some() {
            return false;
        }
        self.pages[i] = Some(page);
        self.present += 1;
        true
    }

    /// Where the current checkpoint holds this leaf as it is, if it does.
    pub fn stored(&self) -> Option<PageStored> {
        load_stored(&self.stored)
    }

    /// Forgets where a checkpoint that failed wrote this leaf.
    pub fn clear_stored(&self) {
        self.stored.store(NOT_STORED, Ordering::Release);
    }

    /// Notes where a checkpoint wrote (or an open read) this leaf; as
    /// [`MapPage::set_stored`].
    pub fn set_stored(&self, at: PageStored) {
        store_stored(&self.stored, at);
    }

    /// Whether more than one table holds the leaf.
    pub fn is_shared(&self) -> bool {
        self.owners.load(Ordering::Acquire) > 1
    }
}

fn load_stored(a: &AtomicU64) -> Option<PageStored> {
    let v = a.load(Ordering::Acquire);
    (v != NOT_STORED).then_some(PageStored { unit: (v >> 32) as u32, offset: v as u32 })
}

fn store_stored(a: &AtomicU64, at: PageStored) {
    a.store((u64::from(at.unit) << 32) | u64::from(at.offset), Ordering::Release);
}

/// A volume's mapping: pages indexed by `lunit / 512`; an absent page is all unmapped.
///
/// The pages sit in a two-level table: leaves of 512 page pointers, present only where
/// a page is, under a vector of leaf pointers that reaches only as far as the last
/// present leaf. A 1 TiB volume written in its first GiB holds one 4 KiB leaf; one
/// written only at its last byte holds one leaf and 8 bytes per 16 GiB before it
/// (with 64 KiB units), not 8 bytes per 32 MiB. Leaves are shared between tables like
/// pages, so sharing a table costs a pointer per leaf, not per page. The volume checks
/// ranges against its size; the table takes any logical unit.
#[derive(Clone, Default)]
pub struct MapTable {
    pub(super) leaves: Vec<Option<Arc<Leaf>>>,
}

impl MapTable {
    /// An empty table.
    pub fn new() -> MapTable {
        MapTable::default()
    }

    /// The page of index `p` (logical units `p * 512 ..`), if present.
    #[inline]
    pub fn page(&self, p: usize) -> Option<&Arc<MapPage>> {
        self.leaves.get(p / LEAF_PAGES)?.as_ref()?.pages[p % LEAF_PAGES].as_ref()
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

    /// Whether the page holding `lunit` is shared with another table: its leaf is, or
    /// the page is (read in that order, module docs of `meta`).
    #[inline]
    pub fn page_shared(&self, lunit: u64) -> bool {
        let (p, _) = split(lunit);
        let Some(Some(leaf)) = self.leaves.get(p / LEAF_PAGES) else {
            return false;
        };
        let shared_leaf = leaf.is_shared();
        leaf.pages[p % LEAF_PAGES].as_ref().is_some_and(|page| shared_leaf || page.is_shared())
    }

    /// Sets the entry of `lunit`, with the allocator locked (`a`). If other tables hold
    /// its leaf, this table first gets a copy of the leaf: every page of the copy gains
    /// an owner, and only then does the original leaf lose this table as an owner. If
    /// other leaves hold its page, the leaf then gets a copy of the page: every data
    /// unit the copy maps gains a reference, and only then does the original page lose
    /// an owner (module docs). Returns the previous entry; the refcounts of the entry's
    /// own units (the new one, the one replaced) are the caller's to change.
    pub fn set(&mut self, lunit: u64, e: Entry, a: &mut Allocator) -> Entry {
        let (p, i) = split(lunit);
        let (l, pi) = (p / LEAF_PAGES, p % LEAF_PAGES);
        if !e.is_mapped() && self.page(p).is_none() {
            return Entry::EMPTY;
        }
        if l >= self.leaves.len() {
            self.leaves.resize_with(l + 1, || None);
        }
        let lslot = &mut self.leaves[l];
        if lslot.is_none() {
            *lslot = Some(Arc::new(Leaf::new()));
            a.counts.leaves += 1;
            a.counts.leaf_refs += 1;
        }
        let held = lslot.as_ref().expect("leaf present");
        // Under the allocator lock, no other table changes this leaf's owners meanwhile.
        if held.is_shared() {
            let copy = (**held).clone();
            copy.pages().for_each(|(_, page)| {
                page.owners.fetch_add(1, Ordering::AcqRel);
            });
            a.counts.leaves += 1;
            a.counts.page_refs += u64::from(copy.present);
            held.owners.fetch_sub(1, Ordering::AcqRel);
            *lslot = Some(Arc::new(copy));
        }
        // Unique logically; a checkpoint in progress may still hold the Arc, in which
        // case make_mut copies it in memory only.
        let leaf = Arc::make_mut(lslot.as_mut().expect("leaf present"));
        // A page pointer or a page's entries change: the checkpoint's copy of this
        // leaf's page locations no longer stands for it.
        *leaf.stored.get_mut() = NOT_STORED;
        let slot = &mut leaf.pages[pi];
        if slot.is_none() {
            *slot = Some(Arc::new(MapPage::new()));
            leaf.present += 1;
            a.counts.pages += 1;
            a.counts.page_refs += 1;
        }
        let held = slot.as_ref().expect("page present");
        if held.is_shared() {
            let copy = (**held).clone();
            copy.units().for_each(|u| a.incref(u));
            a.counts.pages += 1;
            a.counts.entries += u64::from(copy.mapped);
            held.owners.fetch_sub(1, Ordering::AcqRel);
            *slot = Some(Arc::new(copy));
        }
        let page = Arc::make_mut(slot.as_mut().expect("page present"));
        // Its entries change: the checkpoint's copy of them no longer stands for it.
        *page.stored.get_mut() = NOT_STORED;
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
            *slot = None;
            leaf.present -= 1;
            a.counts.pages -= 1;
            a.counts.page_refs -= 1;
            if leaf.present == 0 {
                self.leaves[l] = None;
                a.counts.leaves -= 1;
                a.counts.leaf_refs -= 1;
                while let Some(None) = self.leaves.last() {
                    self.leaves.pop();
                }
            }
        }
        old
    }

    /// The leaf of index `l` (pages `l * 512 ..`), if present.
    #[inline]
    pub fn leaf(&self, l: usize) -> Option<&Arc<Leaf>> {
        self.leaves.get(l)?.as_ref()
    }

    /// The present leaves with their indexes (first page / 512), in order.
    pub fn leaves(&self) -> impl Iterator<Item = (usize, &Arc<Leaf>)> + '_ {
        self.leaves.iter().enumerate().filter_map(|(l, leaf)| leaf.as_ref().map(|leaf| (l, leaf)))
    }

    /// The present pages with their indexes, in order: for checkpoints and walks.
    pub fn pages(&self) -> impl Iterator<Item = (usize, &Arc<MapPage>)> + '_ {
        self.leaves().flat_map(|(l, leaf)| leaf.pages().map(move |(i, page)| (l * LEAF_PAGES + i, page)))
    }

    /// Installs a page read from a checkpoint that names pages, not leaves, into a
    /// leaf of this table's own.
    pub fn put_page(&mut self, index: usize, page: Arc<MapPage>) {
        let l = index / LEAF_PAGES;
        if l >= self.leaves.len() {
            self.leaves.resize_with(l + 1, || None);
        }
        let leaf = self.leaves[l].get_or_insert_with(|| Arc::new(Leaf::new()));
        Arc::make_mut(leaf).put(index % LEAF_PAGES, page);
    }

    /// Installs a leaf read from a checkpoint at leaf index `l`; returns `false`,
    /// changing nothing, if one is there already.
    pub fn put_leaf(&mut self, l: usize, leaf: Arc<Leaf>) -> bool {
        if l >= self.leaves.len() {
            self.leaves.resize_with(l + 1, || None);
        }
        if self.leaves[l].is_some() {
            return false;
        }
        self.leaves[l] = Some(leaf);
        true
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

    /// Drops every leaf, with the allocator locked (`a`). A leaf this table held alone
    /// drops its pages: a page no other leaf holds takes its units' references with it
    /// ([`Allocator::decref`]); a page left to a single other leaf first marks its units
    /// settling (they may be exclusive to that leaf's table now, but not before this
    /// change is durable), then loses this owner. A leaf left to a single other table
    /// first marks settling the units of the pages only it holds, for the same reason,
    /// then loses this owner.
    pub fn release_all(&mut self, a: &mut Allocator) {
        for leaf in self.leaves.drain(..).flatten() {
            a.counts.leaf_refs -= 1;
            match leaf.owners.load(Ordering::Acquire) {
                1 => {
                    leaf.owners.store(0, Ordering::Release);
                    a.counts.leaves -= 1;
                    for (_, page) in leaf.pages() {
                        a.counts.page_refs -= 1;
                        release_page(page, a);
                    }
                }
                n => {
                    if n == 2 {
                        for (_, page) in leaf.pages() {
                            if !page.is_shared() {
                                page.units().for_each(|u| a.unsettle(u));
                            }
                        }
                    }
                    leaf.owners.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }

    /// A new table sharing every leaf with this one (no pages, data or entries
    /// copied), with the allocator locked (`a`, as for every change of owners): the
    /// basis of snapshots and clones. Costs a pointer per leaf (8 bytes per 512 pages)
    /// whatever is mapped. The caller holds back writes to this table meanwhile (the
    /// volume's gate): a leaf becomes shared only while no write may be going in place
    /// into one of its pages.
    pub fn share(&self, a: &mut Allocator) -> MapTable {
        let leaves = self
            .leaves
            .iter()
            .map(|leaf| {
                leaf.as_ref().map(|leaf| {
                    leaf.owners.fetch_add(1, Ordering::AcqRel);
                    a.counts.leaf_refs += 1;
                    leaf.clone()
                })
            })
            .collect();
        MapTable { leaves }
    }
}

/// One leaf's hold on `page` dropped, with the allocator locked (`a`), by a leaf that
/// goes ([`MapTable::release_all`]).
fn release_page(page: &MapPage, a: &mut Allocator) {
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

#[inline]
pub(super) fn split(lunit: u64) -> (usize, usize) {
    ((lunit / PAGE_ENTRIES as u64) as usize, (lunit % PAGE_ENTRIES as u64) as usize)
}
