//! Pool-level behaviour: space accounting and pool full, persistence of volume
//! operations across clean and crash-style reopen, small data units with many mapped
//! units (checkpoints spanning many chunks), heavy logging (checkpoints under log
//! pressure), and refusal of corrupt or foreign pool files without writing to them.

mod common;
use common::*;
use storage_engine::{ErrorKind, Pool, PoolOptions};

fn reopen_crash(pool: Pool, dir: &std::path::Path) -> Pool {
    drop(pool);
    assert_clean(dir);
    Pool::open(&pool_path(dir)).unwrap()
}

#[test]
fn pool_full_refuses_allocating_writes_only() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 16 * MIB);
    rt.block_on(pool.create_volume("big", 1 << 30)).unwrap();
    let v = pool.volume("big").unwrap();
    let mut written = Vec::new();
    let mut off = 0u64;
    let err = loop {
        let data = vec![(off / 65536) as u8 | 1; 65536];
        match rt.block_on(write(&v, off, &data, false)) {
            Ok(()) => written.push(off),
            Err(e) => break e,
        }
        off += 65536;
        assert!(off < 1 << 30, "a 16 MiB pool took 1 GiB of writes");
    };
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    assert!(written.len() > 100, "only {} units fit", written.len());
    let st = pool.status();
    assert!(st.free < 64 * 65536, "pool reports {} bytes free after ENOSPC", st.free);
    // Overwrites of allocated data still work and everything acknowledged reads back.
    rt.block_on(write(&v, written[3] + 4096, &[0xee; 8192], true)).unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    let pool = reopen_crash(pool, dir.path());
    let v = pool.volume("big").unwrap();
    for &o in &written {
        let got = rt.block_on(read(&v, o, 65536));
        let fill = (o / 65536) as u8 | 1;
        if o == written[3] {
            assert_eq!(&got[4096..12288], &[0xee; 8192][..]);
            assert!(got[..4096].iter().chain(&got[12288..]).all(|&b| b == fill));
        } else {
            assert!(got.iter().all(|&b| b == fill), "unit at {o} lost its data");
        }
    }
    // Trimming frees space (after a commit) and writes resume.
    rt.block_on(v.trim(0, 16 * 65536, false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    rt.block_on(write(&v, off, &[7; 65536], false)).unwrap();
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

#[test]
fn small_units_with_many_mappings_checkpoint_and_reopen() {
    for unit in [16 * 1024u32, 32 * 1024] {
        let dir = tempfile::tempdir().unwrap();
        let rt = rt();
        let pool = Pool::create(
            &pool_path(dir.path()),
            &PoolOptions { size: 96 * MIB, unit_size: unit, ..Default::default() },
        )
        .unwrap();
        rt.block_on(pool.create_volume("v", 64 * MIB)).unwrap();
        let v = pool.volume("v").unwrap();
        // Every unit mapped: thousands of refcount entries, several checkpoint chunks.
        let mut off = 0;
        while off < 64 * MIB {
            rt.block_on(write(&v, off, &vec![(off >> 20) as u8 + 1; 1 << 20], false)).unwrap();
            off += 1 << 20;
        }
        rt.block_on(v.flush()).unwrap();
        drop(v);
        pool.close().unwrap();
        assert_clean(dir.path());
        let pool = Pool::open(&pool_path(dir.path())).unwrap();
        let v = pool.volume("v").unwrap();
        for mib in [0u64, 17, 63] {
            assert!(
                rt.block_on(read(&v, mib << 20, 1 << 20)).iter().all(|&b| b == mib as u8 + 1),
                "unit {unit}: MiB {mib}"
            );
        }
        assert_eq!(pool.volume_info("v").unwrap().allocated, 64 * MIB);
    }
}

#[test]
fn heavy_logging_forces_checkpoints_and_survives_crash() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 32 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    // Far more records than half the 4 MiB log: 4 KiB writes and trims in turn.
    for round in 0..12u64 {
        for blk in 0..(32 * MIB / 65536) {
            let o = blk * 65536 + (round % 16) * 4096;
            rt.block_on(write(&v, o, &[round as u8 + 1; 4096], false)).unwrap();
        }
        rt.block_on(v.trim((round % 4) * 8 * MIB, 4 * MIB, false)).unwrap();
    }
    rt.block_on(v.flush()).unwrap();
    let expect = rt.block_on(read(&v, 0, 32 * MIB));
    drop(v);
    let pool = reopen_crash(pool, dir.path());
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 32 * MIB)), expect);
}

#[test]
fn volume_operations_persist_and_validate() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 32 * MIB);
    rt.block_on(pool.create_volume("a", 8 * MIB)).unwrap();
    rt.block_on(pool.create_volume("b", 8 * MIB)).unwrap();
    let kind = |r: storage_engine::Result<storage_engine::VolumeInfo>| r.unwrap_err().kind();
    assert_eq!(kind(rt.block_on(pool.create_volume("a", 4096))), ErrorKind::AlreadyExists);
    assert_eq!(kind(rt.block_on(pool.create_volume("../x", 4096))), ErrorKind::InvalidArgument);
    assert_eq!(kind(rt.block_on(pool.create_volume("c", 4095))), ErrorKind::InvalidArgument);
    assert_eq!(kind(rt.block_on(pool.resize_volume("a", 4 * MIB))), ErrorKind::InvalidArgument);
    let va = pool.volume("a").unwrap();
    rt.block_on(write(&va, 0, &[1; 65536], false)).unwrap();
    let vb = pool.volume("b").unwrap();
    rt.block_on(write(&vb, 0, &[2; 65536], false)).unwrap();
    rt.block_on(pool.resize_volume("a", 16 * MIB)).unwrap();
    assert_eq!(va.size(), 16 * MIB, "an open handle sees the new size");
    rt.block_on(write(&va, 12 * MIB, &[3; 4096], false)).unwrap();
    rt.block_on(pool.delete_volume("b")).unwrap();
    assert_eq!(rt.block_on(vb.read(0, 4096)).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(rt.block_on(vb.flush()).unwrap_err().kind(), ErrorKind::NotFound, "a flush of a deleted volume");
    let used = pool.status().used;
    assert_eq!(used, 2 * 65536, "b's unit was freed");
    drop((va, vb));
    let pool = reopen_crash(pool, dir.path());
    let names: Vec<_> = pool.list_volumes().into_iter().map(|v| (v.name, v.size)).collect();
    assert_eq!(names, vec![("a".to_string(), 16 * MIB)]);
    let va = pool.volume("a").unwrap();
    assert!(rt.block_on(read(&va, 12 * MIB, 4096)).iter().all(|&b| b == 3));
    assert!(rt.block_on(read(&va, 4 * MIB, 4096)).iter().all(|&b| b == 0));
}

