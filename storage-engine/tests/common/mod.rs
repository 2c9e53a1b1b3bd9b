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

/// The power-loss simulators' time mode: `POWER_LOSS_MINUTES=M` runs workloads and
/// their cut points for about `M` minutes in all (half per seed) instead of a count
/// (`scripts/power-loss-long.sh`). `None` when unset.
pub fn power_loss_budget_per_seed() -> Option<std::time::Duration> {
    let minutes: f64 = std::env::var("POWER_LOSS_MINUTES").ok()?.parse().ok()?;
    Some(std::time::Duration::from_secs_f64(minutes * 60.0 / 2.0))
}

/// How a power-loss simulator spreads its cut points for one seed: `(workloads, cut
/// points per workload, time budget)`. In the time mode ([`power_loss_budget_per_seed`])
/// workloads of `per` cut points run until the budget is spent; otherwise `cuts` are
/// spread over at least `min_workloads` workloads, `per` each when there are many.
pub fn cut_plan(cuts: usize, min_workloads: usize, per: usize) -> (usize, usize, Option<std::time::Duration>) {
    match power_loss_budget_per_seed() {
        Some(budget) => (usize::MAX, per, Some(budget)),
        None => {
            let workloads = min_workloads.max(cuts / per);
            (workloads, cuts.div_ceil(workloads), None)
        }
    }
}

/// Bytes in a sector, the unit of the power-loss simulators' models.
pub const SECTOR: u64 = 512;

/// The 512 bytes a write with tag `tag` puts in a sector; tag 0 is all zeros.
pub fn sector_bytes(tag: u64) -> [u8; SECTOR as usize] {
    let mut b = [0u8; SECTOR as usize];
    if tag != 0 {
        b[..8].copy_from_slice(&tag.to_le_bytes());
        for (i, x) in b.iter_mut().enumerate().skip(8) {
            *x = (tag >> (8 * (i % 8))) as u8 ^ i as u8;
        }
    }
    b
}

/// The tag a sector holds, or `None` for bytes no write ever produced.
pub fn sector_tag(b: &[u8]) -> Option<u64> {
    let tag = u64::from_le_bytes(b[..8].try_into().unwrap());
    (sector_bytes(tag)[..] == *b).then_some(tag)
}

/// Writes to `image` what a power cut behind the first `cut` of `events` leaves of a
/// pool that started as `base`: every durable write, and each other one kept, lost or
/// torn at random (`storage_engine::testing::power_cut_writes`).
pub fn cut_image(
    image: &Path,
    base: &[u8],
    events: &[storage_engine::testing::IoEvent],
    cut: usize,
    rng: &mut storage_engine::testing::Rng,
) {
    use std::os::unix::fs::FileExt;
    use storage_engine::testing::{power_cut_writes, Fate};
    let f = std::fs::File::create(image).unwrap();
    f.set_len(base.len() as u64).unwrap();
    for (i, block) in base.chunks(4096).enumerate() {
        if block.iter().any(|&b| b != 0) {
            f.write_all_at(block, i as u64 * 4096).unwrap();
        }
    }
    let writes = power_cut_writes(events, cut, || match rng.below(3) {
        0 => Fate::Lost,
        1 => Fate::Kept,
        _ => Fate::Torn,
    });
    for (off, data) in writes {
        f.write_all_at(data, off).unwrap();
    }
}

/// The image of fixture `name` (`tests/fixtures/NAME.img.gz`, a pool an older build
/// wrote), uncompressed.
pub fn fixture_image(name: &str) -> Vec<u8> {
    use std::io::Read;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.img.gz"));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&path).unwrap()).read_to_end(&mut out).unwrap();
    out
}
