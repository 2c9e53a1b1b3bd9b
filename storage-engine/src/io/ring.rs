//! The io_uring of a pool: [`IoRing`], its lanes (one per data-plane runtime) and their
//! reapers, and [`IoObserver`], through which tests watch and steer its completions.
//! See the module docs of `io` for who owns a buffer while its I/O is in flight.
//! Not here: buffers (buf.rs), file helpers (file.rs).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::AlignedBuf;

/// One contiguous piece of a read or write: `len` bytes at byte `file_offset` of the
/// pool, to or from byte `buf_offset` of the buffer. With O_DIRECT all three are
/// multiples of 4096.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Byte offset in the pool file or device.
    pub file_offset: u64,
    /// Byte offset in the buffer (its full capacity, not the view).
    pub buf_offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Direction of a [`IoRing::rw`] request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Read from the pool into the buffer.
    Read,
    /// Write the buffer to the pool; `dsync` sets `RWF_DSYNC` (durable on completion, FUA).
    Write {
        /// Durable on completion.
        dsync: bool,
    },
}

/// The result of [`IoRing::rw`]: the buffer back, and the first error if any segment failed.
pub type RwResult = (AlignedBuf, io::Result<()>);

/// Where an [`IoRing`]'s completions are reaped.
#[derive(Debug, Clone, Default)]
pub enum Reaper {
    /// On the tokio runtime current at creation if it is multi-threaded (and has I/O
    /// enabled), else on a thread of the ring's own.
    #[default]
    Auto,
    /// On this runtime (which must have I/O enabled), whatever its flavour. For a
    /// current-thread runtime the caller promises that the runtime keeps being driven
    /// (a thread sits in `block_on`) for as long as the ring has I/O in flight, and
    /// that nothing blocks that thread waiting for the ring.
    Runtime(tokio::runtime::Handle),
    /// One ring per runtime, each reaped on its runtime (as [`Reaper::Runtime`], with the
    /// same promises). A submission made on the thread that reaps one of these rings
    /// goes to that ring, so its completion wakes the same thread; a submission from
    /// any other thread goes to the first. For a server with one current-thread
    /// runtime per core, each serving its own connections. An empty list is
    /// [`Reaper::Auto`].
    PerRuntime(Vec<tokio::runtime::Handle>),
}

/// How an [`IoRing`] is set up.
#[derive(Clone, Default)]
pub struct IoOptions {
    /// Where completions are reaped.
    pub reaper: Reaper,
    /// Watches every completed write and `fdatasync`, and may make them fail or hold
    /// their reports back: for tests (`testing::IoLog`, `testing::Faults`). `None` (the
    /// default) watches nothing.
    pub observer: Option<Arc<dyn IoObserver>>,
    /// Every submission enters the kernel at once, also on a runtime that reaps a
    /// lane, instead of one `io_uring_enter` per turn of that runtime's thread
    /// ([`IoRing::rw`]). Off by default; for comparing the two.
    pub immediate_enter: bool,
}

impl std::fmt::Debug for IoOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoOptions")
            .field("reaper", &self.reaper)
            .field("observer", &self.observer.is_some())
            .field("immediate_enter", &self.immediate_enter)
            .finish()
    }
}

/// Tells one `fdatasync`'s caller that it completed (and how).
pub type FlushReport = Box<dyn FnOnce() + Send>;

/// What an [`IoRing`] reports to an observer of its I/O, and what it lets one change:
/// for tests (the power-loss simulator's log and injected faults, in `testing`). Each
/// method has a default that does nothing. All but [`IoObserver::report_flush`] are
/// called with the ring's lock held: keep them short, and call no ring from them.
pub trait IoObserver: Send + Sync {
    /// An `fdatasync` is submitted; the number returned comes back in
    /// [`IoObserver::flush_done`].
    fn flush_submitted(&self) -> u64 {
        0
    }

    /// A segment of a request in direction `dir` (`flush`: an `fdatasync`) completed
    /// successfully in the kernel; returns true to make it fail with `EIO` instead.
    fn fail(&self, _dir: Dir, _flush: bool) -> bool {
        false
    }

    /// The `fdatasync` numbered `id` completed successfully.
    fn flush_done(&self, _id: u64) {}

    /// `data` reached byte `offset` of the pool file (with `RWF_DSYNC` if `dsync`).
    fn written(&self, _offset: u64, _data: &[u8], _dsync: bool) {}

    /// A completed `fdatasync` is about to be reported to its caller by `report`: an
    /// observer may keep it and run it later (`None`), or hand it back to run now.
    fn report_flush(&self, report: FlushReport) -> Option<FlushReport> {
        Some(report)
    }
}

