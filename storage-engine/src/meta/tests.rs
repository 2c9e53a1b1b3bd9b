//! Unit tests of the mapping tables and the allocator.

use std::sync::Arc;

use super::map::split;
use super::sync::Ordering;
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
fn sharing_a_table_shares_its_leaves_and_touches_no_page() {
    let mut a = Allocator::new(64);
    let mut t = MapTable::new();
    // Pages 0 and 3 of leaf 0, page 0 of leaf 2.
    for l in [0u64, 3 * 512, 2 * 512 * 512] {
        let p = a.alloc().unwrap();
        t.set(l, Entry { punit: p, bitmap: 1 }, &mut a);
    }
    let owners = |t: &MapTable, p: usize| t.page(p).unwrap().owners.load(Ordering::SeqCst);
    let mut s = t.share(&mut a);
    for (l, leaf) in t.leaves() {
        assert!(Arc::ptr_eq(leaf, s.leaf(l).unwrap()), "leaf {l} is the same leaf in both tables");
        assert_eq!(leaf.owners.load(Ordering::SeqCst), 2);
    }
    assert_eq!((owners(&t, 0), owners(&t, 3), owners(&t, 1024)), (1, 1, 1), "no page gained an owner");
    assert!(t.page_shared(0) && s.page_shared(2 * 512 * 512), "a page of a shared leaf is shared");
    // A change in leaf 0 copies that leaf alone: its two pages gain an owner, and the
    // changed page is copied.
    let old = s.set(3 * 512, Entry::EMPTY, &mut a);
    a.decref(old.punit);
    assert!(
        !Arc::ptr_eq(t.leaf(0).unwrap(), s.leaf(0).unwrap()) && Arc::ptr_eq(t.leaf(2).unwrap(), s.leaf(2).unwrap())
    );
    assert_eq!((owners(&t, 0), owners(&t, 3)), (2, 1), "page 0 is held by both leaves now, page 3 by t's alone");
    assert!(s.page(3).is_none() && t.get(3 * 512).is_mapped());
    assert!(t.page_shared(0) && !t.page_shared(3 * 512) && t.page_shared(2 * 512 * 512));
    assert_eq!(a.counts, MetaCounts::of([(&t, 0), (&s, 0)]).with_volumes(0, 0));
    s.release_all(&mut a);
    assert!(!t.page_shared(0) && !t.page_shared(2 * 512 * 512), "t holds everything alone again");
    assert_eq!(a.counts, MetaCounts::of([(&t, 0)]).with_volumes(0, 0));
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
    let want = |pages, page_refs, entries, leaves, leaf_refs| MetaCounts {
        volumes: 0,
        volume_bytes: 0,
        pages,
        page_refs,
        entries,
        leaves,
        leaf_refs,
    };
    assert_eq!(a.counts, want(2, 2, 3, 1, 1));
    let mut s = t.share(&mut a);
    assert_eq!(a.counts, want(2, 2, 3, 1, 2), "a share adds a reference to the leaf, nothing else");
    let old = s.set(1, Entry::EMPTY, &mut a);
    a.decref(old.punit);
    assert_eq!(
        a.counts,
        want(3, 4, 4, 2, 2),
        "the leaf copy holds both pages, and the page copy is a page of its own, with one entry fewer"
    );
    assert_eq!(a.counts, MetaCounts::of([(&t, 0), (&s, 0)]).with_volumes(0, 0));
    s.release_all(&mut a);
    assert_eq!(a.counts, want(2, 2, 3, 1, 1));
    t.release_all(&mut a);
    assert_eq!(a.counts, want(0, 0, 0, 0, 0));
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

#[test]
fn released_units_wait_for_their_punch_before_they_are_free() {
    let mut a = Allocator::new(64);
    let units: Vec<u32> = (0..8).map(|_| a.alloc().unwrap()).collect();
    for u in &units[..6] {
        a.decref(*u);
    }
    let free = a.free_count();
    a.release_pending_punching(a.pending_mark(), &StripedCounts::new(), true);
    assert!(a.pending_free.is_empty());
    assert_eq!(a.punch_queue.len(), 6);
    assert_eq!(a.free_count(), free, "queued units are not allocatable");
    let batch = a.take_punch_batch(4);
    assert_eq!((batch.len(), a.punching, a.punch_queue.len()), (4, 4, 2));
    a.finish_punch(&batch);
    assert_eq!((a.free_count(), a.punching), (free + 4, 0));
    assert_eq!(a.free_punch_queue(), 2, "room needed now: the rest are freed unpunched");
    assert_eq!(a.free_count(), free + 6);
}

/// A grown allocator frees exactly the new units, whatever the word boundaries, and
/// keeps the refcounts and free bits of the old ones.
#[test]
fn growing_frees_exactly_the_new_units() {
    let mut a = Allocator::from_refcounts(vec![0, 3, 0, 1, 0, 0, 0]);
    let mut taken = vec![1, 3];
    for units in [70usize, 128, 129, 300] {
        let before = a.unit_count() as usize;
        a.grow(units);
        assert_eq!(a.unit_count() as usize, units);
        assert_eq!(a.free_count() as usize, units - taken.len(), "free after growing to {units}");
        for past in units..units.next_multiple_of(64) {
            assert!(!a.take_unit(past as u32), "unit {past} is free in a pool of {units}");
        }
        // Every free unit comes out once, and only those.
        let mut got = Vec::new();
        while let Some((u, _)) = a.take_for_spare() {
            got.push(u as usize);
        }
        got.sort_unstable();
        let want: Vec<usize> = (0..units).filter(|u| !taken.contains(u)).collect();
        assert_eq!(got, want, "grown from {before} to {units}");
        taken = (0..units).collect();
    }
    assert_eq!(a.refcount(1), 3);
    assert_eq!(a.refcount(3), 1);
}
