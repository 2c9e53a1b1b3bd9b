//! Test utilities: a power-loss simulator for the pool's storage.
//!
//! Lives here: [`Rng`], a seedable generator for randomized tests; two observers of the
//! pool's io_uring (`IoObserver`, set with [`IoOptions::observer`](crate::IoOptions)):
//! [`Faults`], which makes chosen pool writes or flushes fail, and [`IoLog`], which
//! records every write and `fdatasync` that reached the pool file, in the order the
//! kernel completed them ([`Both`] joins the two); and
//! [`power_cut_writes`], which picks from such a log the writes that a power cut at a
//! chosen instant would leave on the medium. Not here: the workloads and checks that use
//! them (the engine's `tests/power_loss.rs`).
//!
//! # The model of a disk with a volatile write cache
//! A write that completed before an `fdatasync` was *submitted* is durable once that
//! `fdatasync` completes. A write submitted with `RWF_DSYNC` is durable when it
//! completes. Every other write that completed before the cut may or may not be on the
//! medium, independently of the others, and one that is may be torn: all of it but its
//! last 512-byte sector. Writes still in flight at the cut never completed, so they are
//! not in the log; a real disk might hold part of them, which is the same case as a
//! completed but unflushed write that is torn or lost.

use parking_lot::Mutex;

/// Size in bytes of the unit a torn write loses: one sector.
pub const SECTOR: usize = 512;

/// One entry of an [`IoLog`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoEvent {
    /// A write completed: `data` now lies at byte `offset` of the pool file (in the
    /// page cache or the device's volatile cache unless `dsync`).
    Write {
        /// Byte offset in the pool file.
        offset: u64,
        /// The bytes written.
        data: Vec<u8>,
        /// Written with `RWF_DSYNC`: durable on completion.
        dsync: bool,
    },
    /// An `fdatasync` was submitted; `id` pairs it with its [`IoEvent::FlushDone`].
    FlushStarted {
        /// Number of this flush in the log.
        id: u64,
    },
    /// The `fdatasync` numbered `id` completed successfully.
    FlushDone {
        /// Number of this flush in the log.
        id: u64,
    },
}

/// The writes and flushes that reached a pool file, in completion order.
#[derive(Debug, Default)]
pub struct IoLog {
    inner: Mutex<(Vec<IoEvent>, u64)>,
}

impl IoLog {
    /// An empty log.
    pub fn new() -> IoLog {
        IoLog::default()
    }

    /// Number of events so far: a *cut point* `k` means "power lost after the first `k`
    /// events".
    pub fn len(&self) -> usize {
        self.inner.lock().0.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the events so far.
    pub fn events(&self) -> Vec<IoEvent> {
        self.inner.lock().0.clone()
    }

    fn write_done(&self, offset: u64, data: &[u8], dsync: bool) {
        self.inner.lock().0.push(IoEvent::Write { offset, data: data.to_vec(), dsync });
    }

    fn flush_started(&self) -> u64 {
        let mut g = self.inner.lock();
        g.1 += 1;
        let id = g.1;
        g.0.push(IoEvent::FlushStarted { id });
        id
    }

    fn flush_done(&self, id: u64) {
        self.inner.lock().0.push(IoEvent::FlushDone { id });
    }
}

/// Injected I/O errors: completions of pool writes or `fdatasync`s turned into `EIO`
/// (the write may have reached the file; the engine must not rely on it either way);
/// and `fdatasync` completions held back from their callers, to order concurrent
/// flushes in a test without relying on how long the disk takes.
#[derive(Default)]
pub struct Faults {
    /// Data or metadata writes to let through before every later one fails; `None`:
    /// none fails.
    writes_left: Mutex<Option<u64>>,
    /// Fail every `fdatasync`.
    flushes: std::sync::atomic::AtomicBool,
    /// Fail the next `fdatasync` to complete, once.
    next_flush: std::sync::atomic::AtomicBool,
    /// While `Some`: completed `fdatasync`s not yet reported to their callers (each
    /// entry reports one), until [`Faults::release_flushes`].
    held: Mutex<Option<Vec<FlushReport>>>,
}

use crate::io::{Dir, FlushReport, IoObserver};

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("writes_left", &self.writes_left)
            .field("flushes", &self.flushes)
            .field("next_flush", &self.next_flush)
            .field("held", &self.held.lock().as_ref().map(Vec::len))
            .finish()
    }
}

