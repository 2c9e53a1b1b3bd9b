//! `repair` (`ferrovol check --repair`) on a stopped pool whose stored refcounts disagree
//! with its mappings (a pool of an older build: this one stores none, and derives them
//! at open): open refuses it naming the repair, the repair rebuilds every refcount from
//! the mappings and reports each change, and the pool then checks clean and opens with
//! its data. A pool whose mappings are damaged is refused and left unchanged.
//! The damage is written into the checkpoint with its checksums recomputed, as a bug in
//! the engine (a leaked reference) would leave it.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use storage_engine::format::{crc, ChunkHeader, RecordHeader, Superblock, REC_REFCOUNTS, SUPERBLOCK_OFFSETS};
use storage_engine::{ErrorKind, Pool};
use zerocopy::{FromBytes, IntoBytes};

/// Rewrites the current checkpoint's first chunk with `patch` applied to its payload,
/// its checksum recomputed.
fn patch_checkpoint(path: &Path, patch: impl FnOnce(&mut [u8])) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut slot = [0u8; 256];
    let sb = SUPERBLOCK_OFFSETS
        .iter()
        .map(|&at| {
            f.read_exact_at(&mut slot, at).unwrap();
            Superblock::read_from_prefix(&slot).unwrap().0
        })
        .max_by_key(|sb| sb.generation.get())
        .unwrap();
    let at = sb.data_offset.get() + sb.checkpoint_unit.get() * u64::from(sb.unit_size.get());
    let mut chunk = vec![0u8; sb.unit_size.get() as usize];
    f.read_exact_at(&mut chunk, at).unwrap();
    let (mut h, _) = ChunkHeader::read_from_prefix(&chunk).unwrap();
    let hl = size_of::<ChunkHeader>();
    let plen = h.payload_len.get() as usize;
    patch(&mut chunk[hl..hl + plen]);
    h.crc = 0.into();
    let sum = crc32c::crc32c_append(crc(h.as_bytes()), &chunk[hl..hl + plen]);
    chunk[4..8].copy_from_slice(&sum.to_le_bytes());
    f.write_all_at(&chunk, at).unwrap();
}

/// The refcount entries of a checkpoint payload: (byte offset of the entry, unit, refcount).
fn refcount_entries(payload: &[u8]) -> Vec<(usize, u64, u32)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= payload.len() {
        let (h, _) = RecordHeader::read_from_prefix(&payload[at..]).unwrap();
        let body = at + 4;
        let len = h.len.get() as usize;
        if h.kind == REC_REFCOUNTS {
            for e in (body..body + len).step_by(16) {
                let unit = u64::from_le_bytes(payload[e..e + 8].try_into().unwrap());
                let rc = u32::from_le_bytes(payload[e + 8..e + 12].try_into().unwrap());
                out.push((e, unit, rc));
            }
        }
        at = body + len;
    }
    out
}

/// A pool with a volume of four written units, a snapshot of it and one overwritten unit
/// since (copied on write), closed: the log empty, everything in the checkpoint.
fn pool_with_data(dir: &Path) {
    let rt = rt();
    let pool = create(dir, 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    for i in 0..4u8 {
        rt.block_on(write(&v, u64::from(i) * 65536, &[i + 1; 65536], false)).unwrap();
    }
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    rt.block_on(write(&v, 0, &[9; 4096], false)).unwrap();
    drop(v);
    rt.block_on(pool.checkpoint()).unwrap();
    pool.close().unwrap();
}

fn assert_data(dir: &Path) {
    let rt = rt();
    let pool = Pool::open(&pool_path(dir)).unwrap();
    let (v, s) = (pool.volume("v").unwrap(), pool.volume("v@s").unwrap());
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![9; 4096]);
    assert_eq!(rt.block_on(read(&s, 0, 4096)), vec![1; 4096]);
    for i in 1..4u8 {
        assert_eq!(rt.block_on(read(&v, u64::from(i) * 65536, 4096)), vec![i + 1; 4096]);
        assert_eq!(rt.block_on(read(&s, u64::from(i) * 65536, 4096)), vec![i + 1; 4096]);
    }
    drop((v, s));
    pool.close().unwrap();
}

/// Every volume's and snapshot's bytes in the pool at `path` (opened, so upgraded).
fn contents(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let rt = rt();
    let pool = Pool::open(path).unwrap();
    let out = pool
        .list_volumes()
        .into_iter()
        .chain(pool.list_snapshots(None))
        .map(|v| {
            let data = rt.block_on(read(&pool.volume(&v.name).unwrap(), 0, v.size));
            (v.name, data)
        })
        .collect();
    pool.close().unwrap();
    out
}

