//! Checkpoints write what changed (docs/on-disk-format.md 5.4): pages stored by an
//! earlier checkpoint stay in their page chunks, a checkpoint writes the pages changed
//! since and a directory, chunks left less than half live are cleaned, and the pool
//! opens from such a checkpoint with every byte.

mod common;

use common::*;
use storage_engine::Pool;

const UNIT: u64 = 64 * 1024;
/// Mapping pages the volume fills: 512 units each.
const PAGES: u64 = 32;
/// Copies of every checkpoint chunk written (ditto copies, docs/on-disk-format.md 5.5):
/// the bytes below are those of one copy times this.
const COPIES: u64 = 2;

fn checkpoint_bytes(pool: &Pool) -> u64 {
    pool.commit_stats().checkpoint_bytes
}

/// The byte written into unit `u` at round `r`.
fn tag(u: u64, r: u64) -> u8 {
    (u * 7 + r * 13 + 1) as u8
}

/// A pool in `dir` with volume `v` of [`PAGES`] full mapping pages: block 0 of every
/// unit `u` written with `tag(u, 0)`, and flushed.
fn full_pages(dir: &std::path::Path, rt: &tokio::runtime::Runtime) -> (Pool, storage_engine::Volume) {
    let pool = create_with_unit(dir, 2 << 30, UNIT as u32);
    let units = PAGES * 512;
    rt.block_on(pool.create_volume("v", units * UNIT)).unwrap();
    let v = pool.volume("v").unwrap();
    for u in 0..units {
        rt.block_on(write(&v, u * UNIT, &[tag(u, 0); 4096], false)).unwrap();
    }
    rt.block_on(v.flush()).unwrap();
    (pool, v)
}

