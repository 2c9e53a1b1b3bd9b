//! Group snapshots (`Pool::create_group_snapshot`): one instant for several volumes.
//! Two volumes are written by one client in strict alternation (a write to A, then one
//! to B, each acknowledged before the next is issued, each carrying its step number)
//! while group snapshots are taken from other threads at random moments; in every
//! group snapshot, and again after a reopen, A's step `a` and B's step `b` must satisfy
//! `a - 1 <= b <= a`: B never holds a write that came after a write A lacks, and A
//! never holds one that came after a write B lacks. Also: its refusals change nothing.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use storage_engine::{ErrorKind, Labels, Pool, Volume};

/// The step number a volume holds (its first 8 bytes), 0 before any write.
fn step(rt: &tokio::runtime::Runtime, v: &Volume) -> u64 {
    let b = rt.block_on(read(v, 0, 4096));
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

fn block(step: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    b[..8].copy_from_slice(&step.to_le_bytes());
    b
}

#[test]
fn a_group_snapshot_is_one_instant_for_all_its_volumes() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    for name in ["a", "b", "c"] {
        rt.block_on(pool.create_volume(name, 4 * MIB)).unwrap();
    }
    let (a, b) = (pool.volume("a").unwrap(), pool.volume("b").unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let rt = common::rt();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                rt.block_on(write(&a, 0, &block(i), false)).unwrap();
                rt.block_on(write(&b, 0, &block(i), false)).unwrap();
            }
            i
        })
    };
    let takers: Vec<_> = (0..2)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let rt = common::rt();
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ t;
                for n in 0..40 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    std::thread::sleep(std::time::Duration::from_micros(seed % 3000));
                    // "c" is idle: a group may hold volumes nobody writes.
                    let made =
                        rt.block_on(pool.create_group_snapshot(&["b", "a", "c"], &format!("g{t}-{n}"), &Labels::new()));
                    assert_eq!(made.unwrap().len(), 3);
                }
            })
        })
        .collect();
    for t in takers {
        t.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let steps = writer.join().unwrap();
    assert!(steps > 10, "the writer hardly ran ({steps} steps)");
    let check = |pool: &Pool, when: &str| {
        let mut distinct = std::collections::BTreeSet::new();
        for t in 0..2 {
            for n in 0..40 {
                let a = step(&rt, &pool.volume(&format!("a@g{t}-{n}")).unwrap());
                let b = step(&rt, &pool.volume(&format!("b@g{t}-{n}")).unwrap());
                assert!(a.saturating_sub(1) <= b && b <= a, "{when}: group g{t}-{n} holds A at step {a}, B at {b}");
                distinct.insert(a);
            }
        }
        distinct.len()
    };
    let distinct = check(&pool, "live");
    assert!(distinct > 1, "every group snapshot caught the same step: the test saw no interleaving");
    drop(pool);
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    check(&pool, "after reopen");
}

#[test]
fn a_refused_group_snapshot_makes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let pool = create(dir.path(), 64 * MIB);
    for name in ["a", "b"] {
        rt.block_on(pool.create_volume(name, MIB)).unwrap();
    }
    rt.block_on(pool.create_snapshot("b", "s")).unwrap();
    let kind = |vols: &[&str], snap: &str| {
        rt.block_on(pool.create_group_snapshot(vols, snap, &Labels::new())).map(|_| ()).unwrap_err().kind()
    };
    assert_eq!(kind(&["a", "b"], "s"), ErrorKind::AlreadyExists, "b@s exists");
    assert_eq!(kind(&["a", "nope"], "t"), ErrorKind::NotFound);
    assert_eq!(kind(&["a", "a"], "t"), ErrorKind::InvalidArgument, "a volume named twice");
    assert_eq!(kind(&[], "t"), ErrorKind::InvalidArgument, "no volume");
    assert_eq!(kind(&["a", "b@s"], "t"), ErrorKind::InvalidArgument, "a snapshot as a member");
    assert_eq!(kind(&["a", "b"], "bad/name"), ErrorKind::InvalidArgument);
    let names: Vec<String> = pool.list_snapshots(None).into_iter().map(|v| v.name).collect();
    assert_eq!(names, vec!["b@s".to_string()], "nothing made by the refused calls");
    let mut labels = Labels::new();
    labels.insert("ferrovol.io/group".into(), "g".into());
    let made = rt.block_on(pool.create_group_snapshot(&["b", "a"], "t", &labels)).unwrap();
    let names: Vec<&str> = made.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["a@t", "b@t"], "members in name order");
    assert!(made.iter().all(|v| v.labels == labels), "the labels are on every member");
}
