//! Disk errors: an `EIO` from the pool device on a write or a flush makes the pool
//! fail-stop (writes, trims and management changes refused, reported by `status()`),
//! while reads keep working; after a restart on a healthy device every write flushed
//! before the error is intact and `check` is clean. Errors are injected through
//! `storage_engine::testing::Faults` on the pool's io_uring.

mod common;

use std::sync::Arc;

use common::*;
use storage_engine::testing::Faults;
use storage_engine::{ErrorKind, IoOptions, Pool};

fn open_with_faults(dir: &std::path::Path) -> (Pool, Arc<Faults>) {
    create(dir, 32 * MIB).close().unwrap();
    let faults = Arc::new(Faults::new());
    let io = IoOptions { observer: Some(faults.clone()), ..Default::default() };
    (Pool::open_with(&pool_path(dir), &io).unwrap(), faults)
}

/// A pool on a fresh 32 MiB file with an 8 MiB volume "v", recording its I/O.
fn open_with_log(dir: &std::path::Path, rt: &tokio::runtime::Runtime) -> (Pool, Arc<storage_engine::testing::IoLog>) {
    create(dir, 32 * MIB).close().unwrap();
    let log = Arc::new(storage_engine::testing::IoLog::new());
    let io = IoOptions { observer: Some(log.clone()), ..Default::default() };
    let pool = Pool::open_with(&pool_path(dir), &io).unwrap();
    rt.block_on(pool.create_volume("v", 8 * MIB)).unwrap();
    (pool, log)
}

fn assert_refuses_changes(rt: &tokio::runtime::Runtime, pool: &Pool) {
    let v = pool.volume("v").unwrap();
    let e = rt.block_on(write(&v, 1 << 20, &[7; 4096], false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Failed, "a write after the error: {e}");
    let e = rt.block_on(v.trim(0, 4096, false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Failed, "a trim after the error: {e}");
    let e = rt.block_on(pool.create_volume("w", MIB)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Failed, "a management change after the error: {e}");
    assert!(pool.status().failed, "status reports the failure");
}

#[test]
fn a_failed_data_write_stops_writes_and_reads_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, faults) = open_with_faults(dir.path());
    rt.block_on(pool.create_volume("v", 4 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[1; 65536], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    assert!(!pool.status().failed);

    faults.fail_writes_after(0);
    let e = rt.block_on(write(&v, 0, &[2; 4096], false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "the failed write reports an I/O error: {e}");
    assert_refuses_changes(&rt, &pool);
    // Reads keep working; the range the failed write did not touch is as flushed.
    assert_eq!(rt.block_on(read(&v, 4096, 61440)), vec![1; 61440]);
    let first = rt.block_on(read(&v, 0, 4096));
    assert!(first == [1; 4096] || first == [2; 4096], "the failed block holds old or new data");

    drop(v);
    drop(pool); // no clean close after a failure
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 4096, 61440)), vec![1; 61440], "flushed data after restart");
    assert!(!pool.status().failed, "a restart on a healthy device clears the failure");
    rt.block_on(write(&v, 1 << 20, &[3; 4096], false)).unwrap();
}

#[test]
fn a_failed_flush_is_reported_and_stops_writes() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, faults) = open_with_faults(dir.path());
    rt.block_on(pool.create_volume("v", 4 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[1; 8192], false)).unwrap();
    rt.block_on(v.flush()).unwrap();

    faults.fail_flushes();
    rt.block_on(write(&v, 8192, &[2; 8192], false)).unwrap();
    let e = rt.block_on(v.flush()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Io | ErrorKind::Failed), "the flush fails: {e}");
    assert_refuses_changes(&rt, &pool);
    assert_eq!(rt.block_on(read(&v, 0, 8192)), vec![1; 8192], "reads keep working");

    drop(v);
    drop(pool);
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 8192)), vec![1; 8192], "data flushed before the failure survives");
}

