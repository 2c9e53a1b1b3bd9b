//! Criterion benches of the engine's hot paths: mapping lookup and update, data-unit
//! allocation, and the whole write and read paths of a volume (4 KiB: overwrite,
//! allocating, and copy on write of a unit a snapshot shares) on a pool in /dev/shm when
//! it exists (so the numbers show the engine's own cost rather than the disk's), else in
//! the temp dir.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use storage_engine::meta::{Allocator, Entry, MapTable, StripedCounts};
use storage_engine::{Pool, PoolOptions};

/// A xorshift generator: cheap, deterministic offsets.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn mapping(c: &mut Criterion) {
    let units = 1u64 << 20; // 64 GiB of 64 KiB units
                            // Refcounts as the pool keeps them: every change of a table takes the allocator.
    let a = std::cell::RefCell::new(Allocator::new(units as usize));
    let mut t = MapTable::new();
    for u in 0..units {
        t.set(u, Entry { punit: u as u32, bitmap: u32::MAX }, &mut a.borrow_mut());
    }
    let mut g = c.benchmark_group("mapping");
    g.throughput(Throughput::Elements(1));
    let mut r = Rng(7);
    g.bench_function("lookup_random_1M_entries", |b| b.iter(|| t.get(r.next() % units)));
    g.bench_function("set_bitmap_random", |b| {
        b.iter(|| {
            let u = r.next() % units;
            let e = t.get(u);
            t.set(u, Entry { punit: e.punit, bitmap: e.bitmap ^ 1 }, &mut a.borrow_mut())
        })
    });
    // Copy on write of a shared page: share the table, then change one entry per page.
    g.bench_function("set_in_shared_page_copies_page", |b| {
        b.iter_batched(
            || t.share(&mut a.borrow_mut()),
            |mut shared| {
                let old = shared.set(r.next() % units, Entry { punit: 1, bitmap: 1 }, &mut a.borrow_mut());
                (shared, old)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn allocation(c: &mut Criterion) {
    let n = 1usize << 20;
    let pins = StripedCounts::new();
    let mut g = c.benchmark_group("allocation");
    g.throughput(Throughput::Elements(1));
    // Half-full pool: allocate one, free one, release it (steady state).
    let mut a = Allocator::from_refcounts(vec![0; n]);
    let mut held: Vec<u32> = (0..n / 2).map(|_| a.alloc().unwrap()).collect();
    let mut r = Rng(9);
    g.bench_function("alloc_free_cycle_half_full", |b| {
        b.iter(|| {
            let i = (r.next() as usize) % held.len();
            a.decref(held[i]);
            a.release_pending(a.pending_mark(), &pins);
            held[i] = a.alloc().unwrap();
        })
    });
    g.finish();
}

fn data_path(c: &mut Criterion) {
    let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    let dir = tempfile::tempdir_in(base).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let pool = Pool::create(
        &dir.path().join("pool.img"),
        &PoolOptions { size: 2 << 30, unit_size: 64 * 1024, ..Default::default() },
    )
    .unwrap();
    let vol_size = 1u64 << 30;
    rt.block_on(pool.create_volume("b", vol_size)).unwrap();
    let v = pool.volume("b").unwrap();
    // Precondition the first 256 MiB for overwrites and reads.
    let pre = 256u64 << 20;
    let mut off = 0;
    while off < pre {
        let mut buf = v.alloc_write_buf(off, 1 << 20);
        buf.as_mut().fill(0x5a);
        rt.block_on(v.write(off, buf, false)).unwrap();
        off += 1 << 20;
    }
    let blocks = pre / 4096;
    let mut g = c.benchmark_group("data_path");
    g.throughput(Throughput::Bytes(4096));
    let mut r = Rng(11);
    g.bench_function("write_4k_overwrite", |b| {
        b.iter_batched(
            || {
                let off = (r.next() % blocks) * 4096;
                (off, v.alloc_write_buf(off, 4096))
            },
            |(off, buf)| rt.block_on(v.write(off, buf, false)).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("read_4k_mapped", |b| b.iter(|| rt.block_on(v.read((r.next() % blocks) * 4096, 4096)).unwrap()));
    // Allocating writes: each into a fresh unit, trimmed again to keep space steady.
    let units = (vol_size - pre) / 65536;
    g.bench_function("write_4k_allocating", |b| {
        b.iter_batched(
            || {
                let off = pre + (r.next() % units) * 65536;
                (off, v.alloc_write_buf(off, 4096))
            },
            |(off, buf)| {
                rt.block_on(v.write(off, buf, false)).unwrap();
                rt.block_on(v.trim(off, 65536, false)).unwrap();
            },
            BatchSize::SmallInput,
        )
    });
    // Copy on write: the first 4 KiB write into a unit a snapshot shares allocates a
    // unit, copies the old unit's other written blocks (here all 15) beside the new
    // data, and remaps. A new snapshot (not timed) shares the units again once each has
    // been written; the one before it is deleted, which frees the units it held alone.
    let pre_units = pre / 65536;
    let (mut next, mut snap) = (pre_units, 0u32);
    g.bench_function("write_4k_copy_on_write", |b| {
        b.iter_batched(
            || {
                if next == pre_units {
                    if snap > 0 {
                        rt.block_on(pool.delete_snapshot("b", &format!("s{}", snap - 1))).unwrap();
                    }
                    rt.block_on(pool.create_snapshot("b", &format!("s{snap}"))).unwrap();
                    (snap, next) = (snap + 1, 0);
                }
                let off = next * 65536;
                next += 1;
                (off, v.alloc_write_buf(off, 4096))
            },
            |(off, buf)| rt.block_on(v.write(off, buf, false)).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("block_status_1GiB", |b| b.iter(|| v.block_status(0, vol_size).unwrap()));
    g.finish();
    drop(v);
    pool.close().unwrap();
}

criterion_group!(benches, mapping, allocation, data_path);
criterion_main!(benches);
