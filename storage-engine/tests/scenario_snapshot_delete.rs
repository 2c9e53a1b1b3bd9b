//! Scenario 1 of the snapshot issue, at full size in mappings: a 10 GiB volume with
//! 8 GiB allocated, snapshot S1, 4 GiB overwritten, snapshot S2, then S1 deleted while
//! 4 KiB random writes run on the volume. The delete returns in under a second, S2 reads
//! back unchanged, and the 4 GiB only S1 held is freed.
//!
//! Each 64 KiB data unit is allocated by writing one 4 KiB block in it, at a place that
//! varies from unit to unit: the mappings, refcounts and the delete's work are those of
//! 8 GiB written, while the sparse pool file takes about 0.8 GiB of disk, not 13 GiB
//! (copy on write copies only written blocks, so the overwrite stays sparse too).

mod common;
use std::time::{Duration, Instant};

use common::*;

const GIB: u64 = 1 << 30;
const UNIT: u64 = storage_engine::DEFAULT_UNIT_SIZE as u64;

/// The block of unit `u` (volume offset `u * UNIT`) that the fills write.
fn block_of(u: u64) -> u64 {
    u * UNIT + (u % (UNIT / 4096)) * 4096
}

/// The byte the fill with `tag` writes in unit `u`.
fn byte_of(u: u64, tag: u8) -> u8 {
    tag ^ (u * UNIT / GIB) as u8
}

/// Writes one 4 KiB block in each unit of `[from, to)` (bytes), 64 writes in flight.
fn fill(rt: &tokio::runtime::Runtime, v: &storage_engine::Volume, from: u64, to: u64, tag: u8) {
    rt.block_on(async {
        let mut units = from / UNIT..to / UNIT;
        let mut inflight = tokio::task::JoinSet::new();
        loop {
            while inflight.len() < 64 {
                let Some(u) = units.next() else { break };
                let v = v.clone();
                inflight.spawn(async move {
                    let mut buf = v.alloc_write_buf(block_of(u), 4096);
                    buf.as_mut().fill(byte_of(u, tag));
                    v.write(block_of(u), buf, false).await
                });
            }
            match inflight.join_next().await {
                Some(r) => r.unwrap().unwrap(),
                None => break,
            }
        }
    });
}

#[test]
fn deleting_a_snapshot_under_write_load_is_fast_and_frees_its_space() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let pool = create(dir.path(), 14 * GIB);
    rt.block_on(pool.create_volume("v", 10 * GIB)).unwrap();
    let v = pool.volume("v").unwrap();
    fill(&rt, &v, 0, 8 * GIB, 0x10);
    rt.block_on(pool.create_snapshot("v", "s1")).unwrap();
    fill(&rt, &v, 0, 4 * GIB, 0x20);
    rt.block_on(pool.create_snapshot("v", "s2")).unwrap();
    rt.block_on(pool.flush()).unwrap();
    assert_eq!(pool.status().used, 12 * GIB, "8 GiB shared by s1 and s2 minus the overwritten 4 GiB, plus 4 GiB new");
    let s1 = pool.list_snapshots(Some("v")).into_iter().find(|s| s.name == "v@s1").unwrap();
    assert_eq!(s1.exclusive, 4 * GIB);

    // 4 KiB random writes in the last 2 GiB (never written: allocating) while S1 goes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (v, stop) = (v.clone(), stop.clone());
        rt.spawn(async move {
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = 8 * GIB + (x % (2 * GIB / 4096)) * 4096;
                let mut buf = v.alloc_write_buf(off, 4096);
                buf.as_mut().fill(0x77);
                v.write(off, buf, false).await.unwrap();
                n += 1;
            }
            n
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    rt.block_on(pool.delete_snapshot("v", "s1")).unwrap();
    let took = t.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = rt.block_on(writer).unwrap();
    assert!(took < Duration::from_secs(1), "snapshot delete took {took:?}");
    assert!(writes > 0, "the write load ran");
    eprintln!("delete of a snapshot with 4 GiB exclusive took {took:?} during {writes} 4 KiB writes");

    rt.block_on(pool.flush()).unwrap();
    let used = pool.status().used;
    assert!((8 * GIB..8 * GIB + 2 * GIB).contains(&used), "s1's 4 GiB freed: used is {used}");
    // S2 unchanged: the overwrite's bytes in its first 4 GiB, the original in the next
    // 4 GiB, zeros around the written block of every unit.
    let s2 = pool.volume("v@s2").unwrap();
    for u in (0..8 * GIB / UNIT).step_by(7) {
        let tag = if u * UNIT < 4 * GIB { 0x20 } else { 0x10 };
        let got = rt.block_on(s2.read(u * UNIT, UNIT)).unwrap();
        let at = (block_of(u) - u * UNIT) as usize;
        let bytes = got.data.as_ref();
        assert!(bytes[at..at + 4096].iter().all(|&b| b == byte_of(u, tag)), "s2's written block in unit {u}");
        assert!(bytes[..at].iter().chain(&bytes[at + 4096..]).all(|&b| b == 0), "s2's unwritten blocks in unit {u}");
    }
    let tail = rt.block_on(s2.read(8 * GIB, MIB)).unwrap();
    assert!(tail.extents.iter().all(|e| !e.allocated), "s2 holds none of the later writes");
    drop((s2, v));
    let pool2 = pool.clone();
    rt.block_on(async move { tokio::task::spawn_blocking(move || pool2.close()).await.unwrap() }).unwrap();
    drop(pool);
    assert_clean(dir.path());
}
