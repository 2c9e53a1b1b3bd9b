//! Power-loss simulation: random workloads over several volumes (writes of many sizes,
//! FUA, flush, trim, write zeroes, snapshot create and delete, clone, grow, attach and
//! detach, close and reopen, pool grow) run on a pool whose io_uring records every completed write and flush
//! (`storage_engine::testing::IoLog`). Then, at many cut points, the image a power cut
//! would leave is built (flushed and FUA writes kept, every other write kept, lost or
//! torn at random) and checked:
//! - `check` finds nothing wrong (no unit referenced twice or lost, checksums good);
//! - the pool opens, and holds exactly the volumes and snapshots it must (and at most
//!   those that may exist);
//! - every 512-byte sector of every volume and snapshot reads back as one of the values
//!   the durability contract allows: the value at the last flush (or snapshot, clone,
//!   close) that completed before the cut, a FUA write's value once acknowledged, or
//!   the value of any write issued after that point;
//! - each volume is attached to exactly the nodes it must be (an attach or detach
//!   that returned before the cut holds, one in progress may or may not), read-only as
//!   asked; a volume that counts as pristine reads as zeros, and a clone or snapshot of
//!   a volume that held written data never does.
//!
//! `POWER_LOSS_CUTS` sets the cut points per seed (default 500); each run uses the
//! fixed seed and one random seed, printed on failure. `POWER_LOSS_SEED` replays one:
//! the same operations (each workload's come from the seed and its number), though
//! not always the same I/O log, whose order of completions and background commits
//! depends on timing. `POWER_LOSS_DEBUG` prints the failing workload's history and
//! `POWER_LOSS_KEEP=DIR` keeps the failing cut's image there.
//! `scripts/power-loss-long.sh` runs 100,000 cut points.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

use common::*;
use storage_engine::testing::{IoLog, Rng};
use storage_engine::{IoOptions, Pool, PoolOptions};
const POOL_SIZE: u64 = 16 * MIB;
const UNIT: u32 = 16 * 1024;
const VOL_SIZE: u64 = 256 * 1024;
const MAX_VOL_SIZE: u64 = 512 * 1024;
const OPS_PER_WORKLOAD: usize = 120;
const WORKLOADS_PER_SEED: usize = 4;
const FIXED_SEED: u64 = 0x5eed_f00d_2026;

/// One operation of a workload, as the model needs it.
#[derive(Debug, Clone)]
enum Op {
    CreateVolume {
        name: String,
    },
    Write {
        name: String,
        sector: u64,
        tags: Vec<u64>,
        fua: bool,
    },
    Zero {
        name: String,
        sector: u64,
        count: u64,
        trim: bool,
    },
    Flush {
        name: String,
    },
    Snapshot {
        volume: String,
        full: String,
    },
    DeleteSnapshot {
        full: String,
    },
    Clone {
        source: String,
        name: String,
    },
    DeleteVolume {
        name: String,
    },
    Grow {
        name: String,
        size: u64,
    },
    Attach {
        name: String,
        node: String,
        read_only: bool,
    },
    Detach {
        name: String,
        node: String,
    },
    Reopen,
    /// The pool grows to `size` bytes (its file lengthened and synced first).
    GrowPool {
        size: u64,
    },
}