impl Faults {
    /// No faults until armed.
    pub fn new() -> Faults {
        Faults::default()
    }

    /// Every write after the next `n` fails with `EIO`.
    pub fn fail_writes_after(&self, n: u64) {
        *self.writes_left.lock() = Some(n);
    }

    /// Every `fdatasync` from now on fails with `EIO`.
    pub fn fail_flushes(&self) {
        self.flushes.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The next `fdatasync` to complete fails with `EIO`; later ones succeed (a
    /// writeback error, which the kernel reports to one `fdatasync` only).
    pub fn fail_next_flush(&self) {
        self.next_flush.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many completed `fdatasync`s are held back from their callers now.
    pub fn held_flushes(&self) -> usize {
        self.held.lock().as_ref().map_or(0, Vec::len)
    }

    /// From now on, every `fdatasync` completes in the kernel as usual but its caller
    /// is told only at [`Faults::release_flushes`].
    pub fn hold_flushes(&self) {
        self.held.lock().get_or_insert_with(Vec::new);
    }

    /// Reports every held `fdatasync` completion to its caller, in completion order,
    /// and stops holding them.
    pub fn release_flushes(&self) {
        let held = self.held.lock().take().unwrap_or_default();
        for report in held {
            report();
        }
    }

    /// Keeps `report` (the report of a completed `fdatasync`) until
    /// [`Faults::release_flushes`] if flushes are held; otherwise hands it back.
    fn hold_flush(&self, report: FlushReport) -> Option<FlushReport> {
        match &mut *self.held.lock() {
            Some(held) => {
                held.push(report);
                None
            }
            None => Some(report),
        }
    }

    fn fail_write(&self, dir: Dir) -> bool {
        if dir == Dir::Read {
            return false;
        }
        match &mut *self.writes_left.lock() {
            Some(0) => true,
            Some(n) => {
                *n -= 1;
                false
            }
            None => false,
        }
    }

    fn fail_flush(&self) -> bool {
        self.flushes.load(std::sync::atomic::Ordering::SeqCst)
            || self.next_flush.swap(false, std::sync::atomic::Ordering::SeqCst)
    }
}

impl IoObserver for IoLog {
    fn flush_submitted(&self) -> u64 {
        self.flush_started()
    }

    fn flush_done(&self, id: u64) {
        IoLog::flush_done(self, id);
    }

    fn written(&self, offset: u64, data: &[u8], dsync: bool) {
        self.write_done(offset, data, dsync);
    }
}

impl IoObserver for Faults {
    fn fail(&self, dir: Dir, flush: bool) -> bool {
        if flush {
            self.fail_flush()
        } else {
            self.fail_write(dir)
        }
    }

    fn report_flush(&self, report: FlushReport) -> Option<FlushReport> {
        self.hold_flush(report)
    }
}

/// Two observers of one ring: `A`'s decisions first (an injected fault is what `B`
/// then sees), both told of every event. For a log of the I/O with faults injected.
pub struct Both<A, B>(pub std::sync::Arc<A>, pub std::sync::Arc<B>);

impl<A: IoObserver, B: IoObserver> IoObserver for Both<A, B> {
    fn flush_submitted(&self) -> u64 {
        let id = self.0.flush_submitted();
        let other = self.1.flush_submitted();
        if id != 0 {
            id
        } else {
            other
        }
    }

    fn fail(&self, dir: Dir, flush: bool) -> bool {
        self.0.fail(dir, flush) || self.1.fail(dir, flush)
    }

    fn flush_done(&self, id: u64) {
        self.0.flush_done(id);
        self.1.flush_done(id);
    }

    fn written(&self, offset: u64, data: &[u8], dsync: bool) {
        self.0.written(offset, data, dsync);
        self.1.written(offset, data, dsync);
    }

    fn report_flush(&self, report: FlushReport) -> Option<FlushReport> {
        self.0.report_flush(report).and_then(|r| self.1.report_flush(r))
    }
}

/// xorshift64*: a small seedable generator for randomized tests and fuzz loops
/// (reproducible from its seed; not for anything that needs real randomness).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting from `seed` (0 is replaced by 1: the state must be non-zero).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An index in `[0, len)` (0 when `len` is 0).
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// True with a probability of `percent` in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What happens to a write that is not yet durable at the cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It never reached the medium.
    Lost,
    /// It reached the medium whole.
    Kept,
    /// It reached the medium except for its last sector (whole if it is one sector).
    Torn,
}

/// The writes a power cut after the first `cut` events of `events` leaves on the
/// medium, in the order to apply them over the image the log started from: every
/// durable write whole, and each other completed write as `fate` decides (called once
/// per such write, in log order). Returns `(offset, bytes)` pairs borrowing from
/// `events`.
pub fn power_cut_writes(events: &[IoEvent], cut: usize, mut fate: impl FnMut() -> Fate) -> Vec<(u64, &[u8])> {
    let events = &events[..cut.min(events.len())];
    // The writes that completed before the start of the last flush to complete.
    let mut durable_before = 0;
    for (i, e) in events.iter().enumerate() {
        if let IoEvent::FlushDone { id } = e {
            let start = events[..i]
                .iter()
                .position(|s| matches!(s, IoEvent::FlushStarted { id: sid } if sid == id))
                .expect("a flush completes after it starts");
            durable_before = durable_before.max(start);
        }
    }
    let mut out = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let IoEvent::Write { offset, data, dsync } = e else { continue };
        if i < durable_before || *dsync {
            out.push((*offset, &data[..]));
            continue;
        }
        match fate() {
            Fate::Lost => {}
            Fate::Kept => out.push((*offset, &data[..])),
            Fate::Torn => {
                let keep = if data.len() > SECTOR { (data.len() - 1) / SECTOR * SECTOR } else { data.len() };
                out.push((*offset, &data[..keep]));
            }
        }
    }
    out
}

/// A small pool image, written by a workload and left as a crash would (log not
/// checkpointed), shared by the calls of [`fuzz_pool_open`] in one process.
struct Template {
    /// Pool size in bytes.
    size: u64,
    /// The 4 KiB blocks holding anything but zeros: (block index, content).
    blocks: Vec<(u64, Vec<u8>)>,
}

fn template() -> &'static Template {
    static T: std::sync::OnceLock<Template> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        use crate::{Pool, PoolOptions};
        let dir = std::env::temp_dir().join(format!("ferrovol-fuzz-template-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("template dir");
        let path = dir.join("pool.img");
        let size = 16u64 << 20;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let pool = Pool::create(&path, &PoolOptions { size, unit_size: 16 * 1024, ..Default::default() })
            .expect("template pool");
        rt.block_on(async {
            pool.create_volume("a", 1 << 20).await.expect("volume a");
            pool.create_volume("b", 512 * 1024).await.expect("volume b");
            let put = |name: &str, off: u64, len: usize, byte: u8| {
                let v = pool.volume(name).expect("volume");
                let mut b = v.alloc_write_buf(off, len);
                b.as_mut().fill(byte);
                async move { v.write(off, b, false).await.expect("write") }
            };
            put("a", 0, 64 * 1024, 1).await;
            put("a", 200 * 1024, 5000, 2).await;
            pool.create_snapshot("a", "s").await.expect("snapshot");
            put("a", 8192, 4096, 3).await;
            pool.clone_volume("a@s", "c").await.expect("clone");
            put("b", 4096, 12 * 1024, 4).await;
            pool.flush().await.expect("flush");
            pool.volume("a").expect("a").trim(0, 16 * 1024, false).await.expect("trim");
            pool.flush().await.expect("flush");
        });
        drop(pool); // a crash: the log holds the last commits
        let bytes = std::fs::read(&path).expect("read template");
        let _ = std::fs::remove_dir_all(&dir);
        let blocks = bytes
            .chunks(4096)
            .enumerate()
            .filter(|(_, b)| b.iter().any(|&x| x != 0))
            .map(|(i, b)| (i as u64, b.to_vec()))
            .collect();
        Template { size, blocks }
    })
}

