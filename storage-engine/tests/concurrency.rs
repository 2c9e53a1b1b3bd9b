//! Concurrent requests on one volume that touch the same data unit or the same 4 KiB
//! block but not the same bytes: each must keep the other's bytes. Both requests are
//! spawned on one current-thread runtime, so the first is planned and its I/O is in
//! the kernel when the second starts; then the data is checked live, and again after
//! a crash-style reopen (what a flush made durable).

mod common;

use common::*;
use storage_engine::{Pool, Volume};

const UNIT: u64 = 65536;
const ROUNDS: u64 = 32;

fn setup(dir: &std::path::Path, rt: &tokio::runtime::Runtime) -> (Pool, Volume) {
    let pool = create(dir, 64 * MIB);
    rt.block_on(pool.create_volume("v", 16 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    (pool, v)
}

fn reopen(pool: Pool, v: Volume, dir: &std::path::Path) -> Volume {
    drop(v);
    drop(pool);
    let pool = Pool::open(&pool_path(dir)).unwrap();
    pool.volume("v").unwrap()
}

#[test]
fn a_trim_in_the_same_unit_keeps_a_write_in_flight() {
    // Block 0 of the unit holds data; a write to block 5 is in flight when block 0 is
    // trimmed, which leaves the unit with no written block but the one being written.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = setup(dir.path(), &rt);
    for i in 0..ROUNDS {
        let u = i * UNIT;
        rt.block_on(write(&v, u, &[0xab; 4096], false)).unwrap();
        rt.block_on(v.flush()).unwrap();
        let (w, t) = (v.clone(), v.clone());
        rt.block_on(async {
            let write = tokio::spawn(async move { write(&w, u + 5 * 4096, &[0xcd; 4096], false).await });
            let trim = tokio::spawn(async move { t.trim(u, 4096, false).await });
            write.await.unwrap().unwrap();
            trim.await.unwrap().unwrap();
        });
    }
    rt.block_on(v.flush()).unwrap();
    let check = |v: &Volume, when: &str| {
        for i in 0..ROUNDS {
            let u = i * UNIT;
            assert_eq!(rt.block_on(read(v, u, 4096)), vec![0; 4096], "{when}: trimmed block of unit {i}");
            assert_eq!(rt.block_on(read(v, u + 5 * 4096, 4096)), vec![0xcd; 4096], "{when}: written block of unit {i}");
        }
    };
    check(&v, "live");
    check(&reopen(pool, v, dir.path()), "after reopen");
}

#[test]
fn a_partial_block_write_keeps_a_concurrent_full_block_write() {
    // A 512-byte write at the start of a block (read-modify-write of the block) and a
    // 4 KiB write of the whole block, started in that order: whichever lands last owns
    // bytes 0..512, but bytes 512..4096 are only ever written by the 4 KiB write.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = setup(dir.path(), &rt);
    for i in 0..ROUNDS {
        let b = i * UNIT;
        rt.block_on(write(&v, b, &[0xab; 4096], false)).unwrap();
        rt.block_on(v.flush()).unwrap();
        let (p, f) = (v.clone(), v.clone());
        rt.block_on(async {
            let partial = tokio::spawn(async move { write(&p, b, &[0x22; 512], false).await });
            let full = tokio::spawn(async move { write(&f, b, &[0x11; 4096], false).await });
            partial.await.unwrap().unwrap();
            full.await.unwrap().unwrap();
        });
    }
    rt.block_on(v.flush()).unwrap();
    let check = |v: &Volume, when: &str| {
        for i in 0..ROUNDS {
            let got = rt.block_on(read(v, i * UNIT, 4096));
            assert!(got[..512] == [0x22; 512] || got[..512] == [0x11; 512], "{when}: block {i} head {:x?}", &got[..8]);
            assert_eq!(&got[512..], &[0x11; 3584][..], "{when}: block {i}: the full-block write was undone");
        }
    };
    check(&v, "live");
    check(&reopen(pool, v, dir.path()), "after reopen");
}

/// Pool status, as a metrics scrape or a management client asks for it, runs while
/// snapshots and volumes are created and deleted: it must never wait on the volume
/// registry while holding the allocator, since a delete or snapshot holds the
/// registry and then takes the allocator (a deadlock that stopped both).
#[test]
fn pool_status_beside_snapshots_and_deletes_never_deadlocks() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, v) = setup(dir.path(), &rt);
    for u in 0..32 {
        rt.block_on(write(&v, u * UNIT, &[1; 4096], false)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let statuses: Vec<_> = (0..2)
        .map(|_| {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    assert!(pool.status().capacity > 0);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let changer = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let rt = common::rt();
            for i in 0..300 {
                rt.block_on(pool.create_snapshot("v", &format!("s{i}"))).unwrap();
                rt.block_on(pool.create_volume(&format!("w{i}"), MIB)).unwrap();
                rt.block_on(pool.delete_snapshot("v", &format!("s{i}"))).unwrap();
                rt.block_on(pool.delete_volume(&format!("w{i}"))).unwrap();
            }
            done_tx.send(()).unwrap();
        })
    };
    let finished = done_rx.recv_timeout(std::time::Duration::from_secs(120));
    stop.store(true, Ordering::Relaxed);
    assert!(finished.is_ok(), "snapshot and delete calls beside pool status stopped: a deadlock");
    changer.join().unwrap();
    let calls: u64 = statuses.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(calls > 0);
}