/// An io_uring on one file, shared by every thread of the process; with
/// [`Reaper::PerRuntime`], one io_uring (*lane*) per runtime, behind the same calls.
///
/// # Who submits, who reaps
/// The caller's thread pushes the submission queue entries and enters the kernel itself
/// (under a short lock), so a request costs no hand-off to another thread on the way
/// in. Completions raise an eventfd registered with the ring; a *reaper* waits on it,
/// takes the completions, and resolves the callers' channels:
/// - with [`Reaper::Runtime`], or when the ring is created inside a multi-threaded
///   tokio runtime (with I/O enabled: `enable_io`/`enable_all`), the reaper is a
///   task on that runtime, so a completion wakes the runtime's own thread and the
///   request task it resolves runs there without a further thread switch. Never block
///   a worker thread of that runtime waiting for this ring (tokio already forbids
///   `blocking_recv` there); if the runtime shuts down first, a thread takes over;
/// - otherwise (no runtime, or a current-thread one, which a blocking wait would stall)
///   the reaper is a thread of its own.
///
/// Callers may wait for results from anywhere: `.await` in a task, or `blocking_recv`
/// on a plain thread (the committer does).
pub struct IoRing {
    /// Unique per ring set, to tell a thread's [`LANE`] entry for this ring set from
    /// another's.
    id: u64,
    /// One io_uring each; more than one only with [`Reaper::PerRuntime`].
    lanes: Vec<Lane>,
}

/// One io_uring of an [`IoRing`] and where its completions are reaped.
struct Lane {
    shared: Arc<Shared>,
    reaper_thread: Option<JoinHandle<()>>,
}

thread_local! {
    /// (ring set id, lane) of the lane whose reaper task runs on this thread: a
    /// submission from here goes to that lane.
    static LANE: std::cell::Cell<Option<(u64, usize)>> = const { std::cell::Cell::new(None) };
}

static NEXT_RING_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl IoRing {
    /// Sets up a ring of `entries` submission slots on `file` and its reaper (see
    /// [`Reaper`]).
    ///
    /// Errors: the kernel refused io_uring (e.g. `ENOSYS`, `EPERM` under a seccomp
    /// profile), or an eventfd or the reaper thread could not be made.
    pub fn new(file: Arc<File>, entries: u32, opts: &IoOptions) -> io::Result<IoRing> {
        let id = NEXT_RING_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let runtimes: Vec<Option<tokio::runtime::Handle>> = match &opts.reaper {
            Reaper::Runtime(h) => vec![Some(h.clone())],
            Reaper::PerRuntime(hs) if !hs.is_empty() => hs.iter().cloned().map(Some).collect(),
            Reaper::Auto | Reaper::PerRuntime(_) => vec![tokio::runtime::Handle::try_current()
                .ok()
                .filter(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)],
        };
        let mut ring = IoRing { id, lanes: Vec::with_capacity(runtimes.len()) };
        for (i, runtime) in runtimes.into_iter().enumerate() {
            // On error, dropping `ring` stops the lanes made so far.
            ring.lanes.push(Lane::new(file.clone(), entries, opts, runtime, (id, i))?);
        }
        Ok(ring)
    }

    /// The lane for a submission from this thread.
    fn lane(&self) -> &Shared {
        &self.lanes[self.lane_index()].shared
    }

    fn lane_index(&self) -> usize {
        match LANE.get() {
            Some((id, i)) if id == self.id => i,
            _ => 0,
        }
    }
}

impl Lane {
    fn new(
        file: Arc<File>,
        entries: u32,
        opts: &IoOptions,
        runtime: Option<tokio::runtime::Handle>,
        lane: (u64, usize),
    ) -> io::Result<Lane> {
        let mut ring = IoUring::new(entries)?;
        // SAFETY: eventfd returns a new fd we own, or -1 (checked).
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh, valid fd owned by nobody else.
        let efd = unsafe { OwnedFd::from_raw_fd(raw) };
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        let cq_room = ring.completion().capacity();
        let submitter = (runtime.is_some() && !opts.immediate_enter).then(|| Arc::new(Submitter::new(lane)));
        let shared = Arc::new(Shared {
            efd,
            submitter,
            enters: std::sync::atomic::AtomicU64::new(0),
            ring,
            state: Mutex::new(State {
                observer: opts.observer.clone(),
                file: Some(file),
                slots: Vec::new(),
                free_slots: Vec::new(),
                queued: VecDeque::new(),
                in_kernel: 0,
                cq_room,
                closing: false,
            }),
        });
        let reaper_thread = match runtime {
            Some(h) => {
                let _enter = h.enter();
                // SAFETY: EventFd holds an Arc<Shared>, which owns the eventfd, so the fd
                // stays open and the same for as long as the AsyncFd exists.
                let afd = unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(
                        EventFd(shared.clone()),
                        tokio::io::Interest::READABLE,
                    )
                }
                .map_err(io::Error::from)?;
                h.spawn(reap_task(shared.clone(), afd, lane));
                if let Some(s) = &shared.submitter {
                    // Enters the kernel for the entries submissions on this runtime's
                    // thread left in the submission queue ([`Shared::start`]).
                    let sh = shared.clone();
                    h.spawn(s.clone().run(move || sh.enter()));
                }
                None
            }
            None => Some(spawn_reaper_thread(shared.clone())?),
        };
        Ok(Lane { shared, reaper_thread })
    }
}

impl IoRing {
    /// Reads or writes `segs` between the pool and `buf`; resolves with the buffer and
    /// the first error (a short transfer is retried; end of file is `UnexpectedEof`).
    /// Panics if a segment lies outside the buffer (an engine bug).
    pub fn rw(&self, dir: Dir, buf: AlignedBuf, segs: Vec<Segment>) -> oneshot::Receiver<RwResult> {
        for s in &segs {
            assert!(s.buf_offset + s.len <= buf.capacity(), "segment outside buffer");
        }
        let (done, rx) = oneshot::channel();
        if segs.is_empty() {
            let _ = done.send((buf, Ok(())));
        } else {
            let n = segs.len();
            let f = InFlight {
                dir,
                buf: Some(buf),
                segs,
                outstanding: n,
                error: None,
                flush_id: 0,
                done: Some(RwDone::Rw(done)),
            };
            self.lane().start(f, (0..n).map(|i| i as u32));
        }
        rx
    }

