//! A full host file system under a pool file behaves like a full pool: writes that need
//! new room get `ENOSPC` (`ErrorKind::NoSpace`) and the pool goes on, overwrites of
//! written data keep working, space the pool frees is reused, checkpoints still fit (the
//! room set aside for them is backed by blocks the host already gave the pool), and the
//! pool reopens, also when the host filled up while it was stopped. With `preallocate`
//! a pool file needs no room from the host at all.
//!
//! Each test mounts a small file system of its own (ext4 on a loop device, with
//! O_DIRECT, and tmpfs, buffered: the two ways the pool does I/O); that needs root, as
//! the test command runs.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use storage_engine::{ErrorKind, Pool, PoolOptions};

/// A file system of its own, mounted under a temporary directory; unmounted on drop.
struct HostFs {
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl HostFs {
    fn ext4(mib: u64) -> HostFs {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image).unwrap().set_len(mib * MIB).unwrap();
        run(Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&image));
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mnt));
        HostFs { _dir: dir, mnt }
    }

    fn tmpfs(mib: u64) -> HostFs {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        run(Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"]).arg(&mnt));
        HostFs { _dir: dir, mnt }
    }

    fn path(&self) -> &Path {
        &self.mnt
    }

    /// Fills what room the file system has left with a file of its own: 1 MiB pieces,
    /// then 4 KiB ones, synced, until none fits.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.mnt.join("filler")).unwrap();
        let chunk = vec![0x5a; 1 << 20];
        while f.write_all(&chunk).is_ok() {}
        for _ in 0..4 {
            while f.write_all(&chunk[..4096]).is_ok() {}
            let _ = f.sync_all();
        }
    }

    fn unfill(&self) {
        std::fs::remove_file(self.mnt.join("filler")).unwrap();
    }
}

impl Drop for HostFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

const POOL: u64 = 256 * MIB;

fn open(fs: &HostFs, preallocate: bool) -> Pool {
    let opts = PoolOptions { size: POOL, preallocate, ..Default::default() };
    Pool::open_or_create(&fs.path().join("pool.img"), &opts).unwrap()
}

/// Writes 1 MiB pieces of `v` from `start` (piece `i` all of byte `i`) until one fails;
/// returns how many succeeded and the error.
fn write_until_full(
    rt: &tokio::runtime::Runtime,
    v: &storage_engine::Volume,
    start: u64,
) -> (u64, storage_engine::Error) {
    let mut i = start;
    loop {
        match rt.block_on(write(v, i * MIB, &[i as u8; MIB as usize], false)) {
            Ok(()) => i += 1,
            Err(e) => return (i - start, e),
        }
    }
}

fn host_full_is_enospc_and_the_pool_goes_on(fs: HostFs) {
    let rt = rt();
    let pool = open(&fs, false);
    rt.block_on(pool.create_volume("v", 200 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    let (written, e) = write_until_full(&rt, &v, 0);
    assert_eq!(e.kind(), ErrorKind::NoSpace, "a write the host has no room for: {e}");
    assert!(written >= 16 && written * MIB < POOL / 2, "{written} MiB fit: the host should fill up first");
    assert!(!pool.status().failed, "a full host must not fail the pool");
    // Overwrites of written data need no room; a flush and a checkpoint still work.
    rt.block_on(write(&v, 0, &[0xee; MIB as usize], true)).unwrap();
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    // Space the pool frees is its own: trimmed units take new writes with the host full,
    // and are not given back to the host (no hole punching while it is full).
    let held = std::fs::metadata(fs.path().join("pool.img")).unwrap().blocks();
    rt.block_on(v.trim(MIB, 4 * MIB, false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    // Freed units waiting for a punch count in `freeing`: once it is 0, any punch is done.
    for _ in 0..1000 {
        if pool.status().freeing == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let now = std::fs::metadata(fs.path().join("pool.img")).unwrap().blocks();
    assert!(now >= held, "the pool gave {} bytes back to a full host", (held - now) * 512);
    // Three of the four MiB freed: the rest stays free and backed for the write after
    // the reopen below (the spare, formed again at open, takes no more than its target).
    for i in 0..3 {
        let off = (written + 8 + i) * MIB;
        rt.block_on(write(&v, off, &[0x77; MIB as usize], false))
            .unwrap_or_else(|e| panic!("a write into units the pool freed: {e}"));
    }
    rt.block_on(v.flush()).unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xee; 4096]);
    assert_eq!(rt.block_on(read(&v, (written - 1) * MIB, 4096)), vec![(written - 1) as u8; 4096]);
    drop(v);
    pool.close().unwrap();
    assert_clean(fs.path());
    // The host is still full: the pool opens, with every byte flushed.
    let pool = open(&fs, false);
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, 0, 4096)), vec![0xee; 4096]);
    assert_eq!(rt.block_on(read(&v, MIB, 4096)), vec![0; 4096], "trimmed");
    assert_eq!(rt.block_on(read(&v, (written + 8) * MIB, 4096)), vec![0x77; 4096]);
    assert_eq!(rt.block_on(read(&v, (written - 1) * MIB, 4096)), vec![(written - 1) as u8; 4096]);
    rt.block_on(write(&v, 2 * MIB, &[0x12; 4096], false)).unwrap();
    drop(v);
    pool.close().unwrap();
}

