//! Deterministic concurrency checks of the copy-on-write sharing state machine
//! (`storage_engine::meta`), with shuttle's schedulers (PCT and random): the engine's
//! own `MapTable`, `Allocator` and `writable_in_place` run on shuttle's atomics, and each
//! step below takes the pool's locks as the engine does (a table's map lock, then the
//! allocator's; the journal under the allocator), so the schedulers interleave threads
//! at every lock and at every lock-free read of owners, refcounts and settling counts.
//!
//! The steps mirror the engine's `volume/` and `pool/`: `write` is the copy-on-write decision of
//! `write_blocks` and `write_private_once` with `finish_private`'s install; `trim` is
//! `Volume::set_entry` unmapping a unit; `delete` is `Pool::delete_any`; `commit` is a
//! commit cycle's C1 (`take_records`) and C4 (`finish_cycle`). Ghost state beside them
//! records what each data unit holds and what each table last wrote, and when a table
//! let go of a unit by a logged change. Checked:
//! - no write goes in place into a unit that another table let go of by a change that
//!   is not durable yet (a crash would give the unit back to that table);
//! - at the end, every live table reads its own last write at every mapped logical
//!   unit (no table sees another's write), refcounts equal the number of distinct
//!   pages mapping each unit, each page's owner count the leaves holding it, and each
//!   leaf's the tables holding it.
//!
//! The first five tests are the interleavings that lost data before the sharing
//! signals were ordered (on-disk-format.md 6.1 rule 12); each failed on that code.
//! This is a model: it passes whatever order the engine's own code keeps;
//! `tests/sharing_races.rs` races the engine's real delete, trim and copy on write.
//! Run with `cargo nextest run -p storage-engine --features shuttle --test sharing_model`.
#![cfg(feature = "shuttle")]

use std::collections::HashMap;

use shuttle::sync::{Arc, Mutex, RwLock};
use shuttle::thread;
use storage_engine::meta::{writable_in_place, Allocator, Entry, MapTable, RefcountTable, StripedCounts};

/// A record of the model's log: only its position matters.
#[derive(Debug, Clone, Copy)]
enum Rec {
    Map,
    Unmap,
    Delete,
}

struct Model {
    tables: Vec<RwLock<MapTable>>,
    deleted: Vec<std::sync::atomic::AtomicBool>,
    alloc: Mutex<Allocator>,
    refcounts: std::sync::Arc<RefcountTable>,
    settling: std::sync::Arc<StripedCounts>,
    pins: StripedCounts,
    journal: Mutex<Vec<Rec>>,
    durable: Mutex<usize>,
    ghost: Mutex<Ghost>,
}

#[derive(Default)]
struct Ghost {
    content: HashMap<u32, u64>,
    logical: HashMap<(usize, u64), u64>,
    releases: Vec<(u32, usize)>,
}

impl Model {
    fn exclusive(&self, map: &MapTable, lunit: u64, punit: u32) -> bool {
        writable_in_place(map, lunit, punit, &self.refcounts, &self.settling)
    }

    fn log(&self, r: Rec) -> usize {
        let mut j = self.journal.lock().unwrap();
        j.push(r);
        j.len() - 1
    }

    fn write(&self, t: usize, lunit: u64, v: u64) {
        loop {
            let (old, in_place) = {
                let map = self.tables[t].read().unwrap();
                let e = map.get(lunit);
                (e, e.is_mapped() && self.exclusive(&map, lunit, e.punit))
            };
            assert!(old.is_mapped());
            if in_place {
                let mut g = self.ghost.lock().unwrap();
                let durable = *self.durable.lock().unwrap();
                if let Some((_, at)) = g.releases.iter().find(|(u, at)| *u == old.punit && *at >= durable) {
                    panic!(
                        "table {t} wrote unit {} in place while the release logged at {at} was not durable ({durable})",
                        old.punit
                    );
                }
                g.content.insert(old.punit, v);
                g.logical.insert((t, lunit), v);
                return;
            }
            let target = {
                let mut a = self.alloc.lock().unwrap();
                let p = a.alloc().expect("a free unit");
                a.cow_inflight.insert(p);
                p
            };
            self.ghost.lock().unwrap().content.insert(target, v);
            let mut map = self.tables[t].write().unwrap();
            let cur = map.get(lunit);
            let mut a = self.alloc.lock().unwrap();
            a.cow_inflight.remove(&target);
            let still = cur.punit == old.punit;
            if !still || self.exclusive(&map, lunit, old.punit) {
                a.decref(target);
                continue;
            }
            map.set(lunit, Entry { punit: target, bitmap: cur.bitmap }, &mut a);
            let at = self.log(Rec::Map);
            a.decref(cur.punit);
            let mut g = self.ghost.lock().unwrap();
            g.releases.push((cur.punit, at));
            g.logical.insert((t, lunit), v);
            return;
        }
    }

