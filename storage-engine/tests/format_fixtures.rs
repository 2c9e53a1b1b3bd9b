//! Pools written by older builds, kept in `tests/fixtures/` as gzip-compressed images,
//! open with this build and are upgraded to its format version (docs/on-disk-format.md
//! section 8). Each fixture holds volumes, a snapshot taken before copy-on-write
//! writes, a clone of it, labels, an attachment, a resize and a trim, partly in its
//! checkpoint and partly in a log this build must replay (the image was copied from a
//! running pool after a flush, as a crash would leave it).
//!
//! A fixture is never regenerated: it is what a user's pool of that version holds.
//! `FERROVOL_WRITE_FIXTURE=PATH cargo nextest run -p storage-engine --test
//! format_fixtures` writes a new one with the build at hand (the recipe below), for
//! the day this build's version is the older one.

mod common;

use std::io::Write;
use std::path::Path;

use common::*;
use storage_engine::format::{
    Superblock, FORMAT_VERSION, INCOMPAT_DERIVED_REFCOUNTS, INCOMPAT_DITTO, INCOMPAT_PAGE_CHUNKS,
    INCOMPAT_SHARED_LEAVES, SUPERBLOCK_OFFSETS,
};
use storage_engine::{Labels, Pool, PoolOptions};

const K: u64 = 1024;