    /// `fdatasync` of the pool file through the ring.
    pub fn fdatasync(&self) -> oneshot::Receiver<io::Result<()>> {
        let (done, rx) = oneshot::channel();
        let f = InFlight {
            dir: Dir::Read,
            buf: None,
            segs: Vec::new(),
            outstanding: 1,
            error: None,
            flush_id: 0,
            done: Some(RwDone::Fsync(done)),
        };
        self.lane().start(f, std::iter::once(FSYNC_SEG));
        rx
    }
}

impl Drop for Lane {
    /// Waits for every request still in the kernel (their buffers must outlive them),
    /// closes this ring's handle on the file, and stops the reaper.
    fn drop(&mut self) {
        self.shared.state.lock().closing = true;
        if let Some(s) = &self.shared.submitter {
            s.close();
        }
        loop {
            if self.shared.reap() {
                break;
            }
            // The reaper may consume the wake-up: poll with a timeout.
            wait_readable(self.shared.efd.as_raw_fd(), 10);
        }
        self.shared.state.lock().file = None;
        kick(self.shared.efd.as_raw_fd());
        if let Some(t) = self.reaper_thread.take() {
            let _ = t.join();
        }
    }
}

/// Segment index that marks an fdatasync entry.
const FSYNC_SEG: u32 = u32::MAX;

struct InFlight {
    dir: Dir,
    buf: Option<AlignedBuf>,
    segs: Vec<Segment>,
    outstanding: usize,
    error: Option<io::Error>,
    /// For an fdatasync: its number for the observer.
    flush_id: u64,
    done: Option<RwDone>,
}

enum RwDone {
    Rw(oneshot::Sender<RwResult>),
    Fsync(oneshot::Sender<io::Result<()>>),
}

impl RwDone {
    fn send(self, buf: Option<AlignedBuf>, result: io::Result<()>) {
        match (self, buf) {
            (RwDone::Rw(tx), Some(buf)) => {
                let _ = tx.send((buf, result));
            }
            (RwDone::Fsync(tx), _) => {
                let _ = tx.send(result);
            }
            (RwDone::Rw(_), None) => unreachable!("rw slot has a buffer"),
        }
    }
}

struct Shared {
    /// Registered with the ring: the kernel adds to it for every completion.
    efd: OwnedFd,
    /// For a lane reaped by a runtime's task (unless [`IoOptions::immediate_enter`]): the task
    /// that enters the kernel for that runtime's thread ([`Shared::start`]).
    submitter: Option<Arc<Submitter>>,
    /// `io_uring_enter` calls made ([`Shared::enter`]): for tests.
    enters: std::sync::atomic::AtomicU64,
    /// Its submission and completion queues are touched only under `state`'s lock;
    /// entering the kernel needs no lock.
    ring: IoUring,
    state: Mutex<State>,
}

struct State {
    observer: Option<Arc<dyn IoObserver>>,
    /// `None` once the ring is closing and idle.
    file: Option<Arc<File>>,
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    /// (slot, segment index) waiting for room in the submission or completion queue.
    queued: VecDeque<(usize, u32)>,
    /// Entries pushed and not yet completed.
    in_kernel: usize,
    /// Completion queue size: never more than this many entries in the kernel.
    cq_room: usize,
    closing: bool,
}

/// The atomics of the hand-over between submissions and a lane's submitter task: std's,
/// or shuttle's when the engine is built for the deterministic concurrency checks
/// (feature `shuttle`), so that its schedulers interleave threads at each of them, or
/// loom's (feature `loom`), so that its checker also lets a load read an older store
/// where the memory model allows it (`fence_model`).
mod hand_over {
    #[cfg(all(feature = "loom", not(feature = "shuttle")))]
    pub use loom::sync::atomic::{fence, AtomicBool};
    #[cfg(feature = "shuttle")]
    pub use shuttle::sync::atomic::{fence, AtomicBool};
    #[cfg(not(any(feature = "shuttle", feature = "loom")))]
    pub use std::sync::atomic::{fence, AtomicBool};
}

/// The task that enters the kernel once for the entries the tasks of its runtime's
/// thread pushed in one turn ([`Submitter::run`]), and the hand-over
/// of those entries to it ([`Submitter::hand_over`]).
///
/// The promise kept: every entry pushed into the submission queue is entered by the
/// submitter that was handed it, or by the one that pushed it, or by the task's last
/// enter when it ends (the lane closing, or its runtime shutting down). Checked over
/// explored schedules by `submit_model` (feature `shuttle`), and its fences against
/// store buffering by `fence_model` (feature `loom`).
pub(crate) struct Submitter {
    /// The lane whose reaper runs on that thread ([`LANE`]).
    lane: (u64, usize),
    /// Set (as a permit, so that many submissions wake it once) by a submission.
    wake: tokio::sync::Notify,
    /// False once the task is gone (its runtime shut down): submissions enter at once.
    alive: hand_over::AtomicBool,
    /// Set when the lane closes: the task ends.
    stop: hand_over::AtomicBool,
}