    fn trim(&self, t: usize, lunit: u64) {
        let mut map = self.tables[t].write().unwrap();
        let e = map.get(lunit);
        if !e.is_mapped() {
            return;
        }
        let mut a = self.alloc.lock().unwrap();
        map.set(lunit, Entry::EMPTY, &mut a);
        let at = self.log(Rec::Unmap);
        a.decref(e.punit);
        let mut g = self.ghost.lock().unwrap();
        g.releases.push((e.punit, at));
        g.logical.remove(&(t, lunit));
    }

    fn delete(&self, t: usize) {
        let mut map = self.tables[t].write().unwrap();
        self.deleted[t].store(true, std::sync::atomic::Ordering::SeqCst);
        let at = self.log(Rec::Delete);
        let mapped: Vec<u32> = map.mapped().map(|(_, e)| e.punit).collect();
        map.release_all(&mut self.alloc.lock().unwrap());
        let mut g = self.ghost.lock().unwrap();
        g.releases.extend(mapped.into_iter().map(|u| (u, at)));
    }

    fn commit(&self) {
        let mark = self.alloc.lock().unwrap().pending_mark();
        let upto = self.journal.lock().unwrap().len();
        *self.durable.lock().unwrap() = upto;
        self.alloc.lock().unwrap().release_pending(mark, &self.pins);
    }

    /// At the end: every live table reads what it last wrote, refcounts count the
    /// distinct pages that map each unit, a page's owners the distinct leaves that hold
    /// it, and a leaf's owners the tables that hold it.
    fn check(&self) {
        let g = self.ghost.lock().unwrap();
        let a = self.alloc.lock().unwrap();
        let mut refs: HashMap<u32, u32> = HashMap::new();
        // Held by how many, and the owner count it says, by leaf and by page.
        let mut leaves: HashMap<*const storage_engine::meta::Leaf, (u32, u32)> = HashMap::new();
        let mut owners: HashMap<*const storage_engine::meta::MapPage, (u32, u32)> = HashMap::new();
        for (t, table) in self.tables.iter().enumerate() {
            if self.deleted[t].load(std::sync::atomic::Ordering::SeqCst) {
                continue;
            }
            let map = table.read().unwrap();
            for (lunit, e) in map.mapped() {
                assert_eq!(
                    g.content.get(&e.punit),
                    g.logical.get(&(t, lunit)),
                    "table {t} logical unit {lunit} reads another table's write (data unit {})",
                    e.punit
                );
            }
            for (_, leaf) in map.leaves() {
                let seen = leaves
                    .entry(std::sync::Arc::as_ptr(leaf))
                    .or_insert((0, leaf.owners.load(std::sync::atomic::Ordering::SeqCst)));
                seen.0 += 1;
                if seen.0 > 1 {
                    continue;
                }
                for (_, page) in leaf.pages() {
                    let seen = owners
                        .entry(std::sync::Arc::as_ptr(page))
                        .or_insert((0, page.owners.load(std::sync::atomic::Ordering::SeqCst)));
                    seen.0 += 1;
                    if seen.0 == 1 {
                        for u in page.units() {
                            *refs.entry(u).or_default() += 1;
                        }
                    }
                }
            }
        }
        for (l, (held, owners)) in leaves {
            assert_eq!(held, owners, "leaf {l:?} is held by {held} tables but counts {owners} owners");
        }
        for (p, (held, owners)) in owners {
            assert_eq!(held, owners, "page {p:?} is held by {held} leaves but counts {owners} owners");
        }
        for u in 0..a.unit_count() as u32 {
            let want = refs.get(&u).copied().unwrap_or(0);
            assert_eq!(a.refcount(u), want, "data unit {u}: refcount {} but {want} pages map it", a.refcount(u));
        }
    }
}

/// A pool of 64 units where table 0 maps logical units `0..mapped` (data units 0..,
/// holding 100 + lunit) and tables 1.. share its leaf: clones or snapshots of it.
fn model(tables: usize, mapped: u64) -> Arc<Model> {
    model_at(tables, &(0..mapped).collect::<Vec<_>>())
}

