//! What checkpoints, opens and snapshots cost as the mapped total grows: for each size
//! given (GiB mapped, 64 KiB units or `UNIT_KIB` KiB ones, one 4 KiB block written in
//! each unit so the disk holds 1/16 of it with 64 KiB units), a pool is filled and checkpointed, then changed in 0.1% of its
//! units (at random, then as many contiguous ones) and checkpointed after each,
//! snapshotted, closed and opened.
//!
//! `cargo run --release -p storage-engine --example checkpoint_scale -- DIR GIB...`
//! prints one tab-separated line per size (BENCHMARKS.md, "Metadata at scale").

use std::time::Instant;

use storage_engine::{Pool, PoolOptions, Volume};

/// The data-unit size: `UNIT_KIB` KiB (16 to 128), 64 KiB by default.
fn unit() -> u64 {
    static UNIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *UNIT.get_or_init(|| std::env::var("UNIT_KIB").ok().and_then(|v| v.parse().ok()).unwrap_or(64) * 1024)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, sizes) = args.split_first().expect("usage: checkpoint_scale DIR GIB...");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    println!(
        "mapped_gib\theld_bytes\tckpt_bytes\tckpt_s\tchanged_units\tincr_ckpt_bytes\tincr_ckpt_s\tlocal_ckpt_bytes\thold_max_ms\tsnapshot_s\tsnap_ckpt_bytes\topen_s\topen_bytes_read\tclose_open_ckpt_bytes"
    );
    for gib in sizes {
        let gib: u64 = gib.parse().expect("GiB mapped");
        let path = std::path::Path::new(dir).join(format!("scale-{gib}.img"));
        let _ = std::fs::remove_file(&path);
        let mapped = gib << 30;
        let opts =
            PoolOptions { size: mapped + mapped / 8 + (256 << 20), unit_size: unit() as u32, ..Default::default() };
        let pool = Pool::create(&path, &opts).unwrap();
        rt.block_on(pool.create_volume("v", mapped)).unwrap();
        let v = pool.volume("v").unwrap();
        let units = mapped / unit();
        rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            let lanes = 16;
            for lane in 0..lanes {
                let v = v.clone();
                set.spawn(async move {
                    let mut u = lane;
                    while u < units {
                        write_block(&v, u, 0, 1).await;
                        u += lanes;
                    }
                });
            }
            while set.join_next().await.is_some() {}
        });
        rt.block_on(v.flush()).unwrap();
        let ckpt = |pool: &Pool| -> (u64, f64) {
            let before = pool.commit_stats().checkpoint_bytes;
            let t = Instant::now();
            rt.block_on(pool.checkpoint()).unwrap();
            (pool.commit_stats().checkpoint_bytes - before, t.elapsed().as_secs_f64())
        };
        let (full, full_s) = ckpt(&pool);
        // What the checkpoint holds: a whole one's size (checkpoints during the fill
        // already stored most pages, so this one wrote only what came after them).
        let held = pool.status().metadata;
        // 0.1% of the units get a second block: their mappings change.
        let changed = (units / 1000).max(1);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..changed {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            rt.block_on(write_block(&v, x % units, 1, 2));
        }
        rt.block_on(v.flush()).unwrap();
        let (incr, incr_s) = ckpt(&pool);
        // As many units again, but contiguous: a few pages change.
        for u in 0..changed {
            rt.block_on(write_block(&v, u, 2, 3));
        }
        rt.block_on(v.flush()).unwrap();
        let (local, _) = ckpt(&pool);
        let t = Instant::now();
        rt.block_on(pool.create_snapshot("v", "s")).unwrap();
        let snapshot_s = t.elapsed().as_secs_f64();
        let (snap_ckpt, _) = ckpt(&pool);
        let hold_ms = pool.commit_stats().checkpoint_hold_max_seconds * 1e3;
        drop(v);
        pool.close().unwrap();
        let t = Instant::now();
        let pool = Pool::open(&path).unwrap();
        let open_s = t.elapsed().as_secs_f64();
        let read = pool.recovery().bytes_read;
        let (reopen_ckpt, _) = ckpt(&pool);
        pool.close().unwrap();
        println!(
            "{gib}\t{held}\t{full}\t{full_s:.3}\t{changed}\t{incr}\t{incr_s:.3}\t{local}\t{hold_ms:.1}\t{snapshot_s:.4}\t{snap_ckpt}\t{open_s:.3}\t{read}\t{reopen_ckpt}"
        );
        std::fs::remove_file(&path).unwrap();
    }
}

/// Writes block `block` of unit `u` of `v`, all `byte`.
async fn write_block(v: &Volume, u: u64, block: u64, byte: u8) {
    let off = u * unit() + block * 4096;
    let mut b = v.alloc_write_buf(off, 4096);
    b.as_mut().fill(byte);
    v.write(off, b, false).await.unwrap();
}