/// A volume's expected content: `(name, size, [(offset, len, byte)])`.
type Content = (&'static str, u64, Vec<(u64, u64, u8)>);

/// What the recipe leaves in each volume and snapshot, every byte outside the listed
/// ranges zero.
fn expected() -> Vec<Content> {
    vec![
        (
            "db",
            16 * MIB,
            vec![
                (0, 4 * K, 0xa4),
                (4 * K, 60 * K, 0xa1),
                (64 * K, 64 * K, 0xa2),
                (192 * K, 64 * K, 0xa1),
                (12 * MIB, 4 * K, 0xa3),
            ],
        ),
        ("db@monday", 8 * MIB, vec![(0, 256 * K, 0xa1)]),
        (
            "db@tuesday",
            16 * MIB,
            vec![(0, 64 * K, 0xa1), (64 * K, 64 * K, 0xa2), (192 * K, 64 * K, 0xa1), (12 * MIB, 4 * K, 0xa3)],
        ),
        ("dbc", 8 * MIB, vec![(0, 4 * K, 0xc1), (4 * K, 252 * K, 0xa1)]),
        ("logs", 4 * MIB, vec![(MIB, 64 * K, 0xb1)]),
    ]
}

/// Builds the fixture's pool in `dir` and returns a copy of its image taken while it
/// runs, after a flush.
fn recipe(dir: &Path) -> Vec<u8> {
    let rt = rt();
    let path = pool_path(dir);
    let opts = PoolOptions { size: 64 * MIB, unit_size: 64 * 1024, ..Default::default() };
    let pool = Pool::create(&path, &opts).unwrap();
    let labels: Labels = [("app".to_string(), "pg".to_string())].into();
    // Into the checkpoint: volumes, a snapshot, copy on write, a clone of the snapshot.
    rt.block_on(pool.create_volume_with("db", 8 * MIB, &labels)).unwrap();
    let db = pool.volume("db").unwrap();
    rt.block_on(write(&db, 0, &[0xa1; 256 * 1024], false)).unwrap();
    rt.block_on(pool.create_volume("logs", 4 * MIB)).unwrap();
    let logs = pool.volume("logs").unwrap();
    rt.block_on(write(&logs, MIB, &[0xb1; 64 * 1024], false)).unwrap();
    rt.block_on(pool.create_snapshot("db", "monday")).unwrap();
    rt.block_on(write(&db, 64 * K, &[0xa2; 64 * 1024], false)).unwrap();
    rt.block_on(pool.clone_volume("db@monday", "dbc")).unwrap();
    let dbc = pool.volume("dbc").unwrap();
    rt.block_on(write(&dbc, 0, &[0xc1; 4096], false)).unwrap();
    drop((db, logs, dbc));
    // A close writes no checkpoint (docs/on-disk-format.md 7.6): ask for one.
    rt.block_on(pool.checkpoint()).unwrap();
    pool.close().unwrap();
    // Into the log only: a volume made and deleted, a resize, a FUA write, a trim, an
    // attachment, a second snapshot and a write after it.
    let pool = Pool::open(&path).unwrap();
    rt.block_on(pool.create_volume("gone", MIB)).unwrap();
    let gone = pool.volume("gone").unwrap();
    rt.block_on(write(&gone, 0, &[0xdd; 8192], false)).unwrap();
    drop(gone);
    rt.block_on(pool.delete_volume("gone")).unwrap();
    rt.block_on(pool.resize_volume("db", 16 * MIB)).unwrap();
    let db = pool.volume("db").unwrap();
    rt.block_on(write(&db, 12 * MIB, &[0xa3; 4096], true)).unwrap();
    rt.block_on(db.trim(128 * K, 64 * K, false)).unwrap();
    rt.block_on(pool.attach("db", "n1", false, false)).unwrap();
    rt.block_on(pool.create_snapshot("db", "tuesday")).unwrap();
    rt.block_on(write(&db, 0, &[0xa4; 4096], false)).unwrap();
    rt.block_on(db.flush()).unwrap();
    let image = std::fs::read(&path).unwrap();
    drop(db);
    pool.close().unwrap();
    image
}

fn slot(image: &Path, at: u64) -> Superblock {
    use std::os::unix::fs::FileExt;
    use zerocopy::FromBytes;
    let mut b = [0u8; 256];
    std::fs::File::open(image).unwrap().read_exact_at(&mut b, at).unwrap();
    Superblock::read_from_bytes(&b).unwrap()
}

fn slot_version(image: &Path, at: u64) -> u32 {
    slot(image, at).version.get()
}

fn slot_incompat(image: &Path, at: u64) -> u64 {
    slot(image, at).incompat_features.get()
}

/// Checks that the pool at `path` holds what the recipe left.
fn assert_recipe_content(pool: &Pool) {
    let rt = rt();
    let mut names = pool.names();
    names.sort();
    assert_eq!(names, ["db", "db@monday", "db@tuesday", "dbc", "logs"]);
    for (name, size, ranges) in expected() {
        let v = pool.volume(name).unwrap();
        assert_eq!(v.size(), size, "{name}");
        let mut want = vec![0u8; size as usize];
        for (off, len, byte) in ranges {
            want[off as usize..(off + len) as usize].fill(byte);
        }
        let got = rt.block_on(read(&v, 0, size));
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!("{name}: byte {i} is {:#x}, expected {:#x}", got[i], want[i]);
        }
        assert!(!v.is_pristine(), "{name} holds data");
    }
    let db = pool.volume_info("db").unwrap();
    assert_eq!(db.labels.get("app").map(String::as_str), Some("pg"));
    assert_eq!(db.attachments.iter().map(|a| a.node_id.as_str()).collect::<Vec<_>>(), ["n1"]);
    assert!(!db.attachments[0].read_only);
    assert!(pool.volume_info("logs").unwrap().attachments.is_empty());
    // Snapshots and the clone share what they did not change: the units of db's first
    // 256 KiB that no write replaced are shared.
    assert!(pool.volume_info("db@monday").unwrap().shared > 0);
}

/// A version 4 pool, written by the build of that version, opens (its checkpoint read,
/// its log replayed), holds every volume, snapshot, clone, label and attachment it
/// held, is written as this build's version from that open on, and opens again.
#[test]
fn a_version_4_pool_from_an_older_build_opens_and_is_upgraded() {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    std::fs::write(&path, fixture_image("pool-v4")).unwrap();
    for at in SUPERBLOCK_OFFSETS {
        assert_eq!(slot_version(&path, at), 4, "the fixture's slot at byte {at}");
    }
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    let pool = Pool::open(&path).unwrap();
    assert!(pool.recovery().batches_replayed > 0, "the fixture's log holds commits to replay");
    assert_recipe_content(&pool);
    pool.close().unwrap();
    for at in SUPERBLOCK_OFFSETS {
        assert_eq!(slot_version(&path, at), FORMAT_VERSION, "slot at byte {at} after the upgrading open");
        // Its checkpoints now store no refcounts and keep pages and leaves in page
        // chunks: a build that would read them refuses it.
        assert_eq!(slot_incompat(&path, at), THIS_BUILDS_INCOMPAT, "slot at byte {at} after the upgrading open");
    }
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    assert_recipe_content(&pool);
    pool.close().unwrap();
}