#[test]
fn repair_rebuilds_refcounts_from_the_mappings() {
    // A pool of format version 4, whose checkpoint stores refcounts.
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    std::fs::write(&path, fixture_image("pool-v4")).unwrap();
    let pristine = dir.path().join("pristine.img");
    std::fs::write(&pristine, fixture_image("pool-v4")).unwrap();
    let want = contents(&pristine);
    // A reference leaked (one unit counted twice) and one entry moved to a unit no page
    // maps (so a mapped unit lost its count, and a free one is held).
    let mut damaged = Vec::new();
    patch_checkpoint(&path, |payload| {
        let entries = refcount_entries(payload);
        assert!(entries.len() >= 5, "{entries:?}");
        let (at, unit, rc) = entries[0];
        payload[at + 8..at + 12].copy_from_slice(&(rc + 1).to_le_bytes());
        damaged.push((unit as u32, rc + 1, rc));
        let (at, unit, rc) = entries[1];
        payload[at..at + 8].copy_from_slice(&900u64.to_le_bytes());
        damaged.push((unit as u32, 0, rc));
        damaged.push((900, rc, 0));
    });
    damaged.sort_unstable();
    let e = Pool::open(&path).err().expect("open refuses mismatched refcounts");
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("ferrovol check --repair"), "the error names the repair: {e}");
    assert!(!storage_engine::check(&path).unwrap().problems.is_empty());

    let report = storage_engine::repair(&path).unwrap();
    assert_eq!(report.changed, damaged, "each change, unit by unit");
    assert_eq!(report.freed, 1, "the unit no page maps is free again");
    assert_clean(dir.path());
    assert_eq!(contents(&path), want, "the data after the repair");
    // A clean pool needs nothing, and the repair writes nothing.
    let before = std::fs::read(&path).unwrap();
    assert!(storage_engine::repair(&path).unwrap().changed.is_empty());
    assert!(std::fs::read(&path).unwrap() == before, "a repair of a clean pool wrote to it");
}

/// This build's checkpoints store no refcounts: the open derives each unit's from the
/// mappings, so the pool holds its data across a close and a crash, and a unit two
/// tables share is copied on write.
#[test]
fn refcounts_are_derived_from_the_mappings_at_open() {
    let dir = tempfile::tempdir().unwrap();
    pool_with_data(dir.path());
    let path = pool_path(dir.path());
    patch_checkpoint(&path, |payload| assert!(refcount_entries(payload).is_empty(), "refcounts stored"));
    assert_clean(dir.path());
    assert_data(dir.path());
    // Shared units are still shared: a write to the volume leaves the snapshot as it was.
    let rt = rt();
    let pool = Pool::open(&path).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 65536, &[7; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    drop(pool); // a crash: the log is replayed onto the derived refcounts
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    assert!(rt.block_on(read(&pool.volume("v@s").unwrap(), 65536, 4096)).iter().all(|&b| b == 2), "the snapshot");
    assert!(rt.block_on(read(&pool.volume("v").unwrap(), 65536, 4096)).iter().all(|&b| b == 7), "the volume");
    pool.close().unwrap();
}

#[test]
fn repair_refuses_a_pool_whose_mappings_are_damaged() {
    let dir = tempfile::tempdir().unwrap();
    pool_with_data(dir.path());
    let path = pool_path(dir.path());
    // The volume's size made not a multiple of 4096: its record is damaged, and with it
    // what its mappings mean.
    patch_checkpoint(&path, |payload| {
        // The record of volume "v": a name length of 1, two bytes of flags, the name.
        let name = payload
            .windows(5)
            .position(|w| w[..2] == [1, 0] && w[4] == b'v')
            .map(|p| p + 4)
            .expect("the volume record");
        let size_at = name - 24 + 8;
        payload[size_at..size_at + 8].copy_from_slice(&(16 * MIB + 1).to_le_bytes());
    });
    let before = std::fs::read(&path).unwrap();
    let e = storage_engine::repair(&path).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("restore the pool from a copy"), "{e}");
    assert!(std::fs::read(&path).unwrap() == before, "a refused repair changed the pool");
}

#[test]
fn repair_refuses_a_pool_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let pool = create(dir.path(), 64 * MIB);
    let e = storage_engine::repair(&pool_path(dir.path())).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InUse, "{e}");
    drop(pool);
}

/// A checkpoint whose next volume id is not above every volume's id (damage under a
/// valid checksum) is refused by open, `check` and the repair alike, and left as it is:
/// opened, it would give a new volume the id of an existing one, whose records would
/// then be taken for the new one's and its data lost at the next checkpoint.
#[test]
fn a_checkpoint_whose_next_volume_id_is_taken_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    pool_with_data(dir.path());
    let path = pool_path(dir.path());
    // The pool record comes first: its next id (the volume has id 1, the snapshot 2).
    patch_checkpoint(&path, |payload| {
        assert_eq!(payload[0], storage_engine::format::REC_POOL);
        payload[4..12].copy_from_slice(&2u64.to_le_bytes());
    });
    let before = std::fs::read(&path).unwrap();
    let e = Pool::open(&path).err().expect("the damaged pool opened");
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("next volume id as 2"), "{e}");
    assert!(storage_engine::check(&path).is_err());
    assert_eq!(storage_engine::repair(&path).unwrap_err().kind(), ErrorKind::Corrupt);
    assert!(std::fs::read(&path).unwrap() == before, "a refused open or repair changed the pool");
}
