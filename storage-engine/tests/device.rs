//! A pool on a block device (a loop device over a file of its own; needs root, as the
//! test command runs): `open_or_format_device` formats a device that holds no pool,
//! opens one that does with its data, and refuses, formatting nothing, a device whose
//! pool is damaged (both superblock slots fail, but carry the pool's magic); a pool
//! grows when its device does.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::Command;

use common::*;
use storage_engine::{ErrorKind, Pool, PoolOptions};

/// A loop device over a sparse file; detached on drop.
struct Loop {
    _dir: tempfile::TempDir,
    backing: PathBuf,
    dev: PathBuf,
}

impl Loop {
    fn new(bytes: u64) -> Loop {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("backing.img");
        std::fs::File::create(&file).unwrap().set_len(bytes).unwrap();
        let out = Command::new("losetup").args(["--find", "--show"]).arg(&file).output().unwrap();
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        let dev = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        Loop { _dir: dir, backing: file, dev }
    }

    /// Lengthens the backing file to `bytes` and tells the loop device (`losetup -c`).
    fn grow(&self, bytes: u64) {
        std::fs::OpenOptions::new().write(true).open(&self.backing).unwrap().set_len(bytes).unwrap();
        let out = Command::new("losetup").arg("-c").arg(&self.dev).output().unwrap();
        assert!(out.status.success(), "losetup -c: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

#[test]
fn a_device_without_a_pool_is_formatted_and_a_damaged_pool_is_refused() {
    let dev = Loop::new(64 * MIB);
    let rt = rt();
    let opts = PoolOptions { unit_size: 16 * 1024, ..Default::default() };
    let pool = Pool::open_or_format_device(&dev.dev, &opts).unwrap();
    assert_eq!(pool.status().capacity / MIB, 59, "the whole device, less superblocks and log");
    rt.block_on(pool.create_volume("v", 8 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x42; 4096], false)).unwrap();
    drop(v);
    pool.close().unwrap();
    // Opened again, not formatted: the data is there.
    let pool = Pool::open_or_format_device(&dev.dev, &opts).unwrap();
    assert_eq!(rt.block_on(read(&pool.volume("v").unwrap(), 0, 4096)), vec![0x42; 4096]);
    pool.close().unwrap();
    // Both slots damaged (a byte of each, the magic intact): refused, never formatted.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&dev.dev).unwrap();
    for slot in [0u64, 4096] {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, slot + 40).unwrap();
        f.write_all_at(&[b[0] ^ 0xff], slot + 40).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let e = Pool::open_or_format_device(&dev.dev, &opts).err().expect("a damaged pool is refused");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(!e.is_not_a_pool(), "{e}");
    let mut magic = [0u8; 8];
    std::fs::File::open(&dev.dev).unwrap().read_exact_at(&mut magic, 0).unwrap();
    assert_eq!(&magic, b"FERROVOL", "the device was formatted over");
}

/// A pool on a device that grew underneath it (a logical volume extended, a disk
/// resized: here a loop device over a longer file) takes the new size with
/// `Pool::grow(None)`, online; a size past the device is refused; the data stays.
#[test]
fn a_pool_grows_onto_its_grown_device() {
    let dev = Loop::new(64 * MIB);
    let rt = rt();
    let opts = PoolOptions { unit_size: 16 * 1024, ..Default::default() };
    let pool = Pool::open_or_format_device(&dev.dev, &opts).unwrap();
    rt.block_on(pool.create_volume("v", 256 * MIB)).unwrap();
    let v = pool.volume("v").unwrap();
    rt.block_on(write(&v, 0, &[0x42; 65536], false)).unwrap();
    let before = pool.status();
    assert_eq!(before.size, 64 * MIB);
    let e = rt.block_on(pool.grow(Some(128 * MIB))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "past the device: {e}");
    assert!(e.to_string().contains("the device holds"), "{e}");
    assert_eq!(rt.block_on(pool.grow(None)).unwrap().size, 64 * MIB, "nothing to grow onto");
    dev.grow(128 * MIB);
    let s = rt.block_on(pool.grow(None)).unwrap();
    assert_eq!((s.size, s.capacity), (128 * MIB, before.capacity + 64 * MIB));
    // Written into units past the old end (more than the first size held), and kept.
    for i in 1..100u64 {
        rt.block_on(write(&v, i * MIB, &vec![i as u8; MIB as usize], false)).unwrap();
    }
    rt.block_on(v.flush()).unwrap();
    drop(v);
    pool.close().unwrap();
    let pool = Pool::open_or_format_device(&dev.dev, &opts).unwrap();
    assert_eq!(pool.status().size, 128 * MIB);
    let v = pool.volume("v").unwrap();
    assert!(rt.block_on(read(&v, 0, 65536)).iter().all(|&b| b == 0x42));
    for i in 1..100u64 {
        assert!(rt.block_on(read(&v, i * MIB, MIB)).iter().all(|&b| b == i as u8), "MiB {i}");
    }
    drop(v);
    pool.close().unwrap();
}

/// Blocks the loop device's backing file holds, in bytes.
fn backing_bytes(dev: &Loop) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(&dev.backing).unwrap().blocks() * 512
}

/// With `discard`, a pool on a block device passes the units it frees (a deleted
/// volume's) down as discards once their free is durable: a loop device gives them
/// back to the file under it. Without it, the device keeps them. The data of the
/// volume left is untouched either way.
#[test]
fn freed_units_are_passed_down_as_discards_when_asked() {
    for discard in [false, true] {
        let dev = Loop::new(64 * MIB);
        let rt = rt();
        let opts = PoolOptions { discard, ..Default::default() };
        let pool = Pool::open_or_format_device(&dev.dev, &opts).unwrap();
        for name in ["a", "b"] {
            rt.block_on(pool.create_volume(name, 16 * MIB)).unwrap();
            let v = pool.volume(name).unwrap();
            rt.block_on(write(&v, 0, &vec![name.as_bytes()[0]; 8 << 20], false)).unwrap();
        }
        rt.block_on(pool.flush()).unwrap();
        let full = backing_bytes(&dev);
        rt.block_on(pool.delete_volume("a")).unwrap();
        rt.block_on(pool.flush()).unwrap();
        let t = std::time::Instant::now();
        while pool.status().freeing > 0 && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(pool.status().freeing, 0, "frees still waiting after 10 s");
        let given = full.saturating_sub(backing_bytes(&dev));
        if discard {
            assert!(given >= 7 * MIB, "deleting 8 MiB passed down {given} bytes");
        } else {
            assert!(given < MIB, "without discard the device gave back {given} bytes");
        }
        let b = pool.volume("b").unwrap();
        assert!(rt.block_on(read(&b, 0, 8 << 20)).iter().all(|&x| x == b'b'));
        // The units are taken again and hold what is written to them.
        rt.block_on(pool.create_volume("c", 16 * MIB)).unwrap();
        let c = pool.volume("c").unwrap();
        rt.block_on(write(&c, 0, &vec![0xc1; 8 << 20], false)).unwrap();
        rt.block_on(c.flush()).unwrap();
        assert!(rt.block_on(read(&c, 0, 8 << 20)).iter().all(|&x| x == 0xc1));
        drop((b, c));
        pool.close().unwrap();
    }
}