/// The recipe itself, run with this build: what it leaves reads back as expected, and
/// with `FERROVOL_WRITE_FIXTURE=PATH` the image is written there, compressed.
#[test]
fn the_fixture_recipe_leaves_what_the_checks_expect() {
    let dir = tempfile::tempdir().unwrap();
    let image = recipe(dir.path());
    if let Some(out) = std::env::var_os("FERROVOL_WRITE_FIXTURE") {
        let mut gz = flate2::write::GzEncoder::new(std::fs::File::create(out).unwrap(), flate2::Compression::best());
        gz.write_all(&image).unwrap();
        gz.finish().unwrap();
    }
    let crashed = tempfile::tempdir().unwrap();
    std::fs::write(pool_path(crashed.path()), &image).unwrap();
    let pool = Pool::open(&pool_path(crashed.path())).unwrap();
    assert!(pool.recovery().batches_replayed > 0);
    assert_recipe_content(&pool);
    pool.close().unwrap();
}

/// Every incompatible feature a checkpoint of this build sets.
const THIS_BUILDS_INCOMPAT: u64 =
    INCOMPAT_DERIVED_REFCOUNTS | INCOMPAT_PAGE_CHUNKS | INCOMPAT_SHARED_LEAVES | INCOMPAT_DITTO;

/// The version 5 fixture `name`, whose slots both have the incompatible features
/// `incompat`: it opens, `check` finds nothing wrong, it holds what the recipe left,
/// and it opens again after a checkpoint of this build, which sets this build's
/// features.
fn a_version_5_fixture_opens(name: &str, incompat: u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    std::fs::write(&path, fixture_image(name)).unwrap();
    for at in SUPERBLOCK_OFFSETS {
        assert_eq!(slot_version(&path, at), 5, "the fixture's slot at byte {at}");
        assert_eq!(slot_incompat(&path, at), incompat, "the fixture's slot at byte {at}");
    }
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    let pool = Pool::open(&path).unwrap();
    assert!(pool.recovery().batches_replayed > 0, "the fixture's log holds commits to replay");
    assert_recipe_content(&pool);
    rt().block_on(pool.checkpoint()).unwrap();
    pool.close().unwrap();
    let current = (0..2).max_by_key(|&i| slot(&path, SUPERBLOCK_OFFSETS[i]).generation.get()).unwrap();
    assert_eq!(
        slot_incompat(&path, SUPERBLOCK_OFFSETS[current]),
        THIS_BUILDS_INCOMPAT,
        "this build's checkpoint keeps pages and shared leaves in page chunks"
    );
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    assert_recipe_content(&pool);
    pool.close().unwrap();
}

/// A version 5 pool whose checkpoint is written whole (every mapping page in one chain
/// of chunks, refcounts derived), from the build before checkpoints kept their pages
/// across checkpoints.
#[test]
fn a_version_5_pool_with_a_whole_checkpoint_opens() {
    a_version_5_fixture_opens("pool-v5", INCOMPAT_DERIVED_REFCOUNTS);
}

/// A version 5 pool whose pages are in page chunks and whose directory names every
/// volume's pages, from the build before volumes and snapshots shared leaves: each
/// table gets leaves of its own at open, sharing the pages, and the first checkpoint
/// writes them.
#[test]
fn a_version_5_pool_with_page_chunks_and_no_leaves_opens() {
    a_version_5_fixture_opens("pool-v5-page-chunks", INCOMPAT_DERIVED_REFCOUNTS | INCOMPAT_PAGE_CHUNKS);
}

/// A version 5 pool whose volumes and snapshots share leaves, each checkpoint chunk and
/// superblock stored once, from the build before ditto copies: it opens, and the
/// checkpoint its open writes stores every chunk in two copies and the superblock in
/// both slots.
#[test]
fn a_version_5_pool_with_shared_leaves_stored_once_opens() {
    a_version_5_fixture_opens(
        "pool-v5-shared-leaves",
        INCOMPAT_DERIVED_REFCOUNTS | INCOMPAT_PAGE_CHUNKS | INCOMPAT_SHARED_LEAVES,
    );
}