#[test]
fn a_checkpoint_writes_the_pages_that_changed_and_cleans_what_they_left() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = full_pages(dir.path(), &rt);
    let units = PAGES * 512;
    let want: Vec<u8> = (0..units).map(|u| tag(u, 0)).collect();
    let before = checkpoint_bytes(&pool);
    rt.block_on(pool.checkpoint()).unwrap();
    let whole = checkpoint_bytes(&pool) - before;
    let meta_units = pool.status().metadata / UNIT;
    // Every page: 512 entries of 16 bytes.
    assert!(whole >= PAGES * 512 * 16, "the first checkpoint wrote {whole} bytes for {PAGES} full pages");

    // Nothing changed: the directory alone, one block.
    let before = checkpoint_bytes(&pool);
    rt.block_on(pool.checkpoint()).unwrap();
    let idle = checkpoint_bytes(&pool) - before;
    assert!(idle <= COPIES * 4096, "a checkpoint with nothing changed wrote {idle} bytes");

    // One unit of one page changed (a block written for the first time: its mapping
    // changes): that page (8 KiB and its headers), the leaf that says where the page
    // now is (a block) and the directory.
    let before = checkpoint_bytes(&pool);
    let mut more = std::collections::BTreeMap::new();
    more.insert((5 * 512 + 3, 1), 0xfe);
    rt.block_on(write(&v, (5 * 512 + 3) * UNIT + 4096, &[0xfe; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    let one = checkpoint_bytes(&pool) - before;
    assert!(one > 8 * 1024, "a checkpoint after one page changed wrote {one} bytes: not the page");
    assert!(one <= COPIES * 20 * 1024, "a checkpoint after one page changed wrote {one} bytes (a whole one {whole})");

    // Rounds of a few pages changed each: what the checkpoints write stays within
    // twice the changed pages plus, per checkpoint, a directory, the leaf and half a
    // chunk of pages moved out of a cleaned one; what the checkpoint holds stays within twice
    // its compact size (plus the chunk of each kind that may be part full).
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (rounds, per_round) = (30u64, 3u64);
    let before = checkpoint_bytes(&pool);
    for r in 1..=rounds {
        for _ in 0..per_round {
            // A block of the unit not written before, so that its mapping changes.
            let u = (next() % PAGES) * 512 + next() % 512;
            let b = 1 + next() % 15;
            more.insert((u, b), tag(u, r));
            rt.block_on(write(&v, u * UNIT + b * 4096, &[tag(u, r); 4096], false)).unwrap();
        }
        rt.block_on(v.flush()).unwrap();
        rt.block_on(pool.checkpoint()).unwrap();
        let held = pool.status().metadata / UNIT;
        assert!(held <= 2 * meta_units + 2, "round {r}: the checkpoint holds {held} units, compact {meta_units}");
    }
    let churn = checkpoint_bytes(&pool) - before;
    let page = 8 * 1024 + 4096;
    let allowed = COPIES * (2 * rounds * per_round * page + rounds * (28 * 1024 + 2 * 4096));
    assert!(
        churn <= allowed,
        "{rounds} checkpoints of {per_round} changed pages wrote {churn} bytes (at most {allowed})"
    );
    assert!(churn < rounds * whole / 4, "{churn} bytes, against {whole} per whole checkpoint");

    // The pool opens from it (nothing in the log) with every unit as written.
    drop(v);
    pool.close().unwrap();
    let r = storage_engine::check(&pool_path(dir.path())).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    let v = pool.volume("v").unwrap();
    for u in 0..units {
        let got = rt.block_on(read(&v, u * UNIT, 4096));
        assert!(
            got.iter().all(|&b| b == want[u as usize]),
            "unit {u} reads {:#x}, wrote {:#x}",
            got[0],
            want[u as usize]
        );
    }
    for (&(u, b), &byte) in &more {
        let got = rt.block_on(read(&v, u * UNIT + b * 4096, 4096));
        assert!(got.iter().all(|&x| x == byte), "unit {u} block {b} reads {:#x}, wrote {byte:#x}", got[0]);
    }
    // And its pages stay where they are: a checkpoint right after the open writes only
    // the directory.
    let before = checkpoint_bytes(&pool);
    rt.block_on(pool.checkpoint()).unwrap();
    let reopened = checkpoint_bytes(&pool) - before;
    assert!(reopened <= COPIES * 4096, "the first checkpoint after an open wrote {reopened} bytes");
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// Snapshots share the stored pages: a snapshot's checkpoint writes a leaf for each
/// page its volume changed after it, not its pages; pages its volume changes afterwards are written once
/// each, and deleting the snapshot frees the page chunks no one needs.
#[test]
fn a_snapshot_adds_page_locations_to_a_checkpoint_not_pages() {
    // Snapshot `s` is followed by a change in page `page_of(s)`: pages 0 to 4 and 7 to
    // 11, five of the seven in each of the first two page chunks.
    let page_of = |s: u64| if s < 5 { s } else { s + 2 };
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = full_pages(dir.path(), &rt);
    rt.block_on(pool.checkpoint()).unwrap();
    let before = checkpoint_bytes(&pool);
    for s in 0..10 {
        rt.block_on(pool.create_snapshot("v", &format!("s{s}"))).unwrap();
        // One unit changed between snapshots: one page copied.
        rt.block_on(write(&v, (page_of(s) * 512 + 7) * UNIT, &[0xa0 + s as u8; 4096], false)).unwrap();
    }
    rt.block_on(pool.checkpoint()).unwrap();
    let ten = checkpoint_bytes(&pool) - before;
    // Ten copied pages, ten copied leaves (32 page locations each, 12 bytes) and ten
    // more tables' leaf locations, nothing else.
    assert!(
        ten <= COPIES * (10 * (8 * 1024 + 4096) + 3 * 4096 + 28 * 1024),
        "ten snapshots' checkpoint wrote {ten} bytes"
    );
    drop(v);
    pool.close().unwrap();
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    for s in 0..10u64 {
        let snap = pool.volume(&format!("v@s{s}")).unwrap();
        // Unit s*512+7 as it was when s was taken: changed by snapshots before it only.
        let u = page_of(s) * 512 + 7;
        assert_eq!(rt.block_on(read(&snap, u * UNIT, 4096)), vec![tag(u, 0); 4096], "v@s{s}");
        if s > 0 {
            let u = page_of(s - 1) * 512 + 7;
            assert_eq!(rt.block_on(read(&snap, u * UNIT, 4096)), vec![0xa0 + s as u8 - 1; 4096], "v@s{s}");
        }
    }
    let held = pool.status().metadata;
    for s in 0..10 {
        rt.block_on(pool.delete_snapshot("v", &format!("s{s}"))).unwrap();
    }
    rt.block_on(pool.checkpoint()).unwrap();
    assert!(pool.status().metadata <= held, "deleting the snapshots grew the checkpoint");
    // The original pages the snapshots held are dead now: the first two page chunks
    // (seven full pages each) keep two live pages each, less than half. A checkpoint
    // with nothing to write may leave them (within twice the compact size); the next
    // one that writes a page cleans them and gives the room back.
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, (20 * 512 + 9) * UNIT + 4096, &[0x5c; 4096], false)).unwrap();
    drop(v);
    rt.block_on(pool.checkpoint()).unwrap();
    assert!(pool.status().metadata < held, "the half-dead page chunks were not cleaned");
    pool.close().unwrap();
    let r = storage_engine::check(&pool_path(dir.path())).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    assert_clean(dir.path());
}

/// Snapshots share their volume's leaves: a checkpoint after a hundred snapshots of an
/// unchanged volume writes, for each, its volume record and one leaf location (the
/// 32 pages of its one leaf are not named again, which took 384 bytes per snapshot
/// before leaves were shared), and every snapshot opens with its volume's content.
#[test]
fn snapshots_of_an_unchanged_volume_add_a_leaf_location_each() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = full_pages(dir.path(), &rt);
    rt.block_on(pool.checkpoint()).unwrap();
    let held = pool.status().metadata;
    let before = checkpoint_bytes(&pool);
    let snapshots = 100u64;
    for s in 0..snapshots {
        rt.block_on(pool.create_snapshot("v", &format!("s{s}"))).unwrap();
    }
    rt.block_on(pool.checkpoint()).unwrap();
    let wrote = checkpoint_bytes(&pool) - before;
    // A volume record with its name (about 40 bytes) and a leaf location record (24).
    assert!(wrote <= COPIES * (snapshots * 80 + 4096), "{snapshots} snapshots' checkpoint wrote {wrote} bytes");
    assert!(pool.status().metadata <= held + COPIES * UNIT, "the snapshots added pages to the checkpoint");
    drop(v);
    pool.close().unwrap();
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    for s in [0, snapshots / 2, snapshots - 1] {
        let snap = pool.volume(&format!("v@s{s}")).unwrap();
        for u in [0, 511, 512 * PAGES - 1] {
            assert_eq!(rt.block_on(read(&snap, u * UNIT, 4096)), vec![tag(u, 0); 4096], "v@s{s} unit {u}");
        }
    }
    pool.close().unwrap();
    assert_clean(dir.path());
}