#[test]
fn labels_set_after_creation_persist_and_bad_ones_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 32 * MIB);
    let labels: storage_engine::Labels = [("app".to_string(), "pg".to_string())].into();
    rt.block_on(pool.create_volume_with("a", 8 * MIB, &labels)).unwrap();
    let snap_labels: storage_engine::Labels = [("taken".to_string(), "monday".to_string())].into();
    rt.block_on(pool.create_snapshot_with("a", "s", &snap_labels)).unwrap();
    let after = rt.block_on(pool.set_label("a", "tier", Some("gold"))).unwrap();
    assert_eq!(after.get("tier").map(String::as_str), Some("gold"));
    assert_eq!(rt.block_on(pool.set_label("a", "tier", Some("gold"))).unwrap(), after, "idempotent");
    rt.block_on(pool.set_label("a", "app", None)).unwrap();
    let kind = |r: storage_engine::Result<storage_engine::Labels>| r.unwrap_err().kind();
    assert_eq!(kind(rt.block_on(pool.set_label("a", "-bad", Some("x")))), ErrorKind::InvalidArgument);
    assert_eq!(kind(rt.block_on(pool.set_label("a", "k", Some("v\n")))), ErrorKind::InvalidArgument);
    assert_eq!(kind(rt.block_on(pool.set_label("a@s", "k", Some("v")))), ErrorKind::NotFound, "a snapshot");
    assert_eq!(kind(rt.block_on(pool.set_label("nope", "k", Some("v")))), ErrorKind::NotFound);
    for i in 0..15 {
        rt.block_on(pool.set_label("a", &format!("k{i}"), Some("v"))).unwrap();
    }
    assert_eq!(kind(rt.block_on(pool.set_label("a", "k15", Some("v")))), ErrorKind::InvalidArgument, "a 17th");
    let want: storage_engine::Labels =
        (0..15).map(|i| (format!("k{i}"), "v".to_string())).chain([("tier".to_string(), "gold".to_string())]).collect();
    assert_eq!(pool.volume_info("a").unwrap().labels, want);
    assert_eq!(pool.volume_info("a@s").unwrap().labels, snap_labels, "the snapshot keeps its own");
    // Replayed from the log after a crash, then kept by the checkpoint of a clean close.
    let pool = reopen_crash(pool, dir.path());
    assert_eq!(pool.volume_info("a").unwrap().labels, want);
    pool.close().unwrap();
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    assert_eq!(pool.volume_info("a").unwrap().labels, want);
    assert_eq!(pool.volume_info("a@s").unwrap().labels, snap_labels);
}

/// Bytes of the host file system the pool file holds (st_blocks).
fn host_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(pool_path(dir)).unwrap().blocks() * 512
}

/// [`host_bytes`] once the pool has no frees waiting for their punch (its thread
/// punches them after the commit), within 10 s.
fn host_bytes_settled(pool: &Pool, dir: &std::path::Path) -> u64 {
    let t = std::time::Instant::now();
    while pool.status().freeing > 0 && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(pool.status().freeing, 0, "frees still waiting after 10 s");
    host_bytes(dir)
}

/// Free units that hold blocks of the pool file when it opens (a crash or a close came
/// between their free and their punch; here written into by hand, as such a unit
/// holds what it held) go back to the host file system after the open, and the pool
/// holds what it held. A pool opened preallocated keeps them.
#[test]
fn free_units_left_holding_blocks_go_back_to_the_host_at_open() {
    use std::os::unix::fs::FileExt;
    let rt = rt();
    for preallocate in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = pool_path(dir.path());
        let opts = PoolOptions { size: 64 * MIB, preallocate, ..Default::default() };
        let pool = Pool::create(&path, &opts).unwrap();
        rt.block_on(pool.create_volume("a", 16 * MIB)).unwrap();
        let a = pool.volume("a").unwrap();
        rt.block_on(write(&a, 0, &vec![0xa1; 4 << 20], false)).unwrap();
        drop(a);
        pool.close().unwrap();
        // 16 MiB of free units near the end of the pool, given blocks.
        let size = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&vec![0x5a; 16 << 20], size - (20 << 20)).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let before = host_bytes(dir.path());
        // Preallocation is a property of the run (the open's options), not of the pool.
        let pool = Pool::open_or_create(&path, &opts).unwrap();
        let after = host_bytes_settled(&pool, dir.path());
        if preallocate {
            assert_eq!(after, before, "a preallocated pool punched holes");
        } else {
            let given = before.saturating_sub(after);
            assert!(given >= 15 * MIB, "16 MiB of free units holding blocks gave back {given} bytes");
        }
        let a = pool.volume("a").unwrap();
        assert!(rt.block_on(read(&a, 0, 4 << 20)).iter().all(|&x| x == 0xa1));
        drop(a);
        pool.close().unwrap();
        let r = storage_engine::check(&path).unwrap();
        assert!(r.problems.is_empty(), "{r:?}");
    }
}

/// A pool closed or dropped while its thread punches freed units punches nothing
/// after: the pool file's blocks do not change once the close or drop returned. (A
/// power-loss test writes each cut's image over the last one's file: a batch punched
/// on after the drop zeroed units of the next image.) Each round opens a pool whose
/// free units hold 1,024 separate ranges of blocks, so that the open starts punching
/// batch after batch, and ends it at once.
#[test]
fn a_pool_closed_or_dropped_while_punching_punches_nothing_after() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let opts = PoolOptions { size: 64 * MIB, unit_size: 16 * 1024, ..Default::default() };
    Pool::create(&path, &opts).unwrap().close().unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    let (from, span) = (size - 40 * MIB, 32 * MIB);
    let blocks = || std::fs::metadata(&path).unwrap().blocks();
    for round in 0..6 {
        // 4 KiB every 32 KiB: every other 16 KiB unit holds blocks, each a range of its own.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        for at in (from..from + span).step_by(32 * 1024) {
            f.write_all_at(&[0x5a; 4096], at).unwrap();
        }
        drop(f);
        let pool = Pool::open(&path).unwrap();
        if round % 2 == 0 {
            drop(pool);
        } else {
            pool.close().unwrap();
        }
        let ended = blocks();
        // Time for a punch that outlived the pool to land.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let later = blocks();
        assert_eq!(later, ended, "round {round}: the pool file lost blocks after the pool's end");
    }
}

/// A pool file gives the units it frees back to the host file system (hole punching),
/// once their frees are durable: a deleted volume's and trimmed units'. Units taken
/// again afterwards hold what is written to them; a preallocated pool keeps its blocks.
#[test]
fn freed_units_go_back_to_the_host_file_system() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("a", 16 * MIB)).unwrap();
    rt.block_on(pool.create_volume("b", 16 * MIB)).unwrap();
    let (a, b) = (pool.volume("a").unwrap(), pool.volume("b").unwrap());
    rt.block_on(write(&a, 0, &vec![0xa1; 8 << 20], false)).unwrap();
    rt.block_on(write(&b, 0, &vec![0xb1; 4 << 20], false)).unwrap();
    rt.block_on(pool.flush()).unwrap();
    let full = host_bytes(dir.path());
    drop(a);
    rt.block_on(pool.delete_volume("a")).unwrap();
    rt.block_on(pool.flush()).unwrap();
    let after_delete = host_bytes_settled(&pool, dir.path());
    // The metadata written in between takes a few blocks: a margin of 1 MiB.
    let given = full.saturating_sub(after_delete);
    assert!(given >= 7 * MIB, "deleting 8 MiB gave back {given} bytes");
    // A trim of whole units gives them back too.
    rt.block_on(b.trim(MIB, 2 * MIB, false)).unwrap();
    rt.block_on(pool.flush()).unwrap();
    let after_trim = host_bytes_settled(&pool, dir.path());
    let given = after_delete.saturating_sub(after_trim);
    assert!(given + MIB / 2 >= 2 * MIB, "trimming 2 MiB gave back {given} bytes");
    // The units are taken again and hold the new data; b is intact.
    rt.block_on(pool.create_volume("c", 16 * MIB)).unwrap();
    let c = pool.volume("c").unwrap();
    rt.block_on(write(&c, 0, &vec![0xc1; 10 << 20], false)).unwrap();
    rt.block_on(pool.flush()).unwrap();
    assert!(rt.block_on(read(&c, 0, 10 << 20)).iter().all(|&x| x == 0xc1));
    let bb = rt.block_on(read(&b, 0, 4 << 20));
    assert!(bb[..1 << 20].iter().chain(&bb[3 << 20..]).all(|&x| x == 0xb1));
    assert!(bb[1 << 20..3 << 20].iter().all(|&x| x == 0), "the trimmed range reads as zeros");
    drop((b, c));
    let pool = reopen_crash(pool, dir.path());
    let c = pool.volume("c").unwrap();
    assert!(rt.block_on(read(&c, 0, 10 << 20)).iter().all(|&x| x == 0xc1));
    drop(c);
    pool.close().unwrap();

    // Preallocated: every block stays with the pool.
    let dir = tempfile::tempdir().unwrap();
    let opts = PoolOptions { size: 64 * MIB, preallocate: true, ..Default::default() };
    let pool = Pool::create(&pool_path(dir.path()), &opts).unwrap();
    rt.block_on(pool.create_volume("a", 16 * MIB)).unwrap();
    let a = pool.volume("a").unwrap();
    rt.block_on(write(&a, 0, &vec![0xa1; 8 << 20], false)).unwrap();
    drop(a);
    let before = host_bytes(dir.path());
    rt.block_on(pool.delete_volume("a")).unwrap();
    rt.block_on(pool.flush()).unwrap();
    assert_eq!(host_bytes_settled(&pool, dir.path()), before, "a preallocated pool punched holes");
}