impl Submitter {
    pub(crate) fn new(lane: (u64, usize)) -> Submitter {
        Submitter {
            lane,
            wake: tokio::sync::Notify::new(),
            alive: hand_over::AtomicBool::new(true),
            stop: hand_over::AtomicBool::new(false),
        }
    }

    /// Called after a submission pushed entries into the submission queue, `on_lane`
    /// when the calling thread reaps this submitter's lane. True when the task takes
    /// them (it is woken); false when the caller must enter the kernel itself (another
    /// thread, or the task is gone).
    pub(crate) fn hand_over(&self, on_lane: bool) -> bool {
        if !on_lane {
            return false;
        }
        // The entries were pushed (the queue's tail stored) before `alive` is read, as
        // the ending task stores `alive` before its last enter reads the tail: a
        // full fence on each side, or both could read the old value (store buffering)
        // and leave the entries in the queue with nobody to enter them.
        hand_over::fence(Ordering::SeqCst);
        if !self.alive.load(Ordering::Relaxed) {
            return false;
        }
        self.wake.notify_one();
        true
    }

    /// Ends the task (the lane is closing): it enters once more and returns.
    pub(crate) fn close(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// The task, to spawn on the lane's runtime: `enter` once per wake-up, until
    /// [`Submitter::close`]. When it ends, or when it is dropped first (its runtime shut
    /// down, even before it was first polled), submissions enter at once from then on,
    /// and `enter` runs one last time for what was handed over before.
    pub(crate) fn run(
        self: Arc<Self>,
        enter: impl Fn() + Send + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        struct Gone<F: Fn()>(Arc<Submitter>, F);
        impl<F: Fn()> Drop for Gone<F> {
            fn drop(&mut self) {
                self.0.alive.store(false, Ordering::Relaxed);
                hand_over::fence(Ordering::SeqCst);
                (self.1)();
            }
        }
        // Made now, not at the first poll: a future dropped unpolled drops it too.
        let gone = Gone(self, enter);
        async move {
            loop {
                gone.0.wake.notified().await;
                if gone.0.stop.load(Ordering::Acquire) {
                    return;
                }
                (gone.1)();
            }
        }
    }
}

impl Shared {
    /// Registers `f`, queues its entries and submits what fits.
    ///
    /// On the thread that reaps this lane (a data-plane runtime's), the entries are
    /// left in the submission queue and the lane's submitter task woken: it runs after
    /// the tasks already woken on that thread, so one `io_uring_enter` takes the
    /// entries of every request a turn of the thread started (a connection reading
    /// many requests from one socket read) instead of one each. Elsewhere (the
    /// committer, a plain thread) the caller enters the kernel itself.
    fn start(&self, mut f: InFlight, segs: impl Iterator<Item = u32>) {
        let mut st = self.state.lock();
        if let (Some(observer), Some(RwDone::Fsync(_))) = (&st.observer, &f.done) {
            f.flush_id = observer.flush_submitted();
        }
        let slot = match st.free_slots.pop() {
            Some(i) => {
                st.slots[i] = Some(f);
                i
            }
            None => {
                st.slots.push(Some(f));
                st.slots.len() - 1
            }
        };
        st.queued.extend(segs.map(|s| (slot, s)));
        let enter = st.push_queued(&self.ring);
        drop(st);
        if enter {
            let handed = self.submitter.as_ref().is_some_and(|s| s.hand_over(LANE.get() == Some(s.lane)));
            if !handed {
                self.enter();
            }
        }
    }

    /// Submits whatever the submission queue holds, without the lock: the kernel takes
    /// what is there (another thread's entries too) under its own lock.
    fn enter(&self) {
        self.enters.fetch_add(1, Ordering::Relaxed);
        match self.ring.submit() {
            Ok(_) => {}
            Err(e) => {
                if !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY | libc::EINTR)) {
                    tracing::error!(error = %e, "io_uring_enter failed");
                }
                // Entries stay in the submission queue; the reaper retries on its next
                // round, which this wake-up starts even if nothing is in the kernel.
                kick(self.efd.as_raw_fd());
            }
        }
    }

    /// Takes every completion, submits what was waiting for room, and resolves the
    /// finished requests (outside the lock). True when the ring is closing and idle.
    fn reap(&self) -> bool {
        let mut finished = Vec::new();
        let (idle, enter, observer) = {
            let mut st = self.state.lock();
            // SAFETY: the completion queue is only accessed under the state lock.
            let cqes: Vec<(u64, i32)> =
                unsafe { self.ring.completion_shared() }.map(|c| (c.user_data(), c.result())).collect();
            for (ud, res) in cqes {
                st.in_kernel -= 1;
                if let Some(done) = st.complete(ud, res) {
                    finished.push(done);
                }
            }
            let enter = st.push_queued(&self.ring);
            (st.closing && st.in_kernel == 0 && st.queued.is_empty(), enter, st.observer.clone())
        };
        if enter {
            self.enter();
        }
        for (done, buf, result) in finished {
            match (&observer, &done) {
                (Some(observer), RwDone::Fsync(_)) => {
                    if let Some(report) = observer.report_flush(Box::new(move || done.send(buf, result))) {
                        report();
                    }
                }
                _ => done.send(buf, result),
            }
        }
        idle
    }
}

