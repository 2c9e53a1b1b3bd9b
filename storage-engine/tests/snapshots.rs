//! Model-based property test of snapshots and clones: random writes, trims and zeroes
//! on several volumes mixed with snapshot create and delete, clones of volumes and of
//! snapshots, volume delete, resize, diff and reopen; every volume and snapshot is
//! compared byte for byte with an in-memory model, and `check` (refcounts against
//! mappings) must be clean after each reopen and at the end.

mod common;
use std::collections::BTreeMap;

use common::*;
use proptest::prelude::*;
use storage_engine::{ErrorKind, Pool};

const SIZE: u64 = MIB + 256 * 1024;

#[derive(Debug, Clone)]
enum Op {
    Write { vol: usize, off: u64, len: u64, seed: u8 },
    Trim { vol: usize, off: u64, len: u64 },
    Snapshot { vol: usize },
    DeleteSnapshot { snap: usize },
    Clone { from: usize, from_snapshot: bool },
    DeleteVolume { vol: usize },
    Grow { vol: usize },
    Reopen { clean: bool },
}

fn op() -> impl Strategy<Value = Op> {
    let range = (0..SIZE, 1u64..200_000).prop_map(|(o, l)| (o, l.min(SIZE - o).max(1)));
    prop_oneof![
        6 => (any::<usize>(), range.clone(), any::<u8>()).prop_map(|(vol, (off, len), seed)| Op::Write { vol, off, len, seed }),
        2 => (any::<usize>(), range).prop_map(|(vol, (off, len))| Op::Trim { vol, off, len }),
        2 => any::<usize>().prop_map(|vol| Op::Snapshot { vol }),
        1 => any::<usize>().prop_map(|snap| Op::DeleteSnapshot { snap }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(from, from_snapshot)| Op::Clone { from, from_snapshot }),
        1 => any::<usize>().prop_map(|vol| Op::DeleteVolume { vol }),
        1 => any::<usize>().prop_map(|vol| Op::Grow { vol }),
        1 => any::<bool>().prop_map(|clean| Op::Reopen { clean }),
    ]
}

fn pick<T: Clone>(m: &BTreeMap<String, T>, i: usize) -> Option<(String, T)> {
    if m.is_empty() {
        return None;
    }
    m.iter().nth(i % m.len()).map(|(k, v)| (k.clone(), v.clone()))
}

fn verify(rt: &tokio::runtime::Runtime, pool: &Pool, name: &str, model: &[u8]) {
    let v = pool.volume(name).unwrap();
    assert_eq!(v.size(), model.len() as u64, "{name} size");
    assert_eq!(rt.block_on(read(&v, 0, model.len() as u64)), model, "{name} content");
}