/// A full version 5 pool of the build before the metadata changes (every checkpoint
/// written whole with its refcounts, stored once: no feature bits), made with that build's server: a 24 MiB pool of 16 KiB
/// units, volume `v` of 64 MiB with the first 4 KiB of each of its units `i` written
/// with the byte `i % 251 + 1` until the pool refused the next with ENOSPC (1,184
/// units), then snapshots of `v` taken until it refused the next for the metadata
/// reserve (566 of them), then a clean stop. Its spare was sized for one copy of each
/// chunk: the checkpoint at open, which writes two, may find fewer spare units than
/// its bound and takes free units past them. It opens with all its data and
/// snapshots, `check` finds it clean, and then, being full, it refuses changes that
/// need room with `NoSpace` until a delete frees some.
#[test]
fn a_full_version_5_pool_stored_once_is_converted_at_open() {
    const UNIT: u64 = 16 * K;
    const MAPPED: u64 = 1184;
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    std::fs::write(&path, fixture_image("pool-v5-full")).unwrap();
    let current_slot = |path: &Path| {
        SUPERBLOCK_OFFSETS[(0..2).max_by_key(|&i| slot(path, SUPERBLOCK_OFFSETS[i]).generation.get()).unwrap()]
    };
    assert_eq!(slot_version(&path, current_slot(&path)), 5, "the fixture's current slot");
    assert_eq!(slot_incompat(&path, current_slot(&path)), 0, "the fixture's current slot: refcounts stored, one copy");
    let before = storage_engine::check(&path).unwrap();
    assert!(before.problems.is_empty(), "{before:?}");
    let rt = rt();
    let expect_v = |v: &storage_engine::Volume| {
        let got = [rt.block_on(read(v, 0, 32 * MIB)), rt.block_on(read(v, 32 * MIB, 32 * MIB))].concat();
        for (i, unit) in got.chunks(UNIT as usize).enumerate() {
            let byte = if (i as u64) < MAPPED { (i % 251 + 1) as u8 } else { 0 };
            assert!(unit[..4096].iter().all(|&b| b == byte), "unit {i} of {}: expected {byte:#x}", v.name());
            assert!(unit[4096..].iter().all(|&b| b == 0), "unit {i} of {}: past its first block", v.name());
        }
    };
    let pool = Pool::open(&path).unwrap();
    assert_eq!(slot_incompat(&path, current_slot(&path)), THIS_BUILDS_INCOMPAT, "converted at open");
    let mut names = pool.names();
    assert_eq!(names.len(), 567, "v and its snapshots");
    names.sort();
    expect_v(&pool.volume("v").unwrap());
    expect_v(&pool.volume("v@t1364").unwrap());
    expect_v(&pool.volume("v@s1").unwrap());
    // Full: a first write to an unmapped unit, and a snapshot, need room it lacks.
    let v = pool.volume("v").unwrap();
    let e = rt.block_on(write(&v, MAPPED * UNIT, &[7; 4096], false)).unwrap_err();
    assert_eq!(e.kind(), storage_engine::ErrorKind::NoSpace, "{e}");
    let e = rt.block_on(pool.create_snapshot("v", "more")).unwrap_err();
    assert_eq!(e.kind(), storage_engine::ErrorKind::NoSpace, "{e}");
    // Once the snapshots holding its units are gone, v's units are its own: writing
    // them needs no new unit.
    for n in &names {
        if let Some(snap) = n.strip_prefix("v@") {
            rt.block_on(pool.delete_snapshot("v", snap)).unwrap();
        }
    }
    rt.block_on(write(&v, 0, &[0xee; 4096], true)).unwrap();
    // A pool this small needs more free units than it has for the reserve of a
    // checkpoint in two copies: freeing data (the last MiB of what v maps) gives room.
    let e = rt.block_on(pool.create_snapshot("v", "after")).unwrap_err();
    assert_eq!(e.kind(), storage_engine::ErrorKind::NoSpace, "{e}");
    rt.block_on(v.trim((MAPPED - 64) * UNIT, 64 * UNIT, false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.create_snapshot("v", "after")).unwrap();
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xee; 4096]);
    assert_eq!(rt.block_on(read(&v, UNIT, 4096)), vec![2; 4096]);
    drop(v);
    pool.close().unwrap();
}