type Finished = (RwDone, Option<AlignedBuf>, io::Result<()>);

impl State {
    /// Pushes queued entries while the queues have room. True if the submission queue
    /// holds entries for the kernel (the caller enters after dropping the lock).
    fn push_queued(&mut self, ring: &IoUring) -> bool {
        let Some(file) = self.file.as_ref() else {
            return false;
        };
        // SAFETY: the submission queue is only accessed under the state lock (held by
        // the caller through `&mut self`).
        let mut sq = unsafe { ring.submission_shared() };
        let fd = types::Fd(file.as_raw_fd());
        while let Some(&(slot, seg)) = self.queued.front() {
            if self.in_kernel >= self.cq_room {
                break;
            }
            let Some(f) = self.slots[slot].as_mut() else {
                self.queued.pop_front();
                continue;
            };
            let entry = if seg == FSYNC_SEG {
                opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build()
            } else {
                let s = f.segs[seg as usize];
                let buf = f.buf.as_mut().expect("rw slot has a buffer");
                let ptr = buf.full_mut()[s.buf_offset..s.buf_offset + s.len].as_mut_ptr();
                match f.dir {
                    Dir::Read => opcode::Read::new(fd, ptr, s.len as u32).offset(s.file_offset).build(),
                    Dir::Write { dsync } => opcode::Write::new(fd, ptr, s.len as u32)
                        .offset(s.file_offset)
                        .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                        .build(),
                }
            };
            let entry = entry.user_data(((slot as u64) << 32) | u64::from(seg));
            // SAFETY: the buffer range lives in `self.slots[slot].buf`, which is not
            // dropped or moved out until this entry's completion is reaped (the heap
            // allocation does not move when the AlignedBuf struct moves), and IoRing's
            // Drop waits for every entry in the kernel; the file stays open through the
            // Arc<File> held in `self.file` until then.
            if unsafe { sq.push(&entry) }.is_err() {
                break;
            }
            self.in_kernel += 1;
            self.queued.pop_front();
        }
        sq.sync();
        !sq.is_empty()
    }

    /// Accounts one completion; returns the request if it is now finished.
    fn complete(&mut self, ud: u64, res: i32) -> Option<Finished> {
        let slot = (ud >> 32) as usize;
        let seg = (ud & 0xffff_ffff) as u32;
        let f = self.slots.get_mut(slot)?.as_mut()?;
        let mut res = res;
        if let (Some(observer), true) = (&self.observer, res >= 0) {
            if observer.fail(f.dir, seg == FSYNC_SEG) {
                res = -libc::EIO;
            }
        }
        if res < 0 {
            f.error.get_or_insert(io::Error::from_raw_os_error(-res));
        } else if seg == FSYNC_SEG {
            if let Some(observer) = &self.observer {
                observer.flush_done(f.flush_id);
            }
        } else {
            let n = res as usize;
            let s = &mut f.segs[seg as usize];
            if let (Some(observer), Dir::Write { dsync }, Some(buf)) = (&self.observer, f.dir, &f.buf) {
                observer.written(s.file_offset, &buf.full()[s.buf_offset..s.buf_offset + n.min(s.len)], dsync);
            }
            if n == 0 && s.len > 0 {
                f.error.get_or_insert(io::Error::new(io::ErrorKind::UnexpectedEof, "pool ends before the segment"));
            } else if n < s.len {
                // Short transfer: retry the remainder.
                s.file_offset += n as u64;
                s.buf_offset += n;
                s.len -= n;
                self.queued.push_back((slot, seg));
                return None;
            }
        }
        f.outstanding -= 1;
        if f.outstanding > 0 {
            return None;
        }
        let mut f = self.slots[slot].take().expect("slot present");
        self.free_slots.push(slot);
        let result = match f.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        let done = f.done.take()?;
        Some((done, f.buf.take(), result))
    }
}

/// The eventfd as an `AsRawFd` for tokio's `AsyncFd` (which must not close it).
struct EventFd(Arc<Shared>);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.efd.as_raw_fd()
    }
}

/// Reaper on a tokio runtime: woken through the runtime's own epoll.
async fn reap_task(shared: Arc<Shared>, afd: tokio::io::unix::AsyncFd<EventFd>, lane: (u64, usize)) {
    /// Hands the reaping to a thread if the task is dropped (runtime shutdown) while
    /// the ring still has work or may get more.
    struct Handover(Option<Arc<Shared>>);
    impl Drop for Handover {
        fn drop(&mut self) {
            if let Some(shared) = self.0.take() {
                if let Err(e) = spawn_reaper_thread(shared) {
                    tracing::error!(error = %e, "could not start the io_uring reaper thread");
                }
            }
        }
    }
    let mut handover = Handover(Some(shared.clone()));
    loop {
        // This thread reaps the lane: its submissions go there (set on every wake-up,
        // as a multi-threaded runtime may move the task).
        LANE.set(Some(lane));
        let mut ready = match afd.readable().await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "waiting for io_uring completions failed");
                return; // the handover thread carries on
            }
        };
        if !drain(shared.efd.as_raw_fd()) {
            ready.clear_ready();
        }
        if shared.reap() {
            handover.0 = None;
            return;
        }
    }
}

