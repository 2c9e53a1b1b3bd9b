//! Mapping tables: [`MapTable`] of 512-entry [`MapPage`]s shared copy-on-write between
//! a volume and its snapshots and clones, and [`writable_in_place`], the decision the
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
        let v = self.stored.load(Ordering::Acquire);
        (v != NOT_STORED).then_some(PageStored { unit: (v >> 32) as u32, offset: v as u32 })
    }

    /// Forgets where a checkpoint that failed wrote these entries.
    pub fn clear_stored(&self) {
        self.stored.store(NOT_STORED, Ordering::Release);
    }

    /// Notes where a checkpoint wrote (or an open read) these entries. Only the
    /// checkpoint's writer and the loader call it, on pages no table changes meanwhile
    /// (a change copies a page a checkpoint still holds, [`MapTable::set`]).
    pub fn set_stored(&self, at: PageStored) {
        self.stored.store((u64::from(at.unit) << 32) | u64::from(at.offset), Ordering::Release);
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
pub(super) const LEAF_PAGES: usize = 512;

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
    pub(super) leaves: Vec<Option<Box<Leaf>>>,
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

#[inline]
pub(super) fn split(lunit: u64) -> (usize, usize) {
    ((lunit / PAGE_ENTRIES as u64) as usize, (lunit % PAGE_ENTRIES as u64) as usize)
}