fn sha(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn corrupt_and_foreign_files_are_refused_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 16 * MIB);
    rt.block_on(pool.create_volume("a", MIB)).unwrap();
    pool.close().unwrap();
    let p = pool_path(dir.path());
    // Flip a byte inside both superblock slots.
    let mut img = std::fs::read(&p).unwrap();
    img[100] ^= 0xff;
    img[4096 + 100] ^= 0xff;
    std::fs::write(&p, &img).unwrap();
    let before = sha(&p);
    let e = Pool::open(&p).err().expect("a corrupt pool must not open");
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(e.to_string().contains("superblock checksum"), "{e}");
    assert!(storage_engine::check(&p).is_err());
    assert_eq!(sha(&p), before, "nothing may be written to a refused pool");
    // A foreign file.
    let f = dir.path().join("foreign.img");
    std::fs::write(&f, vec![0x42u8; 4 * MIB as usize]).unwrap();
    let e = Pool::open(&f).err().expect("a foreign file must not open");
    assert!(e.to_string().contains("not a ferrovol pool"), "{e}");
    assert_eq!(std::fs::read(&f).unwrap(), vec![0x42u8; 4 * MIB as usize]);
    // A newer format version is named as such.
    let mut img = before.clone();
    for slot in [0usize, 4096] {
        img[slot + 8] = 9; // version field (little endian)
    }
    std::fs::write(&p, &img).unwrap();
    let e = Pool::open(&p).err().unwrap();
    assert!(e.to_string().contains("version 9 is not supported"), "{e}");
}

#[test]
fn a_second_open_of_a_pool_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = create(dir.path(), 16 * MIB);
    let e = Pool::open(&pool_path(dir.path())).err().unwrap();
    assert!(e.to_string().contains("in use"), "{e}");
    assert!(storage_engine::check(&pool_path(dir.path())).is_err(), "check refuses a pool in use");
    drop(pool);
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Recovery reads the checkpoint and the log, never anything in proportion to the
/// pool's size: after the same workload and a crash, a 4 TiB pool and a 4 GiB one read
/// exactly as many bytes and replay as many log batches when they open, and a longer
/// log reads more. The large pool's per-unit tables (refcounts, settling counts, pins:
/// 256 MiB each for its 64 Mi units) stay non-resident where units are unused, so the
/// whole process stays under 128 MiB.
#[test]
fn recovery_follows_the_log_not_the_pool_size() {
    let rt = rt();
    let run = |size: u64, flushes: u64| {
        let dir = tempfile::tempdir().unwrap();
        let pool = create(dir.path(), size);
        rt.block_on(pool.create_volume("v", 64 * MIB)).unwrap();
        let v = pool.volume("v").unwrap();
        for f in 0..flushes {
            for unit in 0..64 {
                rt.block_on(write(&v, unit * 65536 + (f % 16) * 4096, &[f as u8 + 1; 4096], false)).unwrap();
            }
            rt.block_on(v.flush()).unwrap();
        }
        drop(v);
        let pool = reopen_crash(pool, dir.path()); // no final checkpoint: the log is replayed
        (pool.recovery(), rss_kib())
    };
    let (small, _) = run(4 << 30, 4);
    let (large, rss) = run(4 << 40, 4);
    assert!(small.batches_replayed >= 4, "{small:?}");
    assert_eq!(small, large, "the same log recovered from a 4 GiB and a 4 TiB pool");
    assert!(rss < 128 << 10, "{} MiB resident with a 4 TiB pool open", rss >> 10);
    let (longer, _) = run(4 << 30, 16);
    assert!(
        longer.batches_replayed > small.batches_replayed && longer.bytes_read > small.bytes_read,
        "a longer log: {longer:?} against {small:?}"
    );
}

#[test]
fn recycled_buffers_never_leak_another_volumes_bytes() {
    // Read and write buffers are reused after their request ends (io/buf.rs, the buffer cache)
    // without being zeroed. Whatever an earlier request left in them must never come
    // out: unwritten blocks read as zeros, and the rest of a partly written block is
    // its old content (zeros here), not the previous request's bytes.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("a", 8 * MIB)).unwrap();
    rt.block_on(pool.create_volume("b", 8 * MIB)).unwrap();
    let (a, b) = (pool.volume("a").unwrap(), pool.volume("b").unwrap());
    for len in [4096usize, 65536, 1 << 20] {
        // Fill buffers of this size with a's secret, on writes and reads alike.
        for _ in 0..4 {
            rt.block_on(write(&a, 0, &vec![0x5e; len], false)).unwrap();
            assert!(rt.block_on(read(&a, 0, len as u64)).iter().all(|&x| x == 0x5e));
        }
        // An unwritten range of b, then one with a few bytes written in its middle.
        let got = rt.block_on(read(&b, 2 * MIB, len as u64));
        assert!(got.iter().all(|&x| x == 0), "unwritten {len}-byte read of b shows stale bytes");
        let mid = 2 * MIB + len as u64 / 2 + 100;
        rt.block_on(write(&b, mid, &[1; 10], false)).unwrap();
        let got = rt.block_on(read(&b, 2 * MIB, len as u64));
        let at = (mid - 2 * MIB) as usize;
        assert_eq!(&got[at..at + 10], &[1; 10]);
        assert!(
            got[..at].iter().chain(&got[at + 10..]).all(|&x| x == 0),
            "{len}-byte read of b around a small write shows stale bytes"
        );
        rt.block_on(b.trim(2 * MIB, 2 * MIB, false)).unwrap();
    }
}