fn spawn_reaper_thread(shared: Arc<Shared>) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("ferrovol-io".into()).spawn(move || loop {
        if shared.reap() {
            return;
        }
        wait_readable(shared.efd.as_raw_fd(), -1);
        drain(shared.efd.as_raw_fd());
    })
}

/// Reads the eventfd's counter (resetting it). False when it was already zero.
fn drain(fd: RawFd) -> bool {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64 from an eventfd kept open by its owner.
    let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    n == 8
}

/// Waits until `fd` is readable or `timeout_ms` passes (-1: no timeout).
fn wait_readable(fd: RawFd, timeout_ms: i32) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack for the duration of the call.
    unsafe { libc::poll(&mut p, 1, timeout_ms) };
}

fn kick(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd its owner keeps open.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::open_pool_file;

    #[test]
    fn each_runtime_thread_submits_to_the_lane_it_reaps() {
        // Two current-thread runtimes on threads of their own, one lane each: a task on
        // the second submits to the second lane (reaped there); any other thread submits
        // to the first. Data written through one lane reads back through the other.
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = open_pool_file(&dir.path().join("f"), true).unwrap();
        f.set_len(1 << 20).unwrap();
        let runtime = || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let handle = rt.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            let t = std::thread::spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                })
            });
            (handle, stop, t)
        };
        let (a, stop_a, ta) = runtime();
        let (b, stop_b, tb) = runtime();
        let opts = IoOptions { reaper: Reaper::PerRuntime(vec![a.clone(), b.clone()]), ..Default::default() };
        let ring = Arc::new(IoRing::new(Arc::new(f), 8, &opts).unwrap());
        assert_eq!(ring.lanes.len(), 2);
        assert!(ring.lanes.iter().all(|l| l.reaper_thread.is_none()), "both reaped by their runtimes");
        let on = |h: &tokio::runtime::Handle, block: u8, write: bool| {
            let (tx, rx) = std::sync::mpsc::channel();
            let ring = ring.clone();
            h.spawn(async move {
                tokio::task::yield_now().await; // the reaper task has been polled
                let seg = Segment { file_offset: u64::from(block) * 4096, buf_offset: 0, len: 4096 };
                let mut buf = AlignedBuf::zeroed(4096);
                buf.full_mut().fill(if write { block } else { 0xee });
                let dir = if write { Dir::Write { dsync: false } } else { Dir::Read };
                let (back, r) = ring.rw(dir, buf, vec![seg]).await.unwrap();
                r.unwrap();
                tx.send((ring.lane_index(), back.full()[0])).unwrap();
            });
            rx.recv().unwrap()
        };
        assert_eq!(on(&b, 3, true), (1, 3), "written through the second lane");
        assert_eq!(on(&a, 5, true), (0, 5), "written through the first lane");
        assert_eq!(ring.lane_index(), 0, "a plain thread submits to the first lane");
        let seg = |block: u64| vec![Segment { file_offset: block * 4096, buf_offset: 0, len: 4096 }];
        let (back, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(4096), seg(3)).blocking_recv().unwrap();
        r.unwrap();
        assert!(back.full().iter().all(|&x| x == 3));
        assert_eq!(on(&b, 5, false), (1, 5), "read through the second lane");
        ring.fdatasync().blocking_recv().unwrap().unwrap();
        drop(ring);
        let _ = (stop_a.send(()), stop_b.send(()));
        ta.join().unwrap();
        tb.join().unwrap();
    }

    /// Requests a task on a data-plane runtime starts in one turn are submitted with
    /// one `io_uring_enter`, not one each; with `immediate_enter`, one each.
    #[test]
    fn a_runtime_turn_enters_the_kernel_once_for_its_submissions() {
        for immediate in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (f, _) = open_pool_file(&dir.path().join("f"), true).unwrap();
            f.set_len(1 << 20).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let opts = IoOptions {
                reaper: Reaper::PerRuntime(vec![rt.handle().clone()]),
                immediate_enter: immediate,
                ..Default::default()
            };
            let ring = Arc::new(IoRing::new(Arc::new(f), 64, &opts).unwrap());
            let enters = rt.block_on(async {
                tokio::task::yield_now().await; // the reaper task has been polled
                let before = ring.lanes[0].shared.enters.load(Ordering::Relaxed);
                let seg = |i: u64| vec![Segment { file_offset: i * 4096, buf_offset: 0, len: 4096 }];
                let pending: Vec<_> = (0..32).map(|i| ring.rw(Dir::Read, AlignedBuf::zeroed(4096), seg(i))).collect();
                for rx in pending {
                    rx.await.unwrap().1.unwrap();
                }
                ring.lanes[0].shared.enters.load(Ordering::Relaxed) - before
            });
            if immediate {
                assert!(enters >= 32, "one enter per request: {enters}");
            } else {
                assert!(enters <= 2, "32 requests of one turn: {enters} enters");
            }
            drop(ring);
            drop(rt);
        }
    }

    #[test]
    fn ring_writes_reads_and_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let (f, _) = open_pool_file(&p, true).unwrap();
        f.set_len(1 << 20).unwrap();
        let ring = IoRing::new(Arc::new(f), 8, &IoOptions::default()).unwrap();
        let mut buf = AlignedBuf::zeroed(64 * 1024);
        for (i, b) in buf.full_mut().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        // 16 segments, more than the ring has slots, scattered in the file.
        let segs: Vec<Segment> =
            (0..16).map(|i| Segment { file_offset: (15 - i) as u64 * 8192, buf_offset: i * 4096, len: 4096 }).collect();
        let (buf, r) = ring.rw(Dir::Write { dsync: false }, buf, segs.clone()).blocking_recv().unwrap();
        r.unwrap();
        ring.fdatasync().blocking_recv().unwrap().unwrap();
        let (back, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(64 * 1024), segs).blocking_recv().unwrap();
        r.unwrap();
        assert_eq!(back.full(), buf.full());
    }

    #[test]
    fn reaped_on_the_runtime_then_by_a_thread_after_it_stops() {
        // A ring made inside a multi-threaded runtime is reaped by a task there; many
        // concurrent requests all complete with the right data; when the runtime shuts
        // down, a thread takes over and blocking callers still get their results.
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = open_pool_file(&dir.path().join("f"), true).unwrap();
        f.set_len(1 << 20).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let ring = Arc::new(rt.block_on(async { IoRing::new(Arc::new(f), 8, &IoOptions::default()).unwrap() }));
        assert!(ring.lanes[0].reaper_thread.is_none(), "reaper is a runtime task");
        let tasks: Vec<_> = (0..64u8)
            .map(|i| {
                let ring = ring.clone();
                rt.spawn(async move {
                    let seg = Segment { file_offset: u64::from(i) * 4096, buf_offset: 0, len: 4096 };
                    let mut buf = AlignedBuf::zeroed(4096);
                    buf.full_mut().fill(i);
                    let (_, r) = ring.rw(Dir::Write { dsync: false }, buf, vec![seg]).await.unwrap();
                    r.unwrap();
                    let (back, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(4096), vec![seg]).await.unwrap();
                    r.unwrap();
                    assert!(back.full().iter().all(|&b| b == i), "block {i} read back wrong");
                })
            })
            .collect();
        rt.block_on(async {
            for t in tasks {
                t.await.unwrap();
            }
        });
        drop(rt);
        ring.fdatasync().blocking_recv().unwrap().unwrap();
        let seg = Segment { file_offset: 7 * 4096, buf_offset: 0, len: 4096 };
        let (back, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(4096), vec![seg]).blocking_recv().unwrap();
        r.unwrap();
        assert!(back.full().iter().all(|&b| b == 7));
    }

    #[test]
    fn read_past_end_of_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = open_pool_file(&dir.path().join("f"), true).unwrap();
        f.set_len(4096).unwrap();
        let ring = IoRing::new(Arc::new(f), 4, &IoOptions::default()).unwrap();
        let seg = Segment { file_offset: 8192, buf_offset: 0, len: 4096 };
        let (_, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(4096), vec![seg]).blocking_recv().unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}