fn run(ops: Vec<Op>) {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let mut pool = create(dir.path(), 48 * MIB);
    let mut vols: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut snaps: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    rt.block_on(pool.create_volume("v0", SIZE)).unwrap();
    vols.insert("v0".into(), vec![0; SIZE as usize]);
    let mut n = 0;
    for op in ops {
        n += 1;
        match op {
            Op::Write { vol, off, len, seed } => {
                let Some((name, mut m)) = pick(&vols, vol) else { continue };
                if off + len > m.len() as u64 {
                    continue;
                }
                let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_add(seed) | 1).collect();
                let v = pool.volume(&name).unwrap();
                rt.block_on(write(&v, off, &data, false)).unwrap();
                m[off as usize..(off + len) as usize].copy_from_slice(&data);
                vols.insert(name, m);
            }
            Op::Trim { vol, off, len } => {
                let Some((name, mut m)) = pick(&vols, vol) else { continue };
                if off + len > m.len() as u64 {
                    continue;
                }
                rt.block_on(pool.volume(&name).unwrap().trim(off, len, false)).unwrap();
                m[off as usize..(off + len) as usize].fill(0);
                vols.insert(name, m);
            }
            Op::Snapshot { vol } => {
                let Some((name, m)) = pick(&vols, vol) else { continue };
                let s = format!("s{n}");
                let info = rt.block_on(pool.create_snapshot(&name, &s)).unwrap();
                assert!(info.snapshot);
                let full = format!("{name}@{s}");
                // A snapshot has no differences from its volume at creation.
                assert_eq!(pool.diff(&name, &full).unwrap(), vec![]);
                snaps.insert(full, m);
            }
            Op::DeleteSnapshot { snap } => {
                let Some((full, _)) = pick(&snaps, snap) else { continue };
                let (v, s) = full.split_once('@').unwrap();
                rt.block_on(pool.delete_snapshot(v, s)).unwrap();
                snaps.remove(&full);
            }
            Op::Clone { from, from_snapshot } => {
                let src = if from_snapshot { pick(&snaps, from) } else { pick(&vols, from) };
                let Some((src, m)) = src else { continue };
                let name = format!("c{n}");
                rt.block_on(pool.clone_volume(&src, &name)).unwrap();
                vols.insert(name, m);
            }
            Op::DeleteVolume { vol } => {
                let Some((name, _)) = pick(&vols, vol) else { continue };
                rt.block_on(pool.delete_volume(&name)).unwrap();
                vols.remove(&name);
            }
            Op::Grow { vol } => {
                let Some((name, mut m)) = pick(&vols, vol) else { continue };
                let new = m.len() as u64 + 64 * 1024 + 4096;
                rt.block_on(pool.resize_volume(&name, new)).unwrap();
                m.resize(new as usize, 0);
                vols.insert(name, m);
            }
            Op::Reopen { clean } => {
                rt.block_on(pool.flush()).unwrap();
                if clean {
                    pool.close().unwrap();
                } else {
                    drop(pool);
                }
                assert_clean(dir.path());
                pool = Pool::open(&pool_path(dir.path())).unwrap();
            }
        }
        for (name, m) in vols.iter().chain(snaps.iter()) {
            verify(&rt, &pool, name, m);
        }
    }
    // Writing to a snapshot is refused.
    if let Some((full, _)) = pick(&snaps, 0) {
        let v = pool.volume(&full).unwrap();
        let e = rt.block_on(write(&v, 0, &[1; 4096], false)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReadOnly);
    }
    // Space: what all volumes and snapshots map, counted once per unit, is what the pool uses.
    rt.block_on(pool.flush()).unwrap();
    drop(pool);
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    for (name, m) in vols.iter().chain(snaps.iter()) {
        verify(&rt, &pool, name, m);
    }
    let infos: Vec<_> = pool.list_volumes().into_iter().chain(pool.list_snapshots(None)).collect();
    let exclusive: u64 = infos.iter().map(|i| i.exclusive).sum();
    assert!(exclusive <= pool.status().used, "exclusive bytes are counted once");
    if infos.is_empty() {
        assert_eq!(pool.status().used, 0, "no volume left, no space used");
    }
    pool.close().unwrap();
    assert_clean(dir.path());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20, max_shrink_iters: 300, ..ProptestConfig::default() })]
    #[test]
    fn snapshots_and_clones_match_model(ops in prop::collection::vec(op(), 1..40)) {
        run(ops);
    }
}

/// Deleting a snapshot frees the space only it held; trims on a volume with a
/// snapshot free nothing until the snapshot goes (scenario 2 of the snapshot issue).
#[test]
fn trim_under_snapshot_then_delete_frees() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &vec![9u8; 8 << 20], false)).unwrap();
    let used = pool.status().used;
    assert_eq!(used, 8 * MIB);
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    rt.block_on(v.trim(0, 16 * MIB, false)).unwrap();
    assert_eq!(pool.volume_info("v").unwrap().allocated, 0, "the volume maps nothing after the trim");
    let s = pool.list_snapshots(Some("v"));
    assert_eq!((s[0].allocated, s[0].exclusive), (8 * MIB, 8 * MIB), "the snapshot alone holds the data");
    rt.block_on(pool.flush()).unwrap();
    assert_eq!(pool.status().used, used, "space held by the snapshot");
    let snap = pool.volume("v@s").unwrap();
    assert!(rt.block_on(read(&snap, 0, 8 * MIB)).iter().all(|&b| b == 9));
    drop(snap);
    rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
    rt.block_on(pool.flush()).unwrap();
    assert_eq!(pool.status().used, 0, "deleting the snapshot frees the space");
}

/// A clone of a clone of a clone reads back correctly after its origin volume and all
/// snapshots are deleted (scenario 5).
#[test]
fn clone_chain_outlives_its_origins() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("o", 4 * MIB)).unwrap();
    let mut expect = vec![0u8; 4 << 20];
    let mut src = "o".to_string();
    for gen in 0..3u8 {
        let v = pool.volume(&src).unwrap();
        let off = gen as u64 * 1_000_003;
        rt.block_on(write(&v, off, &vec![gen + 1; 300_000], false)).unwrap();
        expect[off as usize..off as usize + 300_000].fill(gen + 1);
        rt.block_on(pool.create_snapshot(&src, "s")).unwrap();
        let next = format!("c{gen}");
        rt.block_on(pool.clone_volume(&format!("{src}@s"), &next)).unwrap();
        src = next;
    }
    for name in ["o", "c0", "c1"] {
        rt.block_on(pool.delete_snapshot(name, "s")).unwrap();
        rt.block_on(pool.delete_volume(name)).unwrap();
    }
    let last = pool.volume("c2").unwrap();
    assert_eq!(rt.block_on(read(&last, 0, 4 * MIB)), expect);
    drop(last);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// 1,000 snapshots of one volume with about 1% of it changed between each, then a
