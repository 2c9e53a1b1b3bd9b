//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use storage_engine::{Pool, PoolOptions, Volume};

pub const MIB: u64 = 1 << 20;

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

pub fn pool_path(dir: &Path) -> PathBuf {
    dir.join("pool.img")
}

pub fn create(dir: &Path, size: u64) -> Pool {
    create_with_unit(dir, size, 64 * 1024)
}

/// A new pool of `size` bytes with data units of `unit_size` bytes in `dir`.
pub fn create_with_unit(dir: &Path, size: u64, unit_size: u32) -> Pool {
    Pool::create(&pool_path(dir), &PoolOptions { size, unit_size, ..Default::default() }).unwrap()
}

pub async fn write(v: &Volume, off: u64, data: &[u8], fua: bool) -> storage_engine::Result<()> {
    let mut b = v.alloc_write_buf(off, data.len());
    b.as_mut().copy_from_slice(data);
    v.write(off, b, fua).await
}

pub async fn read(v: &Volume, off: u64, len: u64) -> Vec<u8> {
    v.read(off, len).await.unwrap().data.as_ref().to_vec()
}

/// Writes `chunk`-byte pieces of `byte` to `v` from offset 0 until a write fails (the
/// pool is full); returns the bytes written.
pub fn fill(rt: &tokio::runtime::Runtime, v: &Volume, chunk: usize, byte: u8) -> u64 {
    let mut filled = 0;
    while rt.block_on(write(v, filled, &vec![byte; chunk], false)).is_ok() {
        filled += chunk as u64;
    }
    filled
}

/// Runs the offline checker and panics on any problem.
pub fn assert_clean(dir: &Path) {
    let r = storage_engine::check(&pool_path(dir)).unwrap();
    assert!(r.problems.is_empty(), "check found problems: {:?}", r.problems);
}
