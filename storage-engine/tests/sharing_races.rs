//! The sharing races of on-disk-format.md 6.1 rule 12 on the engine itself: its own
//! delete, trim and copy on write, through `Pool` and `Volume`, from several threads
//! (`tests/sharing_model.rs` explores the same orders exhaustively, but on a model of
//! those paths, which passes whatever order the engine's code keeps). Each test races,
//! round after round, a change that lowers a page's sharing against writes to the
//! table that keeps the page, and checks what the other table must still read:
//! - a clone whose shared page is copied by a trim, beside writes to its origin: the
//!   copy's units must count the copy's reference before the original page loses the
//!   clone as an owner (both under the allocator lock), or a write to the origin goes
//!   in place into a unit the clone still maps;
//! - a snapshot deleted beside writes to its volume, with a crash while the delete's
//!   commit waits for its `fdatasync`: the units must be marked settling before the
//!   page loses the snapshot as an owner, or a write goes in place into a unit that the
//!   snapshot, back after the crash, still maps.
//!
//! Each failed within 2 s in 10 runs of 10 with its order undone (the code before the
//! signals were ordered: owners lowered outside the allocator lock, before the settling
//! marks, in delete; a shared page copied, and the original's owner lowered, before the
//! copy's references were taken, in trim), and runs `SHARING_RACES_SECS` (default 8)
//! when it holds. The threads race for real, so a failing round is not replayed
//! exactly; the seed of the pauses is printed.
#![cfg(not(feature = "shuttle"))]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use storage_engine::testing::{Faults, Rng};
use storage_engine::{IoOptions, Pool, PoolOptions};

const UNIT: u64 = 16 * 1024;
/// Bytes one mapping page covers.
const PAGE_BYTES: u64 = 512 * UNIT;
const BLOCK: u64 = 4096;

/// One racer's operation on page `p`, on its thread's runtime.
type PageOp = Box<dyn Fn(&tokio::runtime::Runtime, u64) + Send>;