#[test]
fn a_full_ext4_host_is_enospc_and_the_pool_goes_on() {
    host_full_is_enospc_and_the_pool_goes_on(HostFs::ext4(64));
}

#[test]
fn a_full_tmpfs_host_is_enospc_and_the_pool_goes_on() {
    host_full_is_enospc_and_the_pool_goes_on(HostFs::tmpfs(48));
}

/// The host fills up while the pool is stopped after a crash: its log holds commits
/// the checkpoint at open must take in. The pool opens all the same, writes that need
/// room get `NoSpace` until the host has room again, then work.
#[test]
fn a_pool_reopens_after_a_crash_on_a_host_that_filled_up() {
    let fs = HostFs::ext4(64);
    let rt = rt();
    let pool = open(&fs, false);
    rt.block_on(pool.create_volume("v", 200 * MIB)).unwrap();
    rt.block_on(pool.create_snapshot("v", "empty")).unwrap();
    let v = pool.volume("v").unwrap();
    for i in 0..8 {
        rt.block_on(write(&v, i * MIB, &[i as u8 + 1; MIB as usize], false)).unwrap();
    }
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.create_snapshot("v", "s")).unwrap();
    // Metadata in the log that the checkpoint at open must take in: some 40 KiB.
    for i in 0..250 {
        rt.block_on(pool.create_volume(&format!("{i:0>120}"), MIB)).unwrap();
    }
    drop(v);
    drop(pool); // a crash: the log holds the writes', volumes' and snapshots' commits
    fs.fill();
    let pool = open(&fs, false);
    assert!(!pool.status().failed);
    let v = pool.volume("v").unwrap();
    let s = pool.volume("v@s").unwrap();
    for i in 0..8 {
        assert_eq!(rt.block_on(read(&v, i * MIB, 4096)), vec![i as u8 + 1; 4096]);
    }
    // An overwrite of a unit the snapshot shares copies it: a new unit from the host.
    rt.block_on(write(&v, 20 * MIB, &[9; 4096], false)).map(|_| ()).unwrap_or_else(|e| {
        assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    });
    let e = rt.block_on(write(&v, 100 * MIB, &[9; MIB as usize], false)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(!pool.status().failed);
    fs.unfill();
    rt.block_on(write(&v, 100 * MIB, &[9; MIB as usize], false)).unwrap();
    rt.block_on(write(&v, 0, &[0xcc; 4096], false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    assert_eq!(rt.block_on(read(&s, 0, 4096)), vec![1; 4096], "the snapshot keeps its point in time");
    drop((v, s));
    pool.close().unwrap();
    assert_clean(fs.path());
}

/// `preallocate` gives a pool file every block it may write: with the host file system
/// full from the start, the whole pool can be written.
#[test]
fn a_preallocated_pool_needs_no_room_from_the_host() {
    use std::os::unix::fs::MetadataExt;
    let fs = HostFs::tmpfs(300);
    let rt = rt();
    let pool = open(&fs, true);
    let meta = std::fs::metadata(fs.path().join("pool.img")).unwrap();
    assert!(meta.blocks() * 512 >= POOL, "{} bytes allocated of {POOL}", meta.blocks() * 512);
    fs.fill();
    rt.block_on(pool.create_volume("v", POOL)).unwrap();
    let v = pool.volume("v").unwrap();
    let (written, e) = write_until_full(&rt, &v, 0);
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    assert!(written * MIB > POOL * 9 / 10, "only {written} MiB of a {} MiB pool", POOL / MIB);
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    drop(v);
    pool.close().unwrap();
    let pool = open(&fs, true);
    let v = pool.volume("v").unwrap();
    assert_eq!(rt.block_on(read(&v, (written - 1) * MIB, 4096)), vec![(written - 1) as u8; 4096]);
    drop(v);
    pool.close().unwrap();
}