/// Deterministic concurrency checks of the hand-over between submissions and a lane's
/// submitter task ([`Submitter`]), with shuttle's schedulers (PCT and random): the
/// engine's own `hand_over`, `run` and `close` on shuttle's atomics, around a model of
/// the submission queue (entries pushed under a lock, as `Shared::start` does, and all
/// of them taken by an enter, as the kernel does). Checked: every entry pushed is
/// entered, by the task it was handed to while that task lives (no lost wake-up: with
/// nobody closing it, the queue empties), by the task's last enter when the lane closes
/// or its runtime drops it (before or after its first poll), or by the submitter
/// itself. Shuttle runs every atomic as sequentially consistent, so the model checks
/// the protocol's interleavings, not the memory ordering: the fences of
/// `Submitter::hand_over` and the task's end (against store buffering between the
/// queue's tail and `alive`) are explored by `fence_model` under loom instead. Run
/// with `cargo nextest run -p storage-engine --features shuttle --lib submit_model`.
#[cfg(all(test, feature = "shuttle"))]
mod submit_model {
    use std::sync::atomic::Ordering;

    use shuttle::future;
    use shuttle::sync::atomic::AtomicU32;
    use shuttle::sync::{Arc, Mutex};

    use super::Submitter;

    const ITERATIONS: usize = 2000;

    /// The submission queue: entries pushed and not entered yet, and entries entered.
    #[derive(Default)]
    struct Queue {
        pushed: Mutex<u32>,
        entered: AtomicU32,
    }

    impl Queue {
        /// The kernel takes every entry in the queue.
        fn enter(&self) {
            let n = std::mem::take(&mut *self.pushed.lock().unwrap());
            self.entered.fetch_add(n, Ordering::SeqCst);
        }

        fn waiting(&self) -> u32 {
            *self.pushed.lock().unwrap()
        }
    }

    /// `Shared::start` after its entry is built: push under the lock, then hand over
    /// or enter.
    fn submit(s: &Submitter, q: &Queue, on_lane: bool) {
        *q.pushed.lock().unwrap() += 1;
        if !s.hand_over(on_lane) {
            q.enter();
        }
    }

