//! Ditto copies (docs/on-disk-format.md 5.5): every checkpoint chunk is stored in two
//! units and the superblock in both slots, so that one bad metadata block loses
//! nothing. Each block of each copy of a pool's metadata is damaged in turn, on a copy
//! of the pool: `check` finds no problem and names the damaged copy, the pool opens
//! with every byte of every volume, snapshot and clone, and once opened (or repaired)
//! `check` finds nothing left to warn about. Both copies damaged: the open is refused,
//! naming both.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use storage_engine::format::{ChunkHeader, Superblock, CHECKPOINT_MAGIC, PAGE_CHUNK_MAGIC, SUPERBLOCK_OFFSETS};
use storage_engine::Pool;
use zerocopy::FromBytes;

const UNIT: u64 = 16 * 1024;
const BLOCK: u64 = 4096;

/// What each volume reads: `(name, offset) -> byte` of 4 KiB blocks, every other
/// block of the sampled ones zero.
type Expected = BTreeMap<(String, u64), u8>;

/// Builds a pool with a volume spread over many mapping pages, a snapshot before
/// copy-on-write writes, a clone of it written to, and 300 snapshots (a directory of
/// more than one chunk), checkpointed, with more writes in the log after; returns its
/// image and what it holds.
fn build(dir: &Path) -> (Vec<u8>, Expected) {
    let rt = rt();
    let pool = create_with_unit(dir, 32 * MIB, UNIT as u32);
    let mut want = Expected::new();
    rt.block_on(pool.create_volume("v", 64 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    let put = |v: &storage_engine::Volume, name: &str, off: u64, byte: u8, want: &mut Expected| {
        rt.block_on(write(v, off, &[byte; BLOCK as usize], false)).unwrap();
        want.insert((name.to_string(), off), byte);
    };
    // One block every 256 KiB: every mapping page of the 64 MiB volume.
    for i in 0..256u64 {
        put(&v, "v", i * 256 * 1024, (i % 251) as u8 + 1, &mut want);
    }
    rt.block_on(pool.create_snapshot("v", "a")).unwrap();
    for (&(_, off), &byte) in want.clone().iter() {
        want.insert(("v@a".to_string(), off), byte);
    }
    for i in (0..256u64).step_by(3) {
        put(&v, "v", i * 256 * 1024, 0xee, &mut want);
    }
    rt.block_on(pool.clone_volume("v@a", "c")).unwrap();
    let c = pool.volume("c").unwrap();
    for (&(ref n, off), &byte) in want.clone().iter() {
        if n == "v@a" {
            want.insert(("c".to_string(), off), byte);
        }
    }
    for i in (1..256u64).step_by(5) {
        put(&c, "c", i * 256 * 1024 + BLOCK, 0xcc, &mut want);
    }
    for s in 0..300 {
        rt.block_on(pool.create_snapshot("v", &format!("s{s}"))).unwrap();
    }
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    // In the log only.
    put(&v, "v", 7 * BLOCK, 0x77, &mut want);
    rt.block_on(v.flush()).unwrap();
    drop((v, c));
    pool.close().unwrap();
    let image = std::fs::read(pool_path(dir)).unwrap();
    (image, want)
}

/// Checks that the pool in `dir` holds `want` (every sampled block, and the block
/// after each, which no one wrote).
fn assert_content(dir: &Path, want: &Expected, what: &str) {
    let rt = rt();
    let pool = Pool::open(&pool_path(dir)).unwrap_or_else(|e| panic!("{what}: the pool does not open: {e}"));
    let mut names: Vec<String> = want.keys().map(|(n, _)| n.clone()).collect();
    names.dedup();
    assert_eq!(pool.names().len(), 303, "{what}");
    for n in names {
        let v = pool.volume(&n).unwrap();
        for (&(_, off), &byte) in want.range((n.clone(), 0)..=(n.clone(), u64::MAX)) {
            assert_eq!(rt.block_on(read(&v, off, BLOCK)), vec![byte; BLOCK as usize], "{what}: {n} at {off}");
        }
    }
    // The last snapshot is the volume before the log's write.
    let s = pool.volume("v@s299").unwrap();
    assert_eq!(rt.block_on(read(&s, 7 * BLOCK, BLOCK)), vec![0; BLOCK as usize], "{what}: v@s299");
    assert_eq!(rt.block_on(read(&s, 0, BLOCK)), vec![0xee; BLOCK as usize], "{what}: v@s299");
    drop(s);
    pool.close().unwrap();
}

/// The pool's unit size and the byte offset of its data units.
fn geometry(image: &[u8]) -> (u64, u64) {
    let (sb, _) = Superblock::read_from_prefix(image).unwrap();
    (sb.unit_size.get() as u64, sb.data_offset.get())
}

/// Flips a byte at `at` of the pool in `dir`.
fn damage(dir: &Path, image: &[u8], at: &[u64]) {
    let mut img = image.to_vec();
    for &a in at {
        img[a as usize] ^= 0x5a;
    }
    std::fs::write(pool_path(dir), img).unwrap();
}

/// Every checkpoint chunk the image holds (live or left by an earlier checkpoint):
/// `(unit, blocks of header and payload)`.
fn chunks(image: &[u8]) -> Vec<(u64, u64)> {
    let (unit, data) = geometry(image);
    let mut out = Vec::new();
    let mut u = 0;
    while data + (u + 1) * unit <= image.len() as u64 {
        let at = (data + u * unit) as usize;
        let (h, _) = ChunkHeader::read_from_prefix(&image[at..]).unwrap();
        if [CHECKPOINT_MAGIC, PAGE_CHUNK_MAGIC].contains(&h.magic.get()) {
            out.push((u, (64 + u64::from(h.payload_len.get())).div_ceil(BLOCK)));
        }
        u += 1;
    }
    out
}

/// The pool in `dir` once damaged: `check` finds no problem and names the damaged
/// copy (`named`: a unit, or a superblock slot), it opens with every byte, and after
/// the open (and a repair, for a copy the open did not read) `check` finds nothing.
fn assert_survives(dir: &Path, want: &Expected, named: &str, what: &str) {
    let r = storage_engine::check(&pool_path(dir)).unwrap();
    assert!(r.problems.is_empty(), "{what}: {r:?}");
    assert!(r.damaged_copies && r.warnings.iter().any(|w| w.contains(named)), "{what}: {named} not named: {r:?}");
    assert_content(dir, want, what);
    let r = storage_engine::check(&pool_path(dir)).unwrap();
    if r.damaged_copies {
        let rep = storage_engine::repair(&pool_path(dir)).unwrap_or_else(|e| panic!("{what}: repair: {e}"));
        assert!(rep.rewritten_copies.iter().any(|w| w.contains(named)), "{what}: repair says {rep:?}");
        assert_content(dir, want, &format!("{what}, repaired"));
    }
    let r = storage_engine::check(&pool_path(dir)).unwrap();
    assert!(r.problems.is_empty() && r.warnings.is_empty() && !r.damaged_copies, "{what}, afterwards: {r:?}");
}

/// Each block of each copy of every metadata structure damaged in turn: the pool
/// opens with all its data, and `check` names the copy.
#[test]
fn each_damaged_metadata_block_is_read_around_and_written_again() {
    let built = tempfile::tempdir().unwrap();
    let (image, want) = build(built.path());
    let (unit, data) = geometry(&image);
    let meta_units = {
        let r = storage_engine::check(&pool_path(built.path())).unwrap();
        assert!(r.problems.is_empty() && r.warnings.is_empty(), "{r:?}");
        let words: Vec<&str> = r.summary.split_whitespace().collect();
        let i = words.iter().position(|w| w.starts_with("metadata")).unwrap();
        words[i - 1].parse::<u64>().unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    for (slot, at) in SUPERBLOCK_OFFSETS.iter().enumerate() {
        damage(dir.path(), &image, &[at + 40]);
        assert_survives(dir.path(), &want, &format!("slot {slot} is damaged"), &format!("superblock slot {slot}"));
    }
    // A chunk whose first block, damaged, is not named is one an earlier checkpoint
    // left (its unit free): nothing reads it.
    let (mut live, mut directory) = (0, 0);
    for (u, blocks) in chunks(&image) {
        let named = format!("the copy at data unit {u} ");
        let first = data + u * unit + 8;
        damage(dir.path(), &image, &[first]);
        let r = storage_engine::check(&pool_path(dir.path())).unwrap();
        if !r.warnings.iter().any(|w| w.contains(&named)) {
            assert!(r.problems.is_empty() && r.warnings.is_empty(), "unit {u}, not live: {r:?}");
            continue;
        }
        live += 1;
        let magic = u32::from_le_bytes(image[(data + u * unit) as usize..][..4].try_into().unwrap());
        directory += u64::from(magic == CHECKPOINT_MAGIC);
        for b in 0..blocks {
            // In the block, within the header and payload.
            let at = data + u * unit + b * BLOCK + if b == 0 { 8 } else { 100 };
            damage(dir.path(), &image, &[at]);
            assert_survives(dir.path(), &want, &named, &format!("unit {u} block {b}"));
        }
    }
    assert_eq!(live, meta_units, "every unit of metadata is a chunk whose damage check names");
    assert!(directory >= 4, "a directory of {directory} chunks with their copies: want two or more chunks");
}

/// Both copies of a directory chunk damaged: the pool is not opened, and the error
/// names both copies; `check` reports the same.
#[test]
fn both_copies_damaged_refuse_the_open_naming_both() {
    let built = tempfile::tempdir().unwrap();
    let (image, _) = build(built.path());
    let (unit, data) = geometry(&image);
    let (sb, _) = Superblock::read_from_prefix(&image[..]).unwrap();
    let (first, copy) = (sb.checkpoint_unit.get(), sb.checkpoint_copy_unit.get());
    assert_ne!(first, copy);
    let dir = tempfile::tempdir().unwrap();
    damage(dir.path(), &image, &[data + first * unit + 8, data + copy * unit + 8]);
    let e = Pool::open(&pool_path(dir.path())).err().expect("an open with no sound copy");
    let msg = e.to_string();
    assert!(msg.contains("no copy is sound"), "{msg}");
    for u in [first, copy] {
        assert!(msg.contains(&format!("data unit {u} ")), "unit {u} not named: {msg}");
    }
    assert!(storage_engine::check(&pool_path(dir.path())).is_err());
}