/// [`model`] with table 0 mapping the logical units `lunits`.
fn model_at(tables: usize, lunits: &[u64]) -> Arc<Model> {
    let mut a = Allocator::new(64);
    let mut t0 = MapTable::new();
    let mut ghost = Ghost::default();
    for &l in lunits {
        let p = a.alloc().unwrap();
        t0.set(l, Entry { punit: p, bitmap: 1 }, &mut a);
        ghost.content.insert(p, 100 + l);
    }
    let mut all = vec![];
    for t in 1..tables {
        all.push(t0.share(&mut a));
        for &l in lunits {
            ghost.logical.insert((t, l), 100 + l);
        }
    }
    for &l in lunits {
        ghost.logical.insert((0, l), 100 + l);
    }
    all.insert(0, t0);
    let pins = StripedCounts::new();
    let mark = a.pending_mark();
    a.release_pending(mark, &pins);
    Arc::new(Model {
        deleted: (0..tables).map(|_| false.into()).collect(),
        tables: all.into_iter().map(RwLock::new).collect(),
        refcounts: a.refcount_table(),
        settling: a.settling_table(),
        alloc: Mutex::new(a),
        pins,
        journal: Mutex::new(Vec::new()),
        durable: Mutex::new(0),
        ghost: Mutex::new(ghost),
    })
}

/// One thread's steps.
type Steps = Box<dyn Fn(&Model) + Send + Sync>;

fn run(ops: Vec<Steps>, m: Arc<Model>) {
    let handles: Vec<_> = ops
        .into_iter()
        .map(|op| {
            let m = m.clone();
            thread::spawn(move || op(&m))
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    m.check();
}

const ITERATIONS: usize = 10_000;

fn explore(f: impl Fn() + Send + Sync + 'static) {
    let f = std::sync::Arc::new(f);
    let g = f.clone();
    shuttle::check_pct(move || g(), ITERATIONS, 3);
    shuttle::check_random(move || f(), ITERATIONS);
}

#[test]
fn a_clone_never_reads_its_origins_later_write() {
    explore(|| {
        let m = model(2, 2);
        run(vec![Box::new(|m| m.write(0, 0, 1)), Box::new(|m| m.write(1, 1, 2))], m)
    });
}

#[test]
fn the_last_two_holders_copying_a_page_at_once_keep_refcounts() {
    explore(|| {
        let m = model(2, 2);
        run(vec![Box::new(|m| m.trim(0, 0)), Box::new(|m| m.write(1, 1, 2))], m)
    });
}

#[test]
fn copying_a_page_while_its_other_holder_is_deleted_keeps_refcounts() {
    explore(|| {
        let m = model(2, 2);
        run(vec![Box::new(|m| m.write(0, 0, 1)), Box::new(|m| m.delete(1))], m)
    });
}

#[test]
fn a_unit_left_by_a_delete_is_not_written_in_place_before_the_delete_is_durable() {
    explore(|| {
        let m = model(2, 1);
        run(vec![Box::new(|m| m.delete(1)), Box::new(|m| m.write(0, 0, 1)), Box::new(|m| m.commit())], m)
    });
}

#[test]
fn a_unit_left_by_a_copy_on_write_is_not_written_in_place_before_the_copy_is_durable() {
    explore(|| {
        let m = model(2, 1);
        run(vec![Box::new(|m| m.write(1, 0, 2)), Box::new(|m| m.write(0, 0, 1)), Box::new(|m| m.commit())], m)
    });
}

#[test]
fn a_page_left_to_one_leaf_by_a_delete_is_not_written_in_place_before_the_delete_is_durable() {
    // Two pages in one leaf, shared by tables 0 and 1. Table 0's first write copies the
    // leaf (both pages then held by two leaves) and page 0; its second writes page 1,
    // which table 1's delete may meanwhile leave to table 0's leaf alone.
    explore(|| {
        let m = model_at(2, &[0, 512]);
        run(
            vec![
                Box::new(|m| {
                    m.write(0, 0, 1);
                    m.write(0, 512, 2);
                }),
                Box::new(|m| m.delete(1)),
                Box::new(|m| m.commit()),
            ],
            m,
        )
    });
}

#[test]
fn writes_trims_a_delete_and_commits_on_three_threads_keep_every_invariant() {
    // Table 0 a volume, 1 its snapshot, 2 a clone of it: all three share one page.
    explore(|| {
        let m = model(3, 3);
        run(
            vec![
                Box::new(|m| {
                    m.write(0, 0, 1);
                    m.trim(0, 1);
                    m.write(0, 2, 3);
                }),
                Box::new(|m| {
                    m.write(2, 1, 4);
                    m.write(2, 0, 5);
                    m.trim(2, 2);
                }),
                Box::new(|m| {
                    m.delete(1);
                    m.commit();
                    m.commit();
                }),
            ],
            m,
        )
    });
}