/// crash (drop without close) and reopen: every snapshot still reads its own point in
/// time, and check is clean (scenario 4 of the snapshot issue).
#[test]
fn a_thousand_snapshots_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 768 * MIB);
    let size = 16 * MIB;
    rt.block_on(pool.create_volume("v", size)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &vec![0xaa; size as usize], false)).unwrap();
    // Snapshot i changes 160 KiB (1%) at a place that moves with i, stamping i.
    let stamp = |i: u32| -> (u64, Vec<u8>) {
        let off = (u64::from(i) * 163_840 * 7) % (size - 163_840) / 4096 * 4096;
        (off, (0..163_840u32).map(|k| (i.wrapping_mul(31).wrapping_add(k / 4096)) as u8).collect())
    };
    for i in 0..1000u32 {
        let (off, data) = stamp(i);
        rt.block_on(write(&v, off, &data, false)).unwrap();
        rt.block_on(pool.create_snapshot("v", &format!("s{i}"))).unwrap();
    }
    drop(v);
    drop(pool);
    assert_clean(dir.path());
    let t = std::time::Instant::now();
    let pool = storage_engine::Pool::open(&pool_path(dir.path())).unwrap();
    eprintln!("reopened a pool with 1,000 snapshots in {:?}", t.elapsed());
    assert_eq!(pool.list_snapshots(Some("v")).len(), 1000);
    // Each checked snapshot holds its own stamp and the one before it where they do not overlap.
    for i in [0u32, 1, 499, 998, 999] {
        let s = pool.volume(&format!("v@s{i}")).unwrap();
        let (off, data) = stamp(i);
        assert_eq!(rt.block_on(read(&s, off, data.len() as u64)), data, "snapshot s{i}");
    }
    let s0 = pool.volume("v@s0").unwrap();
    let (off0, _) = stamp(0);
    let untouched = if off0 >= MIB { 0 } else { size - MIB };
    assert!(rt.block_on(read(&s0, untouched, 4096)).iter().all(|&b| b == 0xaa));
    drop(s0);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// A full pool with a snapshot present: copy-on-write writes get NoSpace and change
/// nothing, everything acknowledged still reads back, the snapshot delete commits, and
/// after it the same writes succeed in place.
#[test]
fn pool_full_with_snapshot_refuses_copy_on_write_only() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 128 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    let mut units = 0u64;
    while rt.block_on(write(&v, units * 65536, &[units as u8 | 1; 65536], false)).is_ok() {
        units += 1;
    }
    assert!(units > 50, "{units} units fit");
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    // Snapshots of a full pool take metadata room only, which the reserve keeps.
    for i in 0..20 {
        rt.block_on(pool.create_snapshot("v", &format!("more-{i}"))).unwrap();
    }
    let e = rt.block_on(write(&v, 0, &[0xee; 4096], false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let snap = pool.volume("v@s").unwrap();
    for u in [0, units / 2, units - 1] {
        let want = vec![u as u8 | 1; 65536];
        assert_eq!(rt.block_on(read(&v, u * 65536, 65536)), want, "volume unit {u}");
        assert_eq!(rt.block_on(read(&snap, u * 65536, 65536)), want, "snapshot unit {u}");
    }
    drop(snap);
    rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
    for i in 0..20 {
        rt.block_on(pool.delete_snapshot("v", &format!("more-{i}"))).unwrap();
    }
    rt.block_on(write(&v, 0, &[0xee; 4096], false)).unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xee; 4096]);
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

const UNIT: u64 = 16 * 1024;
const PAGE: u64 = 512 * UNIT; // volume bytes one mapping page covers