    fn task(s: &std::sync::Arc<Submitter>, q: &Arc<Queue>) -> impl std::future::Future<Output = ()> + Send + 'static {
        let q = q.clone();
        s.clone().run(move || q.enter())
    }

    /// Two tasks of the lane's thread, each submitting twice.
    fn lane_tasks(s: &std::sync::Arc<Submitter>, q: &Arc<Queue>) -> Vec<future::JoinHandle<()>> {
        (0..2)
            .map(|_| {
                let (s, q) = (s.clone(), q.clone());
                future::spawn(async move {
                    for _ in 0..2 {
                        submit(&s, &q, true);
                        future::yield_now().await;
                    }
                })
            })
            .collect()
    }

    /// Two tasks of the lane's thread submit twice each, a plain thread once; with
    /// nobody closing the task, it enters everything it was handed; then the lane
    /// closes.
    fn handed_entries_are_entered_while_the_task_lives() {
        let s = std::sync::Arc::new(Submitter::new((1, 0)));
        let q = Arc::new(Queue::default());
        let t = future::spawn(task(&s, &q));
        let lane = lane_tasks(&s, &q);
        let other = {
            let (s, q) = (s.clone(), q.clone());
            shuttle::thread::spawn(move || submit(&s, &q, false))
        };
        future::block_on(async {
            for l in lane {
                l.await.unwrap();
            }
        });
        other.join().unwrap();
        // Liveness: the task was woken for what it holds. A lost wake-up spins here
        // until shuttle's step bound fails the test.
        future::block_on(async {
            while q.waiting() > 0 {
                future::yield_now().await;
            }
        });
        s.close();
        future::block_on(t).unwrap();
        assert_eq!(q.entered.load(Ordering::SeqCst), 5);
        assert_eq!(q.waiting(), 0);
    }

    /// The lane's runtime shuts down (the task dropped, maybe before its first poll)
    /// while the lane's tasks submit: what was handed over before is entered by the
    /// task's last enter, what comes after by the submitters themselves.
    fn a_task_dropped_by_its_runtime_leaves_nothing_behind() {
        let s = std::sync::Arc::new(Submitter::new((1, 0)));
        let q = Arc::new(Queue::default());
        let t = future::spawn(task(&s, &q));
        let lane = lane_tasks(&s, &q);
        t.abort();
        future::block_on(async {
            for l in lane {
                l.await.unwrap();
            }
            let _ = t.await;
        });
        assert_eq!(q.waiting(), 0, "entries left in the queue with nobody to enter them");
        assert_eq!(q.entered.load(Ordering::SeqCst), 4);
    }

    fn explore(f: fn()) {
        let mut config = shuttle::Config::new();
        config.max_steps = shuttle::MaxSteps::FailAfter(20_000);
        config.silence_warnings = true;
        shuttle::Runner::new(shuttle::scheduler::PctScheduler::new(3, ITERATIONS), config.clone()).run(f);
        shuttle::Runner::new(shuttle::scheduler::RandomScheduler::new(ITERATIONS), config).run(f);
    }

    #[test]
    fn submissions_handed_over_are_entered_while_the_task_lives() {
        explore(handed_entries_are_entered_while_the_task_lives);
    }

    #[test]
    fn a_submitter_task_dropped_by_its_runtime_leaves_nothing_in_the_queue() {
        explore(a_task_dropped_by_its_runtime_leaves_nothing_behind);
    }
}

/// The memory ordering of the hand-over, under loom's checker (which, unlike shuttle,
/// lets a load read an older store wherever the C++/Rust memory model allows it): a
/// submission pushes an entry (the submission queue's tail stored with `Release`, as
/// the io-uring crate stores it) and hands it to the task, while the task ends (its
/// runtime dropping it) and enters once more (the kernel reading the tail with
/// `Acquire`). Checked in every execution: an entry the submission handed over (it saw
/// the task alive) is seen by the task's last enter. Without the two `SeqCst` fences
/// both sides may read the other's old value (store buffering) and the entry is left in
/// the queue with nobody to enter it; loom finds that execution. Run with
/// `cargo nextest run -p storage-engine --features loom --lib fence_model`.
#[cfg(all(test, feature = "loom", not(feature = "shuttle")))]
mod fence_model {
    use std::sync::atomic::Ordering;

    use loom::sync::atomic::{AtomicBool, AtomicU32};
    use loom::sync::Arc;

    use super::Submitter;

    #[test]
    fn an_entry_handed_to_an_ending_task_is_entered() {
        loom::model(|| {
            let s = std::sync::Arc::new(Submitter::new((1, 0)));
            // The submission queue's tail, and whether the task's last enter took it.
            let tail = Arc::new(AtomicU32::new(0));
            let entered = Arc::new(AtomicBool::new(false));
            let task = {
                let (tail, entered) = (tail.clone(), entered.clone());
                s.clone().run(move || {
                    if tail.load(Ordering::Acquire) == 1 {
                        entered.store(true, Ordering::Relaxed);
                    }
                })
            };
            let submission = {
                let (s, tail) = (s.clone(), tail.clone());
                loom::thread::spawn(move || {
                    tail.store(1, Ordering::Release);
                    s.hand_over(true)
                })
            };
            // The runtime drops the task before its first poll: its last enter runs.
            drop(task);
            let handed = submission.join().unwrap();
            assert!(!handed || entered.load(Ordering::Relaxed), "an entry handed to the ending task was never entered");
        });
    }
}