fn budget() -> Duration {
    Duration::from_secs(std::env::var("SHARING_RACES_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(8))
}

fn seeded() -> Rng {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("sharing races: seed {seed:#x}");
    Rng::new(seed)
}

/// What round `round` writes to unit `w` of page `p`.
fn tag(round: u64, p: u64, w: u64) -> u64 {
    (round << 32) | (p << 8) | w
}

/// A 4 KiB block holding `tag` in each of its 8-byte words.
fn block(tag: u64) -> Vec<u8> {
    tag.to_le_bytes().repeat(BLOCK as usize / 8)
}

/// The tag a block holds, `None` for bytes no [`block`] made.
fn tag_of(b: &[u8]) -> Option<u64> {
    let t = u64::from_le_bytes(b[..8].try_into().unwrap());
    (b == block(t)).then_some(t)
}

/// Busy-waits `ns` nanoseconds (a sleep is far coarser than the races).
fn spin(ns: u64) {
    let t = Instant::now();
    while (t.elapsed().as_nanos() as u64) < ns {
        std::hint::spin_loop();
    }
}

/// A new 64 MiB pool of 16 KiB units, watched by `faults` if given.
fn pool(path: &std::path::Path, faults: Option<Arc<Faults>>) -> Pool {
    let opts = PoolOptions { size: 64 * MIB, unit_size: UNIT as u32, ..Default::default() };
    Pool::create(path, &opts).unwrap().close().unwrap();
    let observer = faults.map(|f| f as Arc<dyn storage_engine::io::IoObserver>);
    Pool::open_with(path, &IoOptions { observer, ..Default::default() }).unwrap()
}

/// Deletes everything and closes: no data unit may stay referenced (a reference leaked
/// by two owner changes that missed each other keeps its unit used for ever), and the
/// checker finds nothing wrong.
fn delete_all_and_close(pool: Pool, rt: &tokio::runtime::Runtime, dir: &std::path::Path) {
    let names = pool.names();
    for n in names.iter().filter(|n| n.contains('@')) {
        let (v, s) = n.split_once('@').unwrap();
        rt.block_on(pool.delete_snapshot(v, s)).unwrap();
    }
    for n in names.iter().filter(|n| !n.contains('@')) {
        rt.block_on(pool.delete_volume(n)).unwrap();
    }
    rt.block_on(pool.flush()).unwrap();
    assert_eq!(pool.status().used, 0, "data units stay referenced with every volume deleted: a leaked reference");
    pool.close().unwrap();
    assert_clean(dir);
}

/// Clone `c` of `v` shares each of 64 pages with it. In each page, one thread trims
/// unit 0 of `c` (the first change of a shared page: `c` gets a copy of its own) while
/// the other writes unit 1 of `v`, the two started together (a barrier per page) and
/// each after a random pause of up to 20 µs. Then `c` must read at unit 1 what `v`
/// held when `c` was made.
#[test]
fn a_clone_trimmed_beside_writes_to_its_origin_keeps_its_content() {
    const PAGES: u64 = 64;
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = pool(&pool_path(dir.path()), None);
    rt.block_on(pool.create_volume("v", PAGES * PAGE_BYTES)).unwrap();
    let v = pool.volume("v").unwrap();
    let mut rng = seeded();
    for p in 0..PAGES {
        rt.block_on(write(&v, p * PAGE_BYTES, &block(tag(0, p, 0)), false)).unwrap();
        rt.block_on(write(&v, p * PAGE_BYTES + UNIT, &block(tag(0, p, 1)), false)).unwrap();
    }
    let start = Instant::now();
    let mut round = 0;
    while start.elapsed() < budget() {
        round += 1;
        rt.block_on(pool.clone_volume("v", "c")).unwrap();
        let c = pool.volume("c").unwrap();
        let pauses: Arc<Vec<[u64; 2]>> = Arc::new((0..PAGES).map(|_| [rng.below(20_000), rng.below(20_000)]).collect());
        // Both start each page together (and each pauses its own random time).
        let barrier = Arc::new(Barrier::new(2));
        let racer = |me: usize, op: PageOp| {
            let (pauses, barrier) = (pauses.clone(), barrier.clone());
            std::thread::spawn(move || {
                let rt = common::rt();
                for p in 0..PAGES {
                    barrier.wait();
                    spin(pauses[p as usize][me]);
                    op(&rt, p);
                }
            })
        };
        let trimmer = {
            let c = c.clone();
            racer(0, Box::new(move |rt, p| rt.block_on(c.trim(p * PAGE_BYTES, BLOCK, false)).unwrap()))
        };
        let writer = {
            let v = v.clone();
            racer(
                1,
                Box::new(move |rt, p| {
                    rt.block_on(write(&v, p * PAGE_BYTES + UNIT, &block(tag(round, p, 1)), false)).unwrap()
                }),
            )
        };
        trimmer.join().unwrap();
        writer.join().unwrap();
        for p in 0..PAGES {
            let got = tag_of(&rt.block_on(read(&c, p * PAGE_BYTES + UNIT, BLOCK)));
            assert_eq!(
                got,
                Some(tag(round - 1, p, 1)),
                "round {round}: clone c reads {got:x?} at unit 1 of page {p}, not what it held when it was made: \
                 a write to its origin v went in place into a unit that c's copy of the page maps"
            );
        }
        drop(c);
        rt.block_on(pool.delete_volume("c")).unwrap();
    }
    eprintln!("{round} rounds");
    drop(v);
    delete_all_and_close(pool, &rt, dir.path());
}

/// Snapshot `v@s` shares each of 512 pages with `v`. One thread deletes `v@s` while the
/// other, from a random page on, writes unit 0 of page after page of `v`, until the
/// delete's commit is at its `fdatasync` (held back by `Faults`, so nothing of the
/// delete is durable yet). The pool file is copied then: a crash image in which every
/// completed write reached the disk and `v@s` still exists. Opened, `v@s` must read
/// what `v` held when it was taken.
#[test]
fn a_snapshot_deleted_beside_writes_to_its_volume_comes_back_unchanged_after_a_crash() {
    const PAGES: u64 = 512;
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let faults = Arc::new(Faults::new());
    let path = pool_path(dir.path());
    let pool = pool(&path, Some(faults.clone()));
    rt.block_on(pool.create_volume("v", PAGES * PAGE_BYTES)).unwrap();
    let v = pool.volume("v").unwrap();
    let mut rng = seeded();
    // What unit 0 of each page of v holds.
    let mut held: Vec<u64> = (0..PAGES).map(|p| tag(0, p, 0)).collect();
    for p in 0..PAGES {
        rt.block_on(write(&v, p * PAGE_BYTES, &block(held[p as usize]), false)).unwrap();
    }
    let image = dir.path().join("crash.img");
    let start = Instant::now();
    let (mut round, mut no_crash) = (0, 0);
    while start.elapsed() < budget() {
        round += 1;
        rt.block_on(pool.create_snapshot("v", "s")).unwrap();
        faults.hold_flushes();
        let barrier = Arc::new(Barrier::new(2));
        let deleted = Arc::new(AtomicBool::new(false));
        let deleter = {
            let (pool, barrier, deleted) = (pool.clone(), barrier.clone(), deleted.clone());
            std::thread::spawn(move || {
                let rt = common::rt();
                barrier.wait();
                rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
                deleted.store(true, Ordering::Release);
            })
        };
        let writer = {
            let (v, barrier, faults, deleted) = (v.clone(), barrier.clone(), faults.clone(), deleted.clone());
            let (pause, first) = (rng.below(50_000), rng.below(PAGES / 2));
            std::thread::spawn(move || {
                let rt = common::rt();
                barrier.wait();
                spin(pause);
                let mut p = first;
                while faults.held_flushes() == 0 && !deleted.load(Ordering::Acquire) && p < PAGES {
                    rt.block_on(write(&v, p * PAGE_BYTES, &block(tag(round, p, 0)), false)).unwrap();
                    p += 1;
                }
                first..p
            })
        };
        let written = writer.join().unwrap();
        while faults.held_flushes() == 0 && !deleted.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(100));
        }
        // No crash point when the delete's commit needed no fdatasync (it is durable).
        let crash = !deleted.load(Ordering::Acquire);
        if crash {
            std::fs::copy(&path, &image).unwrap();
        } else {
            no_crash += 1;
        }
        faults.release_flushes();
        deleter.join().unwrap();
        if crash {
            let crashed = Pool::open(&image).unwrap();
            let s = crashed.volume("v@s").expect("v@s is back after the crash: its delete was not durable");
            for p in written.clone() {
                let got = tag_of(&rt.block_on(read(&s, p * PAGE_BYTES, BLOCK)));
                assert_eq!(
                    got,
                    Some(held[p as usize]),
                    "round {round}: after the crash, snapshot v@s reads {got:x?} at page {p}, not what v held \
                     when it was taken: a write to v went in place into a unit v@s still maps"
                );
            }
        }
        for p in written {
            held[p as usize] = tag(round, p, 0);
            let got = tag_of(&rt.block_on(read(&v, p * PAGE_BYTES, BLOCK)));
            assert_eq!(got, Some(held[p as usize]), "round {round}: v reads {got:x?} at page {p}, not its last write");
        }
    }
    eprintln!("{round} rounds, {no_crash} with no crash point");
    assert!(round > no_crash, "no round had a crash point: the delete's commit never waited for an fdatasync");
    drop(v);
    delete_all_and_close(pool, &rt, dir.path());
}