#[test]
fn a_too_small_pool_is_refused_with_the_smallest_size_that_works() {
    // The error names the minimum in bytes; a pool of exactly that size is created,
    // and one data unit less is refused again. Nothing is left behind by a refusal.
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let opts = |size| PoolOptions { size, ..Default::default() };
    let e = Pool::create(&path, &opts(MIB)).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let msg = e.to_string();
    let min: u64 = msg
        .split("at least ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no minimum size in bytes in: {msg}"));
    assert!(!path.exists(), "a refused create left a file");
    let unit = u64::from(PoolOptions::default().unit_size);
    let e = Pool::create(&path, &opts(min - unit)).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    Pool::create(&path, &opts(min)).unwrap().close().unwrap();
}

#[test]
fn a_create_cut_short_leaves_no_pool_file_and_its_leftover_is_reused() {
    // A create formats `<path>.creating` and renames it only once durable: the leftover
    // of a create that was killed (here: junk in that file) is no pool, no file sits at
    // the pool's path, and the next create takes the leftover over and removes it.
    let dir = tempfile::tempdir().unwrap();
    let p = pool_path(dir.path());
    let leftover = dir.path().join("pool.img.creating");
    std::fs::write(&leftover, vec![0x5au8; 3 * MIB as usize]).unwrap();
    assert!(!p.exists());
    let pool = create(dir.path(), 16 * MIB);
    assert!(!leftover.exists(), "the leftover was not taken over");
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 16 * MIB);
    let rt = rt();
    rt.block_on(pool.create_volume("a", MIB)).unwrap();
    pool.close().unwrap();
    assert!(storage_engine::check(&p).unwrap().problems.is_empty());
}

/// A damaged log batch of an acknowledged commit ends the replay there, and the commits
/// behind it cannot be replayed. Each batch says where its commit began (format version
/// 3), so a valid batch of a later commit behind the damage proves it: `check` and open
/// refuse the pool, naming the batches, and write nothing. A pool of version 2, whose
/// batches do not say it, opens with a warning instead (the same picture may be a torn
/// commit). A crash alone reports nothing.
#[test]
fn a_damaged_log_batch_before_later_commits_is_refused() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    for (i, off) in [0, MIB, 2 * MIB].into_iter().enumerate() {
        rt.block_on(write(&v, off, &[0x11 * (i as u8 + 1); 65536], false)).unwrap();
        rt.block_on(v.flush()).unwrap(); // one commit, one log batch
    }
    drop(v);
    drop(pool); // a crash: the three commits are in the log only
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty() && r.warnings.is_empty(), "after a crash: {r:?}");

    // The log batches of this pool, by sequence number: the last three are the writes'.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut batches = Vec::new();
    let mut block = [0u8; 4096];
    for at in (0..64 * MIB).step_by(4096) {
        f.read_exact_at(&mut block, at).unwrap();
        if u32::from_le_bytes(block[0..4].try_into().unwrap()) == storage_engine::format::LOG_MAGIC {
            batches.push((u64::from_le_bytes(block[8..16].try_into().unwrap()), at));
        }
    }
    batches.sort();
    assert!(batches.len() >= 3, "log batches found: {batches:?}");
    let (seq, second) = batches[batches.len() - 2];
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, second + 40).unwrap();
    f.write_all_at(&[b[0] ^ 1], second + 40).unwrap();
    let before = std::fs::read(&path).unwrap();

    let e = storage_engine::check(&path).expect_err("check passed a log with a commit behind a damaged batch");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let named = format!("log batch {seq} is damaged or missing, but the commit that begins at batch {}", seq + 1);
    assert!(e.to_string().contains(&named), "{e}");
    let e = Pool::open(&path).err().expect("a pool whose log lost an acknowledged commit opened");
    assert!(e.to_string().contains(&named), "{e}");
    assert!(e.to_string().contains("--accept-log-loss"), "the way out is not named: {e}");
    assert!(std::fs::read(&path).unwrap() == before, "the refused pool was written to");

    // Accepting the loss opens a copy with the state before the damaged batch: the
    // first write's mapping is kept, the later two read as never written. The copy is
    // then clean, and opens again with nothing to accept.
    let copy = dir.path().join("copy.img");
    std::fs::copy(&path, &copy).unwrap();
    let opts = PoolOptions { accept_log_loss: true, ..Default::default() };
    let pool = Pool::open_or_create(&copy, &opts).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0x11; 4096]);
    assert_eq!(rt.block_on(read(&v, MIB, 4096)), vec![0; 4096], "a dropped commit's mapping survived");
    assert_eq!(rt.block_on(read(&v, 2 * MIB, 4096)), vec![0; 4096], "a dropped commit's mapping survived");
    drop(v);
    pool.close().unwrap();
    let r = storage_engine::check(&copy).unwrap();
    assert!(r.problems.is_empty() && r.warnings.is_empty(), "{r:?}");
    Pool::open(&copy).unwrap().close().unwrap();

    // The same log under a version 2 superblock: reported, and the pool opens.
    set_version(&f, 2);
    drop(f);
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    assert!(
        r.warnings.iter().any(|w| w.contains("1 valid batch(es) with later sequence numbers")),
        "the commit behind the damaged batch is not reported: {r:?}"
    );
    let pool = Pool::open(&path).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0x11; 4096], "the commit before the damage is kept");
}

/// A volume record damaged with its checksum recomputed (here: a size that is not a
/// multiple of 4096) passes every checksum; `check` names it, and open refuses the pool
/// with the same words instead of serving it and keeping the damage.
#[test]
fn a_volume_record_damaged_under_a_valid_checksum_is_refused_at_open() {
    use std::os::unix::fs::FileExt;
    use storage_engine::format::{crc, ChunkHeader, Superblock, SUPERBLOCK_OFFSETS};
    use zerocopy::{FromBytes, IntoBytes};
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("corruptme", 16 * MIB)).unwrap();
    let v = pool.volume("corruptme").unwrap();
    rt.block_on(write(&v, 0, &[7; 4096], false)).unwrap();
    drop(v);
    rt.block_on(pool.checkpoint()).unwrap(); // everything in the checkpoint, the log empty
    pool.close().unwrap();

    let path = pool_path(dir.path());
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut slot = [0u8; 256];
    let sb = SUPERBLOCK_OFFSETS
        .iter()
        .map(|&at| {
            f.read_exact_at(&mut slot, at).unwrap();
            Superblock::read_from_prefix(&slot).unwrap().0
        })
        .max_by_key(|sb| sb.generation.get())
        .unwrap();
    let chunk_at = sb.data_offset.get() + sb.checkpoint_unit.get() * u64::from(sb.unit_size.get());
    let mut chunk = vec![0u8; sb.unit_size.get() as usize];
    f.read_exact_at(&mut chunk, chunk_at).unwrap();
    let (mut h, _) = ChunkHeader::read_from_prefix(&chunk).unwrap();
    let hl = size_of::<ChunkHeader>();
    let plen = h.payload_len.get() as usize;
    let name = chunk[hl..hl + plen].windows(9).position(|w| w == b"corruptme").expect("the volume record") + hl;
    // The record's VolumeRec (24 bytes) ends where the name starts; its size is at 8.
    let size_at = name - 24 + 8;
    chunk[size_at..size_at + 8].copy_from_slice(&(16 * MIB + 1).to_le_bytes());
    h.crc = 0.into();
    let sum = crc32c::crc32c_append(crc(h.as_bytes()), &chunk[hl..hl + plen]);
    chunk[4..8].copy_from_slice(&sum.to_le_bytes());
    f.write_all_at(&chunk, chunk_at).unwrap();
    drop(f);
    let before = std::fs::read(&path).unwrap();

    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.iter().any(|p| p.contains("'corruptme' has an invalid size 16777217")), "{r:?}");
    let e = Pool::open(&path).err().expect("a pool with a damaged volume record opened");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("'corruptme' has an invalid size 16777217"), "{e}");
    assert!(std::fs::read(&path).unwrap() == before, "the refused pool was written to");
}

