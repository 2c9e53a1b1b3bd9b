//! Scenario 1 of the snapshot issue, at full size: a 10 GiB volume with 8 GiB written,
//! snapshot S1, 4 GiB overwritten, snapshot S2, then S1 deleted while 4 KiB random
//! writes run on the volume. The delete returns in under a second, S2 reads back
//! unchanged, and the 4 GiB only S1 held is freed. Needs ~13 GiB of disk in the temp
//! dir (sparse pool file).

mod common;
use std::time::{Duration, Instant};

use common::*;

const GIB: u64 = 1 << 30;

fn fill(rt: &tokio::runtime::Runtime, v: &storage_engine::Volume, from: u64, to: u64, tag: u8) {
    let chunk = 8 * MIB;
    let mut off = from;
    while off < to {
        let mut buf = v.alloc_write_buf(off, chunk as usize);
        buf.as_mut().fill(tag ^ (off / GIB) as u8);
        rt.block_on(v.write(off, buf, false)).unwrap();
        off += chunk;
    }
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
    // S2 unchanged: new data in its first 4 GiB, the original in the next 4 GiB.
    let s2 = pool.volume("v@s2").unwrap();
    for g in 0..8u64 {
        let tag = if g < 4 { 0x20 } else { 0x10 } ^ g as u8;
        for off in [g * GIB, g * GIB + 123 * MIB + 4096, (g + 1) * GIB - 65536] {
            let got = rt.block_on(s2.read(off, 65536)).unwrap();
            assert!(got.data.as_ref().iter().all(|&b| b == tag), "s2 at {off}");
        }
    }
    let tail = rt.block_on(s2.read(8 * GIB, MIB)).unwrap();
    assert!(tail.extents.iter().all(|e| !e.allocated), "s2 holds none of the later writes");
    drop((s2, v));
    let pool2 = pool.clone();
    rt.block_on(async move { tokio::task::spawn_blocking(move || pool2.close()).await.unwrap() }).unwrap();
    drop(pool);
    assert_clean(dir.path());
}
