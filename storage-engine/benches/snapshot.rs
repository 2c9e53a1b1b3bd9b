//! Snapshot create and delete latency for a 1 GiB volume (fully written) and a 1 TiB
//! volume with 10 GiB written, in one run: creating a snapshot shares mapping pages, so
//! both should cost about the same. The pool lives in $FERROVOL_BENCH_DIR (default
//! /var/tmp) and needs ~12 GiB of disk; setup writes 11 GiB once.

use criterion::{criterion_group, criterion_main, Criterion};
use storage_engine::{Pool, PoolOptions};

fn fill(rt: &tokio::runtime::Runtime, pool: &Pool, name: &str, bytes: u64) {
    let v = pool.volume(name).unwrap();
    let chunk = 8u64 << 20;
    let mut off = 0;
    while off < bytes {
        let mut buf = v.alloc_write_buf(off, chunk as usize);
        buf.as_mut().fill((off >> 20) as u8 | 1);
        rt.block_on(v.write(off, buf, false)).unwrap();
        off += chunk;
    }
    rt.block_on(v.flush()).unwrap();
}

fn snapshots(c: &mut Criterion) {
    let base = std::env::var("FERROVOL_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let dir = tempfile::tempdir_in(base).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let pool = Pool::create(
        &dir.path().join("pool.img"),
        &PoolOptions { size: 13 << 30, unit_size: 64 * 1024, ..Default::default() },
    )
    .unwrap();
    rt.block_on(pool.create_volume("small", 1 << 30)).unwrap();
    rt.block_on(pool.create_volume("large", 1 << 40)).unwrap();
    fill(&rt, &pool, "small", 1 << 30);
    fill(&rt, &pool, "large", 10 << 30);
    let mut g = c.benchmark_group("snapshot_create_delete");
    g.sample_size(30);
    for (label, vol) in [("1GiB_volume_1GiB_written", "small"), ("1TiB_volume_10GiB_written", "large")] {
        g.bench_function(format!("create/{label}"), |b| {
            b.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                for _ in 0..iters {
                    let t = std::time::Instant::now();
                    rt.block_on(pool.create_snapshot(vol, "s")).unwrap();
                    total += t.elapsed();
                    rt.block_on(pool.delete_snapshot(vol, "s")).unwrap();
                }
                total
            })
        });
        g.bench_function(format!("delete/{label}"), |b| {
            b.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                for _ in 0..iters {
                    rt.block_on(pool.create_snapshot(vol, "s")).unwrap();
                    let t = std::time::Instant::now();
                    rt.block_on(pool.delete_snapshot(vol, "s")).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
    pool.close().unwrap();
}

criterion_group!(benches, snapshots);
criterion_main!(benches);
