//! Model-based property test: random writes, trims, zeroes and reads at random offsets
//! and lengths on a volume, compared with an in-memory byte array, with the pool closed
//! and reopened (or dropped without closing, like a crash after a flush) between steps.

mod common;
use common::*;
use proptest::prelude::*;
use storage_engine::Pool;

const VOL: u64 = 3 * MIB + 12 * 1024; // not a multiple of the unit size

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: u64,
        len: u64,
        seed: u8,
        fua: bool,
    },
    Trim {
        off: u64,
        len: u64,
    },
    Zero {
        off: u64,
        len: u64,
        may_unmap: bool,
    },
    Read {
        off: u64,
        len: u64,
    },
    Flush,
    /// Flush, then close cleanly (checkpoint) or drop (replay the log), and reopen.
    Reopen {
        clean: bool,
    },
}

fn range() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        // small, unaligned
        (0..VOL, 1u64..10_000),
        // block-aligned
        (0..VOL / 4096, 1u64..40).prop_map(|(b, n)| (b * 4096, n * 4096)),
        // large
        (0..VOL, 1u64..600_000),
    ]
    .prop_map(|(off, len)| (off, len.min(VOL - off).max(1)))
    .prop_filter("inside", |(off, len)| off + len <= VOL)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (range(), any::<u8>(), any::<bool>()).prop_map(|((off, len), seed, fua)| Op::Write { off, len, seed, fua }),
        2 => range().prop_map(|(off, len)| Op::Trim { off, len }),
        1 => (range(), any::<bool>()).prop_map(|((off, len), may_unmap)| Op::Zero { off, len, may_unmap }),
        3 => range().prop_map(|(off, len)| Op::Read { off, len }),
        1 => Just(Op::Flush),
        1 => any::<bool>().prop_map(|clean| Op::Reopen { clean }),
    ]
}

fn pattern(seed: u8, off: u64, len: u64) -> Vec<u8> {
    (off..off + len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn run(ops: Vec<Op>) {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let mut pool = create(dir.path(), 32 * MIB);
    rt.block_on(pool.create_volume("v", VOL)).unwrap();
    let mut model = vec![0u8; VOL as usize];
    for op in ops {
        let v = pool.volume("v").unwrap();
        match op {
            Op::Write { off, len, seed, fua } => {
                let data = pattern(seed, off, len);
                rt.block_on(write(&v, off, &data, fua)).unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
            }
            Op::Trim { off, len } => {
                rt.block_on(v.trim(off, len, false)).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            Op::Zero { off, len, may_unmap } => {
                rt.block_on(v.write_zeroes(off, len, may_unmap, false)).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            Op::Read { off, len } => {
                let r = rt.block_on(v.read(off, len)).unwrap();
                assert_eq!(r.data.as_ref(), &model[off as usize..(off + len) as usize], "read {len} at {off}");
                assert_eq!(r.extents.iter().map(|e| e.length).sum::<u64>(), len);
                // Every byte of an unallocated extent is zero.
                let mut p = off;
                for e in &r.extents {
                    if !e.allocated {
                        assert!(
                            model[p as usize..(p + e.length) as usize].iter().all(|&b| b == 0),
                            "hole at {p} is not zero in the model"
                        );
                    }
                    p += e.length;
                }
            }
            Op::Flush => rt.block_on(v.flush()).unwrap(),
            Op::Reopen { clean } => {
                rt.block_on(v.flush()).unwrap();
                drop(v);
                if clean {
                    pool.close().unwrap();
                } else {
                    drop(pool);
                    // Let the committer notice the drop.
                    std::thread::sleep(std::time::Duration::from_millis(250));
                }
                assert_clean(dir.path());
                pool = Pool::open(&pool_path(dir.path())).unwrap();
            }
        }
    }
    // Full comparison at the end, after a crash-style reopen.
    let v = pool.volume("v").unwrap();
    rt.block_on(v.flush()).unwrap();
    drop(v);
    drop(pool);
    std::thread::sleep(std::time::Duration::from_millis(250));
    assert_clean(dir.path());
    let pool = Pool::open(&pool_path(dir.path())).unwrap();
    let v = pool.volume("v").unwrap();
    let mut off = 0;
    while off < VOL {
        let len = (VOL - off).min(MIB);
        assert_eq!(rt.block_on(read(&v, off, len)), &model[off as usize..(off + len) as usize], "final read at {off}");
        off += len;
    }
    // Space accounting: allocated bytes never exceed the written footprint's units.
    let info = pool.volume_info("v").unwrap();
    assert!(info.allocated <= VOL.div_ceil(65536) * 65536);
    drop(v); // the pool file stays open (and locked) while any handle lives
    pool.close().unwrap();
    assert_clean(dir.path());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 200, ..ProptestConfig::default() })]
    #[test]
    fn volume_matches_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops);
    }
}