#[test]
fn concurrent_flushes_over_durable_mappings_share_their_fdatasyncs() {
    // Eight flushes at once, with every mapping durable (the fast path): the first
    // issues an fdatasync; the seven that arrive while it runs cannot rely on it (it
    // started before their calls), so one more fdatasync serves all seven: two in all,
    // and every flush succeeds. The first fdatasync's completion is held back until all
    // eight have arrived: a disk may finish it before the second flush is even polled,
    // and then each flush in turn rightly takes its own.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    create(dir.path(), 32 * MIB).close().unwrap();
    let log = Arc::new(storage_engine::testing::IoLog::new());
    let faults = Arc::new(Faults::new());
    let io = IoOptions {
        observer: Some(Arc::new(storage_engine::testing::Both(faults.clone(), log.clone()))),
        ..Default::default()
    };
    let pool = Pool::open_with(&pool_path(dir.path()), &io).unwrap();
    rt.block_on(pool.create_volume("v", 8 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[1; 65536], false)).unwrap();
    rt.block_on(v.flush()).unwrap(); // the mapping is now durable
    rt.block_on(write(&v, 4096, &[2; 4096], false)).unwrap(); // an overwrite: no record
    let flushes = |log: &storage_engine::testing::IoLog| {
        log.events().iter().filter(|e| matches!(e, storage_engine::testing::IoEvent::FlushStarted { .. })).count()
    };
    let before = flushes(&log);
    faults.hold_flushes();
    let results = rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let v = v.clone();
            set.spawn(async move { v.flush().await });
        }
        // On the current-thread runtime each yield lets every spawned task run to its
        // first await: the first to its fdatasync, the others to the lock behind it.
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert_eq!(flushes(&log) - before, 1, "one fdatasync while the first is held");
        faults.release_flushes();
        set.join_all().await
    });
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    assert_eq!(flushes(&log) - before, 2, "eight concurrent flushes should take two fdatasyncs");
}

#[test]
fn a_commit_with_records_syncs_the_data_once_then_writes_its_log_batch_durably() {
    // An allocating write logs a mapping record; its flush is a commit cycle: one
    // fdatasync for the data, completed before the log batch is written, and the batch
    // written with RWF_DSYNC (durable on completion) instead of a second fdatasync.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, log) = open_with_log(dir.path(), &rt);
    let v = pool.volume("v").unwrap();
    let before = log.events().len();
    rt.block_on(write(&v, 0, &[1; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    use storage_engine::testing::IoEvent;
    let events = log.events()[before..].to_vec();
    let brief: Vec<String> = events
        .iter()
        .map(|e| match e {
            IoEvent::Write { offset, data, dsync } => format!("write {}@{offset} dsync={dsync}", data.len()),
            IoEvent::FlushStarted { id } => format!("fdatasync {id} started"),
            IoEvent::FlushDone { id } => format!("fdatasync {id} done"),
        })
        .collect();
    let starts: Vec<u64> =
        events.iter().filter_map(|e| if let IoEvent::FlushStarted { id } = e { Some(*id) } else { None }).collect();
    assert_eq!(starts.len(), 1, "one fdatasync per commit with records: {brief:?}");
    let synced = events.iter().position(|e| matches!(e, IoEvent::FlushDone { id } if *id == starts[0]));
    let batch = events.iter().position(|e| matches!(e, IoEvent::Write { dsync: true, .. }));
    let (Some(synced), Some(batch)) = (synced, batch) else {
        panic!("expected a completed fdatasync and a durable log write: {brief:?}");
    };
    assert!(synced < batch, "the data fdatasync must complete before the log batch is written: {brief:?}");
    drop(v);
    pool.close().unwrap();
}

#[test]
fn a_flush_beside_a_checkpoint_whose_fdatasync_fails_is_not_acknowledged() {
    // A writeback error is reported to one fdatasync of the file only: one that ran
    // beside it succeeds. A flush over durable mappings (one fdatasync of its own)
    // beside a checkpoint whose fdatasync gets the error must fail too, not return
    // success over a write the device may have lost. The checkpoint's fdatasync is held
    // in flight (its completion kept back) while the flush is called; given a moment,
    // a flush that syncs on its own would issue a second fdatasync meanwhile.
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let (pool, faults) = open_with_faults(dir.path());
    rt.block_on(pool.create_volume("v", 4 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[1; 65536], false)).unwrap();
    rt.block_on(v.flush()).unwrap(); // the mapping is durable: the next flush is the fast one
    rt.block_on(write(&v, 4096, &[2; 4096], false)).unwrap(); // an overwrite, no record
    faults.hold_flushes();
    faults.fail_next_flush();
    let checkpoint = {
        let pool = pool.clone();
        std::thread::spawn(move || common::rt().block_on(pool.checkpoint()))
    };
    let until = |n: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while faults.held_flushes() < n && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        faults.held_flushes()
    };
    assert_eq!(until(1), 1, "the checkpoint's fdatasync is in flight");
    let flush = {
        let v = v.clone();
        std::thread::spawn(move || common::rt().block_on(v.flush()))
    };
    let held = {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
        while faults.held_flushes() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        faults.held_flushes()
    };
    faults.release_flushes();
    let checkpoint = checkpoint.join().unwrap();
    let flush = flush.join().unwrap();
    assert!(checkpoint.is_err(), "the checkpoint's fdatasync failed");
    assert!(
        flush.is_err(),
        "a flush beside the failed fdatasync was acknowledged ({held} fdatasyncs were in flight at once)"
    );
    assert!(pool.status().failed);
}