/// A 128 MiB pool of 16 KiB units whose volume `v` fills it with 0xab, then rounds of a
/// snapshot and a 4 KiB trim in every mapping page (which copies each page, shared
/// with the snapshot) until the metadata runs short: snapshots and trims add metadata
/// without allocating data. Returns the pool, the volume and the bytes filled; asserts
/// that some of it was refused and at least one round done.
fn metadata_filled(dir: &std::path::Path, rt: &tokio::runtime::Runtime) -> (Pool, storage_engine::Volume, u64) {
    let pool = create_with_unit(dir, 128 * MIB, UNIT as u32);
    rt.block_on(pool.create_volume("v", 512 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    let filled = fill(rt, &v, MIB as usize, 0xab);
    assert!(filled > 64 * MIB, "only {filled} bytes fit");
    let (mut rounds_done, mut refused) = (0, 0);
    for round in 1..=24u64 {
        match rt.block_on(pool.create_snapshot("v", &format!("s{round}"))) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NoSpace => {
                refused += 1;
                continue;
            }
            Err(e) => panic!("snapshot {round}: {e}"),
        }
        for page in 0..filled.div_ceil(PAGE) {
            match rt.block_on(v.trim(page * PAGE + round * 4096, 4096, false)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NoSpace => refused += 1,
                Err(e) => panic!("trim in round {round}: {e}"),
            }
        }
        rt.block_on(pool.flush()).unwrap();
        rounds_done += 1;
    }
    assert!(refused > 0, "the metadata never ran short after {rounds_done} rounds: the test shows nothing");
    assert!(rounds_done >= 1, "a snapshot of the full volume was refused from the start");
    (pool, v, filled)
}

/// Snapshots, and trims that copy a mapping page shared with a snapshot, add metadata
/// without allocating data. In a full pool that growth must stop while the next
/// checkpoint still fits beside the last one: before, it went on until the pool closed
/// cleanly and could never be opened again ("no free unit for the checkpoint").
#[test]
fn metadata_growth_in_a_full_pool_leaves_room_for_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v, _) = metadata_filled(dir.path(), &rt);
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
    // The pool opens again (its checkpoint at open fits), and the first snapshot still
    // holds every byte the trims took from the volume.
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    let s1 = pool.volume("v@s1").unwrap();
    assert_eq!(rt.block_on(read(&s1, 2 * 4096, 4096)), vec![0xab; 4096]);
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 4096, 4096)), vec![0; 4096], "the first round's trim was lost");
    drop((s1, v));
    // Deleting snapshots gives the room back.
    for round in 1..=24u64 {
        let _ = rt.block_on(pool.delete_snapshot("v", &format!("s{round}")));
    }
    let v = pool.volume("v").unwrap();
    rt.block_on(v.trim(0, PAGE, false)).unwrap();
    rt.block_on(pool.create_snapshot("v", "again")).unwrap();
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// The same full pool, without a reopen: deleting the snapshots gives the room their
/// metadata held back. (Once, the last checkpoint, which still held them, set what was
/// held back until the next one, so snapshots and clones stayed refused, and `status`
/// showed the same room, until the server restarted.)
#[test]
fn deleting_snapshots_in_a_full_pool_gives_the_metadata_room_back_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v, _) = metadata_filled(dir.path(), &rt);
    // Snapshots add little (a page location per page): take them until one is refused.
    let mut taken = 0;
    let refused = loop {
        match rt.block_on(pool.create_snapshot("v", &format!("x{taken}"))) {
            Ok(_) => taken += 1,
            Err(e) => break e,
        }
        assert!(taken < 1000, "1000 more snapshots fit: the metadata is not short");
    };
    assert_eq!(refused.kind(), ErrorKind::NoSpace, "the metadata is short before the deletes: {refused}");
    for round in 1..=24u64 {
        let _ = rt.block_on(pool.delete_snapshot("v", &format!("s{round}")));
    }
    // A snapshot, a clone of it and a trim that copies a mapping page all fit again.
    rt.block_on(pool.create_snapshot("v", "again")).unwrap();
    rt.block_on(pool.clone_volume("v@again", "c")).unwrap();
    rt.block_on(v.trim(0, PAGE, false)).unwrap();
    assert_eq!(rt.block_on(read(&v, PAGE, 4096)), vec![0xab; 4096]);
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// A new volume cannot take the name of a deleted volume whose snapshots remain (they
/// would look like its own); once they are deleted, the name is free.
#[test]
fn a_name_with_orphan_snapshots_is_not_reused() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 32 * MIB);
    rt.block_on(pool.create_volume("v", MIB)).unwrap();
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    rt.block_on(pool.delete_volume("v")).unwrap();
    let e = rt.block_on(pool.create_volume("v", MIB)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    assert!(e.to_string().contains("v@s"), "{e}");
    assert_eq!(rt.block_on(pool.clone_volume("v@s", "v")).unwrap_err().kind(), ErrorKind::AlreadyExists);
    rt.block_on(pool.clone_volume("v@s", "w")).unwrap();
    rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
    rt.block_on(pool.create_volume("v", MIB)).unwrap();
}