/// The superblock slot at `at` of the pool file `f`.
fn slot(f: &std::fs::File, at: u64) -> storage_engine::format::Superblock {
    use std::os::unix::fs::FileExt;
    use zerocopy::FromBytes;
    let mut b = [0u8; 256];
    f.read_exact_at(&mut b, at).unwrap();
    storage_engine::format::Superblock::read_from_prefix(&b).unwrap().0
}

/// Flips a bit of the `unit_size` of the superblock slot at byte `at` (its checksum
/// fails; its generation field still reads).
fn damage_slot(path: &std::path::Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at + 40).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], at + 40).unwrap();
}

/// Sets the format version of both superblock slots of the pool file `f`.
fn set_version(f: &std::fs::File, version: u32) {
    edit_slots(f, |sb| sb.version = version.into());
}

/// Changes both superblock slots of the pool file `f` with `edit`, checksums kept valid.
fn edit_slots(f: &std::fs::File, edit: impl Fn(&mut storage_engine::format::Superblock)) {
    use std::os::unix::fs::FileExt;
    use zerocopy::IntoBytes;
    for at in storage_engine::format::SUPERBLOCK_OFFSETS {
        let mut sb = slot(f, at);
        edit(&mut sb);
        sb.crc = sb.compute_crc().into();
        f.write_all_at(sb.as_bytes(), at).unwrap();
    }
}

/// Feature bits this build does not know are honoured by kind (docs/on-disk-format.md
/// section 8): an incompatible one refuses the pool, to `check` too; a
/// read-only-compatible one lets `check` read it (with a warning) but refuses the
/// open, which writes; a compatible one is ignored and kept. A refused pool is left
/// unchanged, and a pool of a newer version is named as written by a newer build.
#[test]
fn unknown_feature_bits_are_honoured_by_kind() {
    use storage_engine::format::SUPERBLOCK_OFFSETS;
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 4 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x3c; 8192], false)).unwrap();
    drop(v);
    pool.close().unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let clean = sha(&path);

    edit_slots(&f, |sb| sb.incompat_features = (1u64 << 7).into());
    let before = sha(&path);
    let e = Pool::open(&path).err().expect("an unknown incompatible feature refuses the pool");
    assert!(e.to_string().contains("incompatible features 0x80 this build does not know"), "{e}");
    let e = storage_engine::check(&path).expect_err("check refuses it too");
    assert!(e.to_string().contains("incompatible features 0x80"), "{e}");
    assert_eq!(sha(&path), before, "nothing is written to a refused pool");

    std::fs::write(&path, &clean).unwrap();
    edit_slots(&f, |sb| sb.ro_compat_features = (1u64 << 40).into());
    let before = sha(&path);
    let e = Pool::open(&path).err().expect("an unknown read-only-compatible feature refuses the open");
    assert!(e.to_string().contains("read-only-compatible features 0x10000000000"), "{e}");
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
    assert!(r.warnings.iter().any(|w| w.contains("read-only-compatible features 0x10000000000")), "{r:?}");
    assert_eq!(sha(&path), before, "nothing is written to a refused pool");

    std::fs::write(&path, &clean).unwrap();
    edit_slots(&f, |sb| sb.compat_features = (1u64 << 2).into());
    let pool = Pool::open(&path).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 8192)), vec![0x3c; 8192]);
    drop(v);
    pool.close().unwrap();
    for at in SUPERBLOCK_OFFSETS {
        assert_eq!(slot(&f, at).compat_features.get(), 1 << 2, "the compatible bit is kept (slot at byte {at})");
    }
    assert_clean(dir.path());

    edit_slots(&f, |sb| sb.version = 6.into());
    let e = Pool::open(&path).err().unwrap();
    assert!(e.to_string().contains("version 6 is not supported"), "{e}");
    assert!(e.to_string().contains("written by a newer ferrovol"), "{e}");

    // A newer build's slot beside one of this build's (that build wrote one slot of
    // two so far) is not damage: no rollback over it, even when rollbacks are accepted.
    std::fs::write(&path, &clean).unwrap();
    let newer = *SUPERBLOCK_OFFSETS.iter().max_by_key(|&&at| slot(&f, at).generation.get()).unwrap();
    for (what, edit) in [
        (
            "an unknown incompatible feature",
            &(|sb: &mut storage_engine::format::Superblock| sb.incompat_features = (1u64 << 5).into())
                as &dyn Fn(&mut storage_engine::format::Superblock),
        ),
        ("a newer version", &|sb: &mut storage_engine::format::Superblock| sb.version = 6.into()),
    ] {
        std::fs::write(&path, &clean).unwrap();
        {
            use std::os::unix::fs::FileExt;
            use zerocopy::IntoBytes;
            let mut sb = slot(&f, newer);
            edit(&mut sb);
            sb.crc = sb.compute_crc().into();
            f.write_all_at(sb.as_bytes(), newer).unwrap();
        }
        let before = sha(&path);
        let opts = PoolOptions { accept_superblock_rollback: true, ..Default::default() };
        let e = Pool::open_or_create(&path, &opts).err().unwrap_or_else(|| panic!("rolled back over {what}"));
        assert!(e.to_string().contains("written by a newer ferrovol"), "{what}: {e}");
        assert_eq!(sha(&path), before, "{what}: nothing is written");
    }
}

/// The open that upgrades an older pool writes both superblock slots in the new
/// format before it serves: a crash right after it must not leave a slot of the old
/// version, which an older build would open from (as a rollback) and whose log it
/// would misread.
#[test]
fn an_upgrading_open_leaves_no_slot_of_the_old_version() {
    use storage_engine::format::{FORMAT_VERSION, SUPERBLOCK_OFFSETS};
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 4 * MIB)).unwrap();
    pool.close().unwrap();
    // Made a version 2 pool (its log is empty, so nothing else differs).
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    set_version(&f, 2);
    let pool = Pool::open(&path).unwrap();
    drop(pool); // a crash right after the open
    for at in SUPERBLOCK_OFFSETS {
        assert_eq!(slot(&f, at).version.get(), FORMAT_VERSION, "the slot at byte {at} after an upgrading open");
    }
    let r = storage_engine::check(&path).unwrap();
    assert!(r.problems.is_empty() && r.warnings.is_empty(), "{r:?}");
}

