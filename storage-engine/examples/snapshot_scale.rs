//! What many snapshots of one volume cost: a volume of `GIB` GiB with one 4 KiB block
//! written in each 64 KiB unit, then `N` snapshots with `PERMILLE`/1000 of its units
//! written (at random) between each, a checkpoint every `N / 10` snapshots; then a
//! close, an open, and the deletion of every tenth snapshot.
//!
//! `cargo run --release -p storage-engine --example snapshot_scale -- DIR GIB N PERMILLE`
//! prints one tab-separated line per tenth of the snapshots, then one for the open and
//! the deletes (BENCHMARKS.md, "Snapshots that cost what they change").

use std::time::Instant;

use storage_engine::{Pool, PoolOptions, Volume};

const UNIT: u64 = 64 * 1024;

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, gib, n, permille] = &args[..] else {
        panic!("usage: snapshot_scale DIR GIB N PERMILLE");
    };
    let (gib, n, permille): (u64, u64, u64) = (gib.parse().unwrap(), n.parse().unwrap(), permille.parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let path = std::path::Path::new(dir).join("snapshots.img");
    let _ = std::fs::remove_file(&path);
    let size = gib << 30;
    let units = size / UNIT;
    let changed = (units * permille / 1000).max(1);
    // Room for the volume, every unit the snapshots keep, and their metadata: the
    // pages and leaves each diverged by, in two copies (under 256 KiB a snapshot at
    // these change rates), and the reserve the rule of docs/on-disk-format.md 9 keeps
    // beside it for a checkpoint that writes everything, with its headroom (some five
    // times as much).
    let pool_size = size + n * changed * UNIT + n * (3 << 20) + size / 4 + (1 << 30);
    let opts = PoolOptions { size: pool_size, unit_size: UNIT as u32, ..Default::default() };
    let pool = Pool::create(&path, &opts).unwrap();
    rt.block_on(pool.create_volume("v", size)).unwrap();
    let v = pool.volume("v").unwrap();
    for u in 0..units {
        rt.block_on(write_block(&v, u, 0, 1));
    }
    rt.block_on(v.flush()).unwrap();
    rt.block_on(pool.checkpoint()).unwrap();
    println!("snapshots\tsnap_create_avg_ms\tsnap_create_max_ms\tckpt_bytes\tckpt_s\tmetadata_bytes\trss_bytes");
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let (mut total, mut max) = (0f64, 0f64);
    let every = (n / 10).max(1);
    for s in 1..=n {
        let t = Instant::now();
        rt.block_on(pool.create_snapshot("v", &format!("s{s}"))).unwrap();
        let took = t.elapsed().as_secs_f64();
        total += took;
        max = max.max(took);
        for _ in 0..changed {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            rt.block_on(write_block(&v, x % units, 1 + x % 15, s as u8));
        }
        if s % every == 0 {
            rt.block_on(v.flush()).unwrap();
            let before = pool.commit_stats().checkpoint_bytes;
            let t = Instant::now();
            rt.block_on(pool.checkpoint()).unwrap();
            let ckpt_s = t.elapsed().as_secs_f64();
            let ckpt = pool.commit_stats().checkpoint_bytes - before;
            println!(
                "{s}\t{:.3}\t{:.3}\t{ckpt}\t{ckpt_s:.3}\t{}\t{}",
                total / s as f64 * 1e3,
                max * 1e3,
                pool.status().metadata,
                rss()
            );
        }
    }
    drop(v);
    pool.close().unwrap();
    let t = Instant::now();
    let pool = Pool::open(&path).unwrap();
    let open_s = t.elapsed().as_secs_f64();
    let rss_open = rss();
    let t = Instant::now();
    let mut deleted = 0;
    for s in (every..=n).step_by(10) {
        rt.block_on(pool.delete_snapshot("v", &format!("s{s}"))).unwrap();
        deleted += 1;
    }
    let delete_ms = t.elapsed().as_secs_f64() / f64::from(deleted) * 1e3;
    let before = pool.commit_stats().checkpoint_bytes;
    rt.block_on(pool.checkpoint()).unwrap();
    let ckpt = pool.commit_stats().checkpoint_bytes - before;
    println!("open_s\topen_bytes_read\trss_after_open\tdelete_avg_ms\tckpt_after_deletes_bytes");
    println!("{open_s:.3}\t{}\t{rss_open}\t{delete_ms:.3}\t{ckpt}", pool.recovery().bytes_read);
    pool.close().unwrap();
    std::fs::remove_file(&path).unwrap();
}

/// Writes block `block` of unit `u` of `v`, all `byte`.
async fn write_block(v: &Volume, u: u64, block: u64, byte: u8) {
    let off = u * UNIT + block * 4096;
    let mut b = v.alloc_write_buf(off, 4096);
    b.as_mut().fill(byte);
    v.write(off, b, false).await.unwrap();
}