/// An operation and the span of the I/O log it ran over: `start` events were recorded
/// before it began, `end` when it returned.
#[derive(Debug)]
struct Done {
    op: Op,
    start: usize,
    end: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exists {
    Yes,
    Maybe,
}

/// What a volume or snapshot may look like after the cut.
#[derive(Debug, Clone)]
struct Expect {
    exists: Exists,
    sizes: BTreeSet<u64>,
    /// The value each sector had last (what a read before the cut returned).
    latest: Vec<u64>,
    /// The values each sector may hold after the cut.
    allowed: Vec<Vec<u64>>,
    /// Made by a clone or snapshot of a volume that held written data (so never
    /// pristine: the source's first mapping was logged before the share).
    cloned: bool,
    /// Nodes it must be attached to after the cut (with the read-only flag), and nodes
    /// it may be attached to.
    attached: BTreeMap<String, bool>,
    maybe_attached: BTreeMap<String, bool>,
}

impl Expect {
    fn new(exists: Exists, latest: Vec<u64>) -> Expect {
        let size = latest.len() as u64 * SECTOR;
        Expect {
            exists,
            sizes: [size].into(),
            allowed: latest.iter().map(|&t| vec![t]).collect(),
            latest,
            cloned: false,
            attached: BTreeMap::new(),
            maybe_attached: BTreeMap::new(),
        }
    }
    /// A durability point: everything written so far is on the medium.
    fn settle(&mut self) {
        self.allowed = self.latest.iter().map(|&t| vec![t]).collect();
    }
    fn put(&mut self, sector: u64, tag: u64, durable: bool) {
        let s = sector as usize;
        self.latest[s] = tag;
        if durable {
            self.allowed[s] = vec![tag];
        } else if !self.allowed[s].contains(&tag) {
            self.allowed[s].push(tag);
        }
    }
}

/// The model after a power cut behind the first `cut` log events.
fn expected(history: &[Done], cut: usize) -> BTreeMap<String, Expect> {
    let mut m: BTreeMap<String, Expect> = BTreeMap::new();
    for d in history.iter().take_while(|d| d.start < cut) {
        let done = d.end <= cut;
        match &d.op {
            Op::CreateVolume { name } => {
                let e = if done { Exists::Yes } else { Exists::Maybe };
                m.insert(name.clone(), Expect::new(e, vec![0; (VOL_SIZE / SECTOR) as usize]));
            }
            Op::Write { name, sector, tags, fua } => {
                let e = m.get_mut(name).unwrap();
                for (i, &t) in tags.iter().enumerate() {
                    e.put(sector + i as u64, t, done && *fua);
                }
            }
            Op::Zero { name, sector, count, .. } => {
                let e = m.get_mut(name).unwrap();
                for s in *sector..sector + count {
                    e.put(s, 0, false);
                }
            }
            Op::Flush { name } => {
                if done {
                    m.get_mut(name).unwrap().settle();
                }
            }
            Op::Snapshot { volume: source, full: name } | Op::Clone { source, name } => {
                let src = m.get_mut(source).unwrap();
                if done {
                    src.settle();
                }
                // If the new entry made it, the commit that recorded it had made the
                // source's data durable first: its content is the source's latest.
                let mut new = Expect::new(if done { Exists::Yes } else { Exists::Maybe }, src.latest.clone());
                new.sizes = [src.latest.len() as u64 * SECTOR].into();
                new.cloned = src.cloned || src.latest.iter().any(|&t| t != 0);
                m.insert(name.clone(), new);
            }
            Op::DeleteSnapshot { full: name } | Op::DeleteVolume { name } => {
                if done {
                    m.remove(name);
                } else {
                    m.get_mut(name).unwrap().exists = Exists::Maybe;
                }
            }
            Op::Grow { name, size } => {
                let e = m.get_mut(name).unwrap();
                let sectors = (size / SECTOR) as usize;
                e.latest.resize(sectors, 0);
                e.allowed.resize(sectors, vec![0]);
                if done {
                    e.sizes = [*size].into();
                } else {
                    e.sizes.insert(*size);
                }
            }
            Op::Attach { name, node, read_only } => {
                let e = m.get_mut(name).unwrap();
                if done {
                    e.maybe_attached.remove(node);
                    e.attached.insert(node.clone(), *read_only);
                } else {
                    e.maybe_attached.insert(node.clone(), *read_only);
                }
            }
            Op::Detach { name, node } => {
                let e = m.get_mut(name).unwrap();
                let ro = e.attached.remove(node).or(e.maybe_attached.remove(node)).unwrap();
                if !done {
                    e.maybe_attached.insert(node.clone(), ro);
                }
            }
            Op::Reopen => {
                if done {
                    m.values_mut().for_each(Expect::settle);
                }
            }
            // Not a flush: it changes no volume.
            Op::GrowPool { .. } => {}
        }
    }
    m
}

/// Runs one random workload on a fresh pool in `dir`; returns the pool image it started
/// from, the I/O log, and the history.
fn workload(dir: &Path, rng: &mut Rng) -> (Vec<u8>, Vec<storage_engine::testing::IoEvent>, Vec<Done>) {
    let rt = rt();
    let path = pool_path(dir);
    let opts = PoolOptions { size: POOL_SIZE, unit_size: UNIT, ..Default::default() };
    Pool::create(&path, &opts).unwrap().close().unwrap();
    let base = std::fs::read(&path).unwrap();
    let log = Arc::new(IoLog::new());
    let io = IoOptions { observer: Some(log.clone()), ..Default::default() };
    let mut pool = Some(Pool::open_with(&path, &io).unwrap());

    let mut history: Vec<Done> = Vec::new();
    // name -> (size, is snapshot)
    let mut live: BTreeMap<String, (u64, bool)> = BTreeMap::new();
    // volume -> the nodes it is attached to
    let mut attached: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut n = 0u64;
    let mut pool_size = POOL_SIZE;
    let run = |op: Op, pool: &mut Option<Pool>, history: &mut Vec<Done>| {
        let start = log.len();
        let p = pool.as_ref().unwrap();
        match &op {
            Op::CreateVolume { name } => {
                rt.block_on(p.create_volume(name, VOL_SIZE)).unwrap();
            }
            Op::Write { name, sector, tags, fua } => {
                let data: Vec<u8> = tags.iter().flat_map(|&t| sector_bytes(t)).collect();
                rt.block_on(write(&p.volume(name).unwrap(), sector * SECTOR, &data, *fua)).unwrap();
            }
            Op::Zero { name, sector, count, trim } => {
                let v = p.volume(name).unwrap();
                let (off, len) = (sector * SECTOR, count * SECTOR);
                if *trim {
                    rt.block_on(v.trim(off, len, false)).unwrap();
                } else {
                    rt.block_on(v.write_zeroes(off, len, false, false)).unwrap();
                }
            }
            Op::Flush { name } => {
                rt.block_on(p.volume(name).unwrap().flush()).unwrap();
            }
            Op::Snapshot { volume, full } => {
                let snap = full.split_once('@').unwrap().1;
                rt.block_on(p.create_snapshot(volume, snap)).unwrap();
            }
            Op::DeleteSnapshot { full } => {
                let (v, s) = full.split_once('@').unwrap();
                rt.block_on(p.delete_snapshot(v, s)).unwrap();
            }
            Op::Clone { source, name } => {
                rt.block_on(p.clone_volume(source, name)).unwrap();
            }
            Op::DeleteVolume { name } => {
                rt.block_on(p.delete_volume(name)).unwrap();
            }
            Op::Grow { name, size } => {
                rt.block_on(p.resize_volume(name, *size)).unwrap();
            }
            Op::Attach { name, node, read_only } => {
                let a = rt.block_on(p.attach(name, node, *read_only, false)).unwrap();
                assert_eq!((&a.node_id, a.read_only), (node, *read_only));
            }
            Op::Detach { name, node } => {
                assert!(rt.block_on(p.detach(name, node)).unwrap().is_some());
            }
            Op::Reopen => {
                pool.take().unwrap().close().unwrap();
                *pool = Some(Pool::open_with(&path, &io).unwrap());
            }
            Op::GrowPool { size } => {
                assert_eq!(rt.block_on(p.grow(Some(*size))).unwrap().size, *size);
            }
        }
        history.push(Done { op, start, end: log.len() });
    };

    for name in ["v0", "v1"] {
        run(Op::CreateVolume { name: name.into() }, &mut pool, &mut history);
        live.insert(name.into(), (VOL_SIZE, false));
    }
    while history.len() < OPS_PER_WORKLOAD {
        n += 1;
        let names: Vec<String> = live.keys().cloned().collect();
        let vols: Vec<String> = live.iter().filter(|(_, (_, s))| !s).map(|(k, _)| k.clone()).collect();
        let snaps: Vec<String> = live.iter().filter(|(_, (_, s))| *s).map(|(k, _)| k.clone()).collect();
        let pick = |rng: &mut Rng, v: &[String]| v[rng.below(v.len() as u64) as usize].clone();
        let r = rng.below(100);
        let op = if r < 45 || vols.is_empty() {
            if vols.is_empty() {
                let name = format!("n{n}");
                live.insert(name.clone(), (VOL_SIZE, false));
                Op::CreateVolume { name }
            } else {
                let name = pick(rng, &vols);
                let sectors = live[&name].0 / SECTOR;
                // Mostly small writes, some of several units; sector-aligned, often not 4 KiB-aligned.
                let count = if rng.chance(80) { 1 + rng.below(16) } else { 1 + rng.below(128) };
                let sector = rng.below(sectors - count.min(sectors) + 1);
                let count = count.min(sectors - sector);
                let tags = (0..count).map(|i| ((n + 1) << 32) | (sector + i)).collect();
                Op::Write { name, sector, tags, fua: rng.chance(20) }
            }
        } else if r < 57 {
            let name = pick(rng, &vols);
            let sectors = live[&name].0 / SECTOR;
            let count = (1 + rng.below(96)).min(sectors);
            let sector = rng.below(sectors - count + 1);
            Op::Zero { name, sector, count, trim: rng.chance(70) }
        } else if r < 70 {
            Op::Flush { name: pick(rng, &vols) }
        } else if r < 78 && live.len() < 10 {
            let volume = pick(rng, &vols);
            let full = format!("{volume}@s{n}");
            live.insert(full.clone(), (live[&volume].0, true));
            Op::Snapshot { volume, full }
        } else if r < 83 && !snaps.is_empty() {
            let full = pick(rng, &snaps);
            live.remove(&full);
            Op::DeleteSnapshot { full }
        } else if r < 88 && live.len() < 10 {
            let source = pick(rng, &names);
            let name = format!("c{n}");
            live.insert(name.clone(), (live[&source].0, false));
            Op::Clone { source, name }
        } else if r < 91 && vols.len() > 1 {
            let name = pick(rng, &vols);
            // An attached volume is detached first (a delete is refused while attached).
            if let Some(node) = attached.get_mut(&name).and_then(|n| n.pop_first()) {
                Op::Detach { name, node }
            } else {
                live.remove(&name);
                Op::DeleteVolume { name }
            }
        } else if r < 95 {
            let name = pick(rng, &vols);
            let size = (live[&name].0 + 64 * 1024 + 4096).min(MAX_VOL_SIZE);
            if size == live[&name].0 {
                continue;
            }
            live.get_mut(&name).unwrap().0 = size;
            Op::Grow { name, size }
        } else if r < 97 {
            let name = pick(rng, &vols);
            let nodes = attached.entry(name.clone()).or_default();
            match nodes.first().cloned().filter(|_| rng.chance(40)) {
                Some(node) => {
                    nodes.remove(&node);
                    Op::Detach { name, node }
                }
                None => {
                    let node = format!("node-{}", rng.below(4));
                    if !nodes.insert(node.clone()) {
                        continue;
                    }
                    Op::Attach { name, node, read_only: rng.chance(30) }
                }
            }
        } else if r < 98 {
            Op::Reopen
        } else if pool_size < 2 * POOL_SIZE {
            pool_size += 4 * MIB;
            Op::GrowPool { size: pool_size }
        } else {
            continue;
        };
        run(op, &mut pool, &mut history);
    }
    // Whatever the committer does later is not part of the run.
    let events = log.events();
    drop(pool);
    // A grow lengthens the file and syncs it before any superblock names the new size
    // (the ring records neither): every cut image has the final length, its new
    // range holding what the ring wrote there.
    let mut base = base;
    base.resize(pool_size as usize, 0);
    (base, events, history)
}

/// Writes the image a power cut behind `cut` events leaves to `image` and checks it.
fn check_cut(
    image: &Path,
    base: &[u8],
    events: &[storage_engine::testing::IoEvent],
    history: &[Done],
    cut: usize,
    rng: &mut Rng,
) {
    cut_image(image, base, events, cut, rng);
    let problems = storage_engine::check(image).unwrap().problems;
    assert!(problems.is_empty(), "check after the cut: {problems:?}");

    let rt = rt();
    let log = Arc::new(IoLog::new());
    let io = IoOptions { observer: Some(log.clone()), ..Default::default() };
    let pool = Pool::open_with(image, &io).unwrap_or_else(|e| panic!("the pool does not open after the cut: {e}"));
    let model = expected(history, cut);
    let present: BTreeSet<String> =
        pool.list_volumes().into_iter().chain(pool.list_snapshots(None)).map(|v| v.name).collect();
    for (name, e) in &model {
        if e.exists == Exists::Yes {
            assert!(present.contains(name), "{name} must exist after the cut; present: {present:?}");
        }
    }
    for name in &present {
        let e = model.get(name).unwrap_or_else(|| panic!("{name} exists after the cut but must not"));
        let v = pool.volume(name).unwrap();
        let size = v.size();
        assert!(e.sizes.contains(&size), "{name}: size {size}, allowed {:?}", e.sizes);
        let info = pool.volume_info(name).unwrap();
        let found: BTreeMap<String, bool> = info.attachments.iter().map(|a| (a.node_id.clone(), a.read_only)).collect();
        for (node, ro) in &e.attached {
            assert_eq!(found.get(node), Some(ro), "{name} must be attached to {node} (read-only {ro}): {found:?}");
        }
        for (node, ro) in &found {
            let allowed = e.attached.get(node).or(e.maybe_attached.get(node));
            assert_eq!(allowed, Some(ro), "{name} is attached to {node} (read-only {ro}) but must not be");
        }
        assert!(!(e.cloned && info.pristine), "{name} was shared from written data but counts as pristine");
        let data = rt.block_on(read(&v, 0, size));
        if info.pristine {
            assert!(data.iter().all(|&b| b == 0), "{name} counts as pristine but holds data");
        }
        for (s, bytes) in data.chunks(SECTOR as usize).enumerate() {
            let tag = sector_tag(bytes);
            assert!(
                tag.is_some_and(|t| e.allowed[s].contains(&t)),
                "{name} sector {s}: holds {} but may only hold {:x?}",
                tag.map_or("bytes no write produced".to_string(), |t| format!("{t:x}")),
                e.allowed[s]
            );
        }
    }
    if rng.chance(20) {
        second_cut(image, pool, &log, rng);
    }
}

/// A second life after the cut: the pool opened from the cut image (which wrote no
/// checkpoint unless something lay past the end of its log, docs/on-disk-format.md
/// 7.6) makes a volume, writes and flushes, writes more, and loses power again: the
/// image that leaves checks clean and opens, the volume exists once its creation
/// returned, flushed sectors hold what was written, the others that or zeros.
fn second_cut(image: &Path, pool: Pool, log: &IoLog, rng: &mut Rng) {
    let rt = rt();
    let base = std::fs::read(image).unwrap();
    let start = log.len();
    rt.block_on(pool.create_volume("second", VOL_SIZE)).unwrap();
    let created = log.len() - start;
    let v = pool.volume("second").unwrap();
    let tag = |s: u64| (0xfeed_u64 << 40) | s;
    let data = |from: u64| (from..from + 16).flat_map(|s| sector_bytes(tag(s))).collect::<Vec<u8>>();
    rt.block_on(write(&v, 0, &data(0), false)).unwrap();
    rt.block_on(v.flush()).unwrap();
    let flushed = log.len() - start;
    rt.block_on(write(&v, 16 * SECTOR, &data(16), false)).unwrap();
    let events = log.events()[start..].to_vec();
    drop(v);
    drop(pool);
    let cut = rng.below(events.len() as u64 + 1) as usize;
    let image2 = image.with_extension("second.img");
    cut_image(&image2, &base, &events, cut, rng);
    let problems = storage_engine::check(&image2).unwrap().problems;
    assert!(problems.is_empty(), "check after the second cut at {cut}: {problems:?}");
    let pool =
        Pool::open(&image2).unwrap_or_else(|e| panic!("the pool does not open after the second cut at {cut}: {e}"));
    let Ok(v) = pool.volume("second") else {
        assert!(cut < created, "the volume made before the second cut ({cut} of {created}) is gone");
        return;
    };
    let got = rt.block_on(read(&v, 0, 32 * SECTOR));
    for (s, bytes) in got.chunks(SECTOR as usize).enumerate() {
        let s = s as u64;
        let found = sector_tag(bytes);
        let ok = found == Some(tag(s)) || (found == Some(0) && !(s < 16 && cut >= flushed));
        assert!(ok, "second cut at {cut} (flush done at {flushed}): sector {s} holds {found:x?}");
    }
}

/// The generator of workload `w` of `seed` (its operations), or of its cuts: each
/// depends on the seed and the workload's number only, so that a replay runs the same
/// operations even though the I/O log (and so the cuts' draws) differ with timing.
fn workload_rng(seed: u64, w: usize, cuts: bool) -> Rng {
    let salt = (w as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ if cuts { 0xc0ff_ee00_c0ff_ee00 } else { 0 };
    let mut rng = Rng::new(seed ^ salt);
    rng.next_u64();
    rng
}

fn run_seed(seed: u64, cuts: usize) {
    // The long mode (many cuts) spreads them over more workloads, 125 cuts each.
    let (workloads, per_workload, budget) = cut_plan(cuts, WORKLOADS_PER_SEED, 125);
    let started = std::time::Instant::now();
    let mut ran = 0;
    for w in 0..workloads {
        if budget.is_some_and(|b| started.elapsed() >= b) {
            break;
        }
        ran += 1;
        let dir = tempfile::tempdir().unwrap();
        let (base, events, history) = workload(dir.path(), &mut workload_rng(seed, w, false));
        let mut rng = workload_rng(seed, w, true);
        let image = dir.path().join("cut.img");
        for i in 0..per_workload {
            // Spread the cuts over the whole log, plus the very end.
            let cut = if i == 0 { events.len() } else { rng.below(events.len() as u64 + 1) as usize };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                check_cut(&image, &base, &events, &history, cut, &mut rng)
            }));
            if let Err(e) = r {
                if let Some(keep) = std::env::var_os("POWER_LOSS_KEEP") {
                    // The image of the failing cut, for `ferrovol check` and a closer look.
                    let kept = Path::new(&keep).join(format!("power-loss-{seed:x}-{w}-{cut}.img"));
                    let _ = std::fs::copy(&image, &kept);
                    let _ = writeln!(std::io::stderr(), "power-loss: the failing image is kept as {}", kept.display());
                }
                if std::env::var_os("POWER_LOSS_DEBUG").is_some() {
                    for d in &history {
                        let op = match &d.op {
                            Op::Write { name, sector, tags, fua } => {
                                format!(
                                    "Write {name} sectors {sector}+{} fua {fua} tag {:x}",
                                    tags.len(),
                                    tags[0] >> 32
                                )
                            }
                            other => format!("{other:?}"),
                        };
                        eprintln!("[{:5}..{:5}] {op}", d.start, d.end);
                    }
                }
                let _ = writeln!(
                    std::io::stderr(),
                    "power-loss failure: seed {seed:#x}, workload {w}, cut {cut} of {} events; replay with POWER_LOSS_SEED={seed:#x}",
                    events.len()
                );
                std::panic::resume_unwind(e);
            }
        }
    }
    eprintln!(
        "power-loss: seed {seed:#x}: {} cut points over {ran} workloads, each recovered and checked, in {:.0?}",
        per_workload * ran,
        started.elapsed()
    );
}