/// A pool of format version 3 records no written flag: on open its volumes that map
/// a unit count as written and the others as pristine (docs/on-disk-format.md 8). A
/// volume wholly trimmed since its write shows the difference: this build keeps it
/// written, the older format cannot tell it from one never written.
#[test]
fn an_older_pool_counts_its_volumes_written_by_their_mappings() {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    for name in ["empty", "data", "trimmed"] {
        rt.block_on(pool.create_volume(name, 4 * MIB)).unwrap();
    }
    for name in ["data", "trimmed"] {
        let v = pool.volume(name).unwrap();
        rt.block_on(write(&v, 0, &[0x5a; 65536], false)).unwrap();
    }
    let t = pool.volume("trimmed").unwrap();
    rt.block_on(t.trim(0, 65536, false)).unwrap();
    assert_eq!(pool.volume_info("trimmed").unwrap().allocated, 0, "the trim unmapped the unit");
    assert!(!t.is_pristine(), "written, then trimmed: not pristine in this format");
    drop(t);
    rt.block_on(pool.checkpoint()).unwrap(); // the volumes in the checkpoint, the log empty
    pool.close().unwrap();
    let pristine = |pool: &Pool| ["empty", "data", "trimmed"].map(|n| pool.volume_info(n).unwrap().pristine);
    let pool = Pool::open(&path).unwrap();
    assert_eq!(pristine(&pool), [true, false, false], "version 4 keeps the flag");
    pool.close().unwrap();

    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    set_version(&f, 3);
    let pool = Pool::open(&path).unwrap();
    assert_eq!(pristine(&pool), [true, false, true], "version 3: written means mapping a unit");
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// Every checkpoint writes the superblock into both slots (ditto copies, the slot of
/// its generation first): a damaged slot loses nothing, the open reads the other, which
/// holds the same generation, replays the log after it and writes both slots again.
#[test]
fn a_damaged_superblock_slot_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0xaa; 65536], false)).unwrap();
    drop(v);
    rt.block_on(pool.checkpoint()).unwrap(); // v and its write in the checkpoint
    rt.block_on(pool.create_volume("w", MIB)).unwrap(); // two commits, in the log only
    rt.block_on(pool.resize_volume("v", 32 * MIB)).unwrap();
    drop(pool); // a crash
    for damaged in storage_engine::format::SUPERBLOCK_OFFSETS {
        let copy = tempfile::tempdir().unwrap();
        let copy_path = pool_path(copy.path());
        std::fs::copy(&path, &copy_path).unwrap();
        damage_slot(&copy_path, damaged);
        let r = storage_engine::check(&copy_path).unwrap();
        assert!(r.problems.is_empty(), "{r:?}");
        assert!(
            r.warnings.iter().any(|w| w.contains("is damaged") && w.contains("its copy in slot")),
            "slot at byte {damaged}: {r:?}"
        );
        let pool = Pool::open(&copy_path).expect("the pool with one damaged slot");
        assert_eq!(pool.names(), vec!["v".to_string(), "w".to_string()], "slot at byte {damaged}");
        let v = pool.volume("v").unwrap();
        assert_eq!(v.size(), 32 * MIB);
        assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xaa; 4096]);
        drop(v);
        pool.close().unwrap();
        // The open wrote both slots again: nothing left to warn about.
        let r = storage_engine::check(&copy_path).unwrap();
        assert!(r.problems.is_empty() && r.warnings.is_empty(), "slot at byte {damaged} after the open: {r:?}");
        assert_clean(copy.path());
    }
}