/// Fuzz target body: changes bytes of a valid pool image and opens it. `data` is read
/// in 5-byte steps: block selector (2 bytes, over the image's non-zero blocks), byte
/// offset in the block (2 bytes, modulo 4096), value XORed in (1 byte). Then `check`
/// runs and the pool is opened; if it opens, every volume and snapshot is read whole.
/// Errors are the expected outcome; a panic is a bug.
pub fn fuzz_pool_open(data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let t = template();
    let mut blocks = t.blocks.clone();
    for m in data.chunks_exact(5) {
        let b = usize::from(u16::from_le_bytes([m[0], m[1]])) % blocks.len();
        let off = usize::from(u16::from_le_bytes([m[2], m[3]])) % 4096;
        blocks[b].1[off] ^= m[4];
    }
    let dir = std::env::temp_dir().join(format!("ferrovol-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("fuzz dir");
    let path = dir.join("pool.img");
    {
        let f = std::fs::File::create(&path).expect("image");
        f.set_len(t.size).expect("size image");
        for (i, b) in &blocks {
            f.write_all_at(b, i * 4096).expect("write image");
        }
    }
    let _ = crate::check(&path);
    if let Ok(pool) = crate::Pool::open(&path) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let names = pool.list_volumes().into_iter().chain(pool.list_snapshots(None)).map(|v| v.name);
        for name in names.collect::<Vec<_>>() {
            if let Ok(v) = pool.volume(&name) {
                let _ = rt.block_on(v.read(0, v.size().min(4 << 20)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(offset: u64, byte: u8, len: usize, dsync: bool) -> IoEvent {
        IoEvent::Write { offset, data: vec![byte; len], dsync }
    }

    #[test]
    fn flushed_and_dsync_writes_are_durable_the_rest_follow_their_fate() {
        let ev = vec![
            w(0, 1, 4096, false),            // 0: before flush 1 started: durable once it is done
            IoEvent::FlushStarted { id: 1 }, // 1
            w(4096, 2, 4096, false),         // 2: completed during flush 1: not covered
            IoEvent::FlushDone { id: 1 },    // 3
            w(8192, 3, 4096, true),          // 4: dsync: durable
            w(12288, 4, 1024, false),        // 5: unflushed
        ];
        // Cut before flush 1 completes: nothing is durable yet.
        let got = power_cut_writes(&ev, 3, || Fate::Lost);
        assert!(got.is_empty(), "{got:?}");
        // After it: write 0 durable; 2 and 5 follow their fate, 4 is durable.
        let got: Vec<(u64, usize)> =
            power_cut_writes(&ev, 6, || Fate::Lost).iter().map(|(o, d)| (*o, d.len())).collect();
        assert_eq!(got, vec![(0, 4096), (8192, 4096)]);
        let got: Vec<(u64, usize)> =
            power_cut_writes(&ev, 6, || Fate::Torn).iter().map(|(o, d)| (*o, d.len())).collect();
        assert_eq!(got, vec![(0, 4096), (4096, 3584), (8192, 4096), (12288, 512)]);
        let mut n = 0;
        let got = power_cut_writes(&ev, 6, || {
            n += 1;
            Fate::Kept
        });
        assert_eq!((got.len(), n), (4, 2), "fate is asked once per non-durable write");
    }
}
