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
    Pool::create(&pool_path(dir), &PoolOptions { size, unit_size: 64 * 1024, ..Default::default() }).unwrap()
}

pub async fn write(v: &Volume, off: u64, data: &[u8], fua: bool) -> storage_engine::Result<()> {
    let mut b = v.alloc_write_buf(off, data.len());
    b.as_mut().copy_from_slice(data);
    v.write(off, b, fua).await
}

pub async fn read(v: &Volume, off: u64, len: u64) -> Vec<u8> {
    v.read(off, len).await.unwrap().data.as_ref().to_vec()
}

/// Runs the offline checker and panics on any problem.
pub fn assert_clean(dir: &Path) {
    let r = storage_engine::check(&pool_path(dir)).unwrap();
    assert!(r.problems.is_empty(), "check found problems: {:?}", r.problems);
}