/// A checkpoint taken between commits (by the committer when the log fills, or asked
/// for) absorbs the records pending at that moment without logging them. The log after
/// it must not continue the sequence of the log before it: an open that goes back to
/// the older checkpoint (here the second superblock write of the newer one was lost
/// by the disk and the first is damaged, two faults) would otherwise replay on into
/// the later commits without the absorbed records, a state that never existed.
#[test]
fn an_open_from_the_older_checkpoint_stops_at_the_newer_one() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0xaa; 65536], false)).unwrap();
    rt.block_on(v.flush()).unwrap(); // in the log after the open's checkpoint
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let at = storage_engine::format::SUPERBLOCK_OFFSETS;
    let gen = slot(&f, at[0]).generation.get();
    let mut older = vec![0u8; 4096];
    f.read_exact_at(&mut older, at[0]).unwrap();
    rt.block_on(pool.checkpoint()).unwrap(); // both slots; the log continues after it
    rt.block_on(pool.create_volume("w", MIB)).unwrap(); // a commit, no data unit
    drop(v);
    drop(pool); // a crash
                // The newer generation's slot is written first: the other one lost its write.
    let (first, second) = if (gen + 1).is_multiple_of(2) { (at[0], at[1]) } else { (at[1], at[0]) };
    f.write_all_at(&older, second).unwrap();
    damage_slot(&path, first);

    let e = Pool::open(&path).err().expect("an open over commits it cannot replay");
    assert!(e.to_string().contains("--accept-superblock-rollback"), "{e}");
    let opts = PoolOptions { accept_superblock_rollback: true, ..Default::default() };
    let pool = Pool::open_or_create(&path, &opts).expect("the rollback");
    assert_eq!(pool.names(), vec!["v".to_string()], "a commit made after the newer checkpoint was replayed");
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xaa; 4096], "the older slot's own log was not replayed");
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// Snapshots taken and deleted in a nearly full pool, with a write into each mapping
/// page between (copying the page and a unit): once the snapshots are deleted, the
/// room their metadata took is free again without a restart, and allocating writes
/// fill what the trim gave back but for the room metadata holds (under 3 MiB
/// here). (An estimate of that room that only a checkpoint corrected once held
/// megabytes back, which writes had to checkpoint to get.)
#[test]
fn snapshot_churn_in_a_nearly_full_pool_does_not_hold_free_space_back() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create_with_unit(dir.path(), 64 * MIB, 16 * 1024);
    rt.block_on(pool.create_volume("v", 128 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    // Fill, then give back the last 16 MiB written.
    let filled = fill(&rt, &v, 65536, 1);
    let room = 16 * MIB;
    rt.block_on(v.trim(filled - room, room, false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    // Rounds of snapshot, one 4 KiB write into each mapping page (8 MiB of volume each
    // with 16 KiB units, so each copies the page and a unit), flush, delete.
    for round in 0..30 {
        if rt.block_on(pool.create_snapshot("v", "s")).is_err() {
            continue;
        }
        for page in (0..filled - room).step_by(8 * MIB as usize) {
            let _ = rt.block_on(write(&v, page, &[round as u8; 4096], false));
        }
        rt.block_on(v.flush()).unwrap();
        rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
    }
    // About 60 units of 16 KiB, each in two copies (ditto copies), 2.5 MiB: the next
    // checkpoint, the current one at up to twice its compact size (its page chunks are
    // kept while at least half live), and headroom, of which the spare may hold half
    // again.
    let reserved = pool.status().reserved;
    assert!(reserved < 3 * MIB, "{reserved} bytes held back for metadata");
    // With no snapshot left, what was given back is writable again but for 4 MiB.
    let back = room - 4 * MIB;
    for off in (filled - room..filled - room + back).step_by(65536) {
        rt.block_on(write(&v, off, &[2; 65536], false))
            .unwrap_or_else(|e| panic!("write at {off} with free space: {e}; {:?}", pool.status()));
    }
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// The same for trims: a trim inside a mapping page shared with a snapshot copies the
/// page, and in a full pool it needs room for that metadata. Rounds of snapshot, trims
/// in every page and snapshot delete count growth that the deleted snapshots no longer
/// need; a trim that then finds no room must checkpoint and try again.
#[test]
fn trims_under_snapshot_churn_in_a_full_pool_do_not_run_out_of_room() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create_with_unit(dir.path(), 256 * MIB, 16 * 1024);
    rt.block_on(pool.create_volume("v", 512 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    let filled = fill(&rt, &v, 1 << 20, 1);
    rt.block_on(v.flush()).unwrap();
    // Each round trims one block in each 8 MiB mapping page (the unit stays mapped by
    // its other blocks, so no data space comes back).
    for round in 0..12u64 {
        rt.block_on(pool.create_snapshot("v", "s")).unwrap_or_else(|e| panic!("round {round}: snapshot: {e}"));
        for page in (0..filled).step_by(8 * MIB as usize) {
            rt.block_on(v.trim(page + round * 16384, 4096, false))
                .unwrap_or_else(|e| panic!("round {round}: trim at {page}: {e}; {:?}", pool.status()));
        }
        rt.block_on(v.flush()).unwrap();
        rt.block_on(pool.delete_snapshot("v", "s")).unwrap();
    }
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// In a full pool, what a trim frees is taken by the next allocating write with no
/// flush in between: the write's make-room commits the frees, also when the free set
/// still holds a few units that data may not take (those the metadata spare is owed).
#[test]
fn a_write_after_a_trim_in_a_full_pool_takes_the_freed_space_without_a_flush() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create_with_unit(dir.path(), 64 * MIB, 16 * 1024);
    rt.block_on(pool.create_volume("v", 128 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    // Unit by unit, so the free set ends with no more units than data may not take.
    let filled = fill(&rt, &v, 16 * 1024, 1);
    rt.block_on(v.flush()).unwrap();
    let e = rt.block_on(write(&v, filled, &[1; 4096], false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    rt.block_on(v.trim(0, 8 * MIB, false)).unwrap();
    for i in 0..8u64 {
        rt.block_on(write(&v, i * MIB, &[2; 4096], false))
            .unwrap_or_else(|e| panic!("write {i} after the trim: {e}; {:?}", pool.status()));
    }
    rt.block_on(v.flush()).unwrap();
    assert_eq!(rt.block_on(read(&v, 8 * MIB - 4096, 4096)), vec![0; 4096]);
    assert_eq!(rt.block_on(read(&v, 3 * MIB, 4096)), vec![2; 4096]);
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// Volume creates add metadata without allocating data: in a full pool they are
/// refused with `NoSpace` once the room metadata holds is used, and the pool still
/// checkpoints, closes and opens with every volume. (That room was an estimate volume
/// creates did not check: in a full pool, enough of them made the checkpoint fail,
/// which failed the pool, and it no longer opened.)
#[test]
fn volume_creates_in_a_full_pool_leave_room_for_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create_with_unit(dir.path(), 16 * MIB, 16 * 1024);
    rt.block_on(pool.create_volume("v", 64 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    fill(&rt, &v, 65536, 1);
    let mut created = 1;
    let refused = (0..5000).find_map(|i| match rt.block_on(pool.create_volume(&format!("{i:0>128}"), MIB)) {
        Ok(_) => {
            created += 1;
            None
        }
        Err(e) => Some(e),
    });
    let e = refused.expect("5000 volume creates in a full pool were all taken");
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(!pool.status().failed);
    rt.block_on(pool.checkpoint()).unwrap();
    rt.block_on(write(&v, 0, &[2; 4096], false)).unwrap();
    drop(v);
    pool.close().unwrap();
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    assert_eq!(pool.names().len(), created);
    pool.close().unwrap();
}

/// A pool grows online onto a larger file: to a size given, or to the file's length
/// when none is; it never shrinks, and a size past the format's bound is refused; the
/// grown size survives a crash and a clean close.
#[test]
fn a_pool_grows_onto_a_larger_file_and_never_shrinks() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 16 * MIB);
    let before = pool.status();
    assert_eq!(before.size, 16 * MIB);
    for (size, why) in [(8 * MIB, "smaller"), (1 << 50, "past 2^32-2 units")] {
        let e = rt.block_on(pool.grow(Some(size))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{why}: {e}");
        assert_eq!(pool.status().capacity, before.capacity, "{why}: a refused grow changes nothing");
    }
    assert_eq!(std::fs::metadata(pool_path(dir.path())).unwrap().len(), 16 * MIB);
    // Nothing to grow onto: nothing changes.
    assert_eq!(rt.block_on(pool.grow(None)).unwrap().capacity, before.capacity);
    // The file lengthened by hand, then the pool grown onto it.
    std::fs::OpenOptions::new().write(true).open(pool_path(dir.path())).unwrap().set_len(40 * MIB).unwrap();
    let s = rt.block_on(pool.grow(None)).unwrap();
    assert_eq!((s.size, s.capacity), (40 * MIB, before.capacity + 24 * MIB));
    assert_eq!(s.free - before.free, 24 * MIB, "the new units are free");
    // A size that is not a whole number of units: the file holds all of it.
    let odd = 52 * MIB + 12345;
    let s = rt.block_on(pool.grow(Some(odd))).unwrap();
    assert_eq!((s.size, s.capacity), (odd, before.capacity + 36 * MIB));
    assert_eq!(std::fs::metadata(pool_path(dir.path())).unwrap().len(), odd);
    let pool = reopen_crash(pool, dir.path());
    assert_eq!(pool.status().size, odd, "the odd size after a crash");
    // A size given lengthens the file.
    let s = rt.block_on(pool.grow(Some(64 * MIB))).unwrap();
    assert_eq!((s.size, s.capacity), (64 * MIB, before.capacity + 48 * MIB));
    assert_eq!(std::fs::metadata(pool_path(dir.path())).unwrap().len(), 64 * MIB);
    let pool = reopen_crash(pool, dir.path());
    assert_eq!((pool.status().size, pool.status().capacity), (64 * MIB, before.capacity + 48 * MIB));
    pool.close().unwrap();
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    assert_eq!(pool.status().size, 64 * MIB);
    pool.close().unwrap();
}

/// Writers that fill a pool while it grows, step by step, beside snapshots on a
/// multi-threaded runtime: every write either succeeds or finds the pool full
/// (`ENOSPC`, tried again after the next step), no write is lost, and the pool is
/// consistent after a crash.
#[test]
fn a_pool_grows_while_writers_fill_it() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pool = create(dir.path(), 16 * MIB);
    const PIECES: u64 = 96; // 1 MiB each: more than the first size holds
    for name in ["a", "b"] {
        rt.block_on(pool.create_volume(name, PIECES * MIB)).unwrap();
    }
    let writer = |name: &'static str| {
        let v = pool.volume(name).unwrap();
        rt.spawn(async move {
            let mut full = 0;
            for i in 0..PIECES / 2 {
                let data = vec![i as u8 ^ name.as_bytes()[0]; MIB as usize];
                loop {
                    match write(&v, i * MIB, &data, false).await {
                        Ok(()) => break,
                        Err(e) if e.kind() == ErrorKind::NoSpace => {
                            full += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                        }
                        Err(e) => panic!("{name} piece {i}: {e}"),
                    }
                }
            }
            v.flush().await.unwrap();
            full
        })
    };
    let (a, b) = (writer("a"), writer("b"));
    let grower = {
        let pool = pool.clone();
        rt.spawn(async move {
            for step in 1..=10u64 {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                pool.grow(Some((16 + 12 * step) * MIB)).await.unwrap();
                pool.create_snapshot(if step % 2 == 0 { "a" } else { "b" }, &format!("s{step}")).await.unwrap();
            }
        })
    };
    rt.block_on(grower).unwrap();
    let full = rt.block_on(a).unwrap() + rt.block_on(b).unwrap();
    assert!(full > 0, "the writers should have found the pool full before it grew");
    let pool = reopen_crash(pool, dir.path());
    assert_eq!(pool.status().size, 136 * MIB);
    for name in ["a", "b"] {
        let v = pool.volume(name).unwrap();
        for i in 0..PIECES / 2 {
            let want = i as u8 ^ name.as_bytes()[0];
            assert!(rt.block_on(read(&v, i * MIB, MIB)).iter().all(|&x| x == want), "{name} piece {i}");
        }
    }
    pool.close().unwrap();
}

/// The superblock generation now current in the pool file at `path` (each checkpoint
/// writes one more).
fn generation(path: &std::path::Path) -> u64 {
    current_slot(&std::fs::File::open(path).unwrap()).generation.get()
}

/// The superblock slot of the pool file `f` with the higher generation.
fn current_slot(f: &std::fs::File) -> storage_engine::format::Superblock {
    storage_engine::format::SUPERBLOCK_OFFSETS
        .iter()
        .map(|&at| slot(f, at))
        .max_by_key(|sb| sb.generation.get())
        .unwrap()
}

/// A clean close and the open after it write no checkpoint (no superblock either): the
/// close commits what is left, the open replays the log since the last checkpoint. So
/// does the open after a crash that left no batch past the end of the log. The data
/// and the volumes made in between are all there each time.
#[test]
fn a_clean_close_and_the_open_after_it_write_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x11; 65536], false)).unwrap();
    drop(v);
    let g = generation(&path);
    pool.close().unwrap();
    assert_eq!(generation(&path), g, "the close wrote a checkpoint");
    let pool = Pool::open(&path).unwrap();
    assert_eq!(generation(&path), g, "the open wrote a checkpoint");
    assert!(pool.recovery().batches_replayed > 0, "the log since the checkpoint is replayed");
    let v = pool.volume("v").unwrap();
    assert!(rt.block_on(read(&v, 0, 65536)).iter().all(|&b| b == 0x11));
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    rt.block_on(write(&v, 0, &[0x22; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    drop(pool); // a crash after a completed flush: nothing past the end of the log
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    assert_eq!(generation(&path), g, "the open after the crash wrote a checkpoint");
    assert!(rt.block_on(read(&pool.volume("v").unwrap(), 0, 4096)).iter().all(|&b| b == 0x22));
    assert!(rt.block_on(read(&pool.volume("v@s").unwrap(), 0, 4096)).iter().all(|&b| b == 0x11));
    // An asked-for checkpoint still writes one.
    rt.block_on(pool.checkpoint()).unwrap();
    assert_eq!(generation(&path), g + 1);
    pool.close().unwrap();
    assert_clean(dir.path());
}

/// A crash can leave the header of a commit's batch on disk without the rest of it (a
/// torn batch): replay stops before it, and the open must not give its sequence number
/// to a new batch, which could complete it (a later write of the same bytes over its
/// missing blocks) and have a never-acknowledged commit replayed. So such an open writes
/// a checkpoint, numbering past it; the commits after it survive the next crash.
#[test]
fn an_open_after_a_torn_batch_numbers_past_it() {
    use std::os::unix::fs::FileExt;
    use storage_engine::format::{BatchHeader, LOG_MAGIC};
    use zerocopy::FromBytes;
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x11; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    rt.block_on(pool.create_volume("w", MIB)).unwrap(); // the last commit
    drop(pool); // a crash
                // Tear the last batch: its header stays, the last byte of its payload changes.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let sb = current_slot(&f);
    let (log_offset, log_size) = (sb.log_offset.get(), sb.log_size.get());
    let mut last: Option<(u64, u64, u64)> = None; // (seq, offset, payload bytes)
    let mut block = vec![0u8; 4096];
    for off in (log_offset..log_offset + log_size).step_by(4096) {
        f.read_exact_at(&mut block, off).unwrap();
        let (h, _) = BatchHeader::read_from_prefix(&block).unwrap();
        if h.magic.get() == LOG_MAGIC && last.is_none_or(|(seq, _, _)| h.seq.get() > seq) {
            last = Some((h.seq.get(), off, u64::from(h.payload_len.get())));
        }
    }
    let (_, at, payload) = last.expect("a batch in the log");
    let byte = at + size_of::<BatchHeader>() as u64 + payload - 1;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, byte).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], byte).unwrap();
    drop(f);
    let g = generation(&path);
    let pool = Pool::open(&path).unwrap();
    assert_eq!(pool.names(), vec!["v".to_string()], "the torn commit is not replayed");
    assert_eq!(generation(&path), g + 1, "the open wrote no checkpoint past the torn batch");
    rt.block_on(pool.create_volume("x", MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x22; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    drop(pool); // a crash
    assert_clean(dir.path());
    let pool = Pool::open(&path).unwrap();
    assert_eq!(pool.names(), vec!["v".to_string(), "x".to_string()]);
    assert!(rt.block_on(read(&pool.volume("v").unwrap(), 0, 4096)).iter().all(|&b| b == 0x22));
    pool.close().unwrap();
}

/// A snapshot or clone counts as pristine (nothing ever written: a CSI node may format
/// it) exactly when its source did: one of a volume never written shares nothing
/// mapped and reads as zeros; one of a written volume does not. The same after a
/// crash-style reopen (the log replayed) and after a checkpoint and a clean reopen.
#[test]
fn snapshots_and_clones_are_pristine_when_their_source_is() {
    let dir = tempfile::tempdir().unwrap();
    let path = pool_path(dir.path());
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    for name in ["empty", "data"] {
        rt.block_on(pool.create_volume(name, 4 * MIB)).unwrap();
    }
    rt.block_on(write(&pool.volume("data").unwrap(), 0, &[0x5a; 4096], false)).unwrap();
    for source in ["empty", "data"] {
        rt.block_on(pool.create_snapshot(source, "s")).unwrap();
        rt.block_on(pool.clone_volume(source, &format!("{source}-clone"))).unwrap();
        rt.block_on(pool.clone_volume(&format!("{source}@s"), &format!("{source}-restore"))).unwrap();
    }
    // Written after its snapshot and clone: those keep what they were.
    rt.block_on(pool.create_volume("later", 4 * MIB)).unwrap();
    rt.block_on(pool.create_snapshot("later", "s")).unwrap();
    rt.block_on(pool.clone_volume("later", "later-clone")).unwrap();
    rt.block_on(write(&pool.volume("later").unwrap(), 0, &[1; 4096], false)).unwrap();
    // A pristine clone written becomes written; its source stays pristine.
    rt.block_on(pool.clone_volume("empty", "used")).unwrap();
    rt.block_on(write(&pool.volume("used").unwrap(), 4096, &[2; 4096], false)).unwrap();
    rt.block_on(pool.flush()).unwrap();
    let names = [
        "empty",
        "empty@s",
        "empty-clone",
        "empty-restore",
        "data",
        "data@s",
        "data-clone",
        "data-restore",
        "later",
        "later@s",
        "later-clone",
        "used",
    ];
    let want = [true, true, true, true, false, false, false, false, false, true, true, false];
    let pristine = |pool: &Pool| names.map(|n| pool.volume_info(n).unwrap().pristine);
    assert_eq!(pristine(&pool), want, "{names:?}");
    for (n, w) in names.iter().zip(want) {
        if w {
            let v = pool.volume(n).unwrap();
            assert!(rt.block_on(read(&v, 0, 4 * MIB)).iter().all(|&b| b == 0), "{n} is pristine but holds data");
        }
    }
    let pool = reopen_crash(pool, dir.path());
    assert_eq!(pristine(&pool), want, "after the log's replay: {names:?}");
    rt.block_on(pool.checkpoint()).unwrap();
    pool.close().unwrap();
    let pool = Pool::open(&path).unwrap();
    assert_eq!(pristine(&pool), want, "from a checkpoint: {names:?}");
    pool.close().unwrap();
    assert_clean(dir.path());
}