#[test]
fn power_cuts_keep_flushed_data_and_consistent_metadata() {
    let cuts: usize = std::env::var("POWER_LOSS_CUTS").ok().and_then(|s| s.parse().ok()).unwrap_or(500);
    if let Ok(seed) = std::env::var("POWER_LOSS_SEED") {
        let seed = u64::from_str_radix(seed.trim_start_matches("0x"), 16).expect("POWER_LOSS_SEED is hex");
        run_seed(seed, cuts);
        return;
    }
    run_seed(FIXED_SEED, cuts);
    let random = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("power-loss: random seed {random:#x}");
    run_seed(random, cuts);
}

/// A full pool grows and its new units take writes: a power cut anywhere from before
/// the grow to after the flush that follows leaves a pool that `check` passes and that
/// opens with every sector written before the grow (flushed then) intact, and every
/// sector written after it either as written or, before the flush completed, as before.
/// The new units are only used once the superblocks naming them are durable: a grow
/// that used them first would leave units past the pool's end mapped.
#[test]
fn a_full_pool_grown_keeps_what_it_holds_and_what_its_new_units_take() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let path = pool_path(dir.path());
    let opts = PoolOptions { size: POOL_SIZE, unit_size: UNIT, ..Default::default() };
    Pool::create(&path, &opts).unwrap().close().unwrap();
    let base = std::fs::read(&path).unwrap();
    let log = Arc::new(IoLog::new());
    let io = IoOptions { observer: Some(log.clone()), ..Default::default() };
    let pool = Pool::open_with(&path, &io).unwrap();
    rt.block_on(pool.create_volume("v", 4 * POOL_SIZE)).unwrap();
    let v = pool.volume("v").unwrap();
    let piece = u64::from(UNIT);
    let tags = |piece_no: u64| -> Vec<u8> {
        (0..piece / SECTOR).flat_map(|s| sector_bytes(((piece_no + 1) << 32) | s)).collect()
    };
    let mut filled = 0;
    while rt.block_on(write(&v, filled * piece, &tags(filled), false)).is_ok() {
        filled += 1;
    }
    rt.block_on(v.flush()).unwrap();
    let grow_starts = log.len();
    assert_eq!(rt.block_on(pool.grow(Some(2 * POOL_SIZE))).unwrap().size, 2 * POOL_SIZE);
    let mut more = 0;
    while more < filled / 2 {
        rt.block_on(write(&v, (filled + more) * piece, &tags(filled + more), false))
            .unwrap_or_else(|e| panic!("a write into the grown pool: {e}"));
        more += 1;
    }
    let flush_starts = log.len();
    rt.block_on(v.flush()).unwrap();
    let flushed = log.len();
    let events = log.events();
    drop(v);
    drop(pool);
    let mut base = base;
    base.resize(2 * POOL_SIZE as usize, 0);
    let image = dir.path().join("cut.img");
    let mut rng = Rng::new(FIXED_SEED);
    let cuts: Vec<usize> =
        (grow_starts..=flushed).step_by(((flushed - grow_starts) / 60).max(1)).chain([flushed]).collect();
    for cut in cuts {
        cut_image(&image, &base, &events, cut, &mut rng);
        let problems = storage_engine::check(&image).unwrap().problems;
        assert!(problems.is_empty(), "check after a cut at {cut}: {problems:?}");
        let pool = Pool::open(&image).unwrap_or_else(|e| panic!("the pool does not open after a cut at {cut}: {e}"));
        let v = pool.volume("v").unwrap();
        for p in 0..filled + more {
            let data = rt.block_on(read(&v, p * piece, piece));
            let want = tags(p);
            let may_be_zero = p >= filled && cut < flushed;
            assert!(
                data == want || (may_be_zero && data.iter().all(|&b| b == 0)),
                "piece {p} after a cut at {cut} (grow from {grow_starts}, flush {flush_starts}..{flushed}): wrong data"
            );
        }
        drop(v);
        pool.close().unwrap();
    }
}
