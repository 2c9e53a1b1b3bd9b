//! Storage I/O on io_uring, and the aligned buffers it reads into and writes from.
//!
//! Lives here: [`AlignedBuf`] (a 4 KiB-aligned heap buffer with a byte *view*), and
//! [`IoRing`], a worker thread that owns one io_uring and executes reads, writes and
//! `fdatasync` on the pool file. This is the only module of the engine with `unsafe`.
//! Not here: what the I/O means (mappings, logs, checkpoints live in the other modules).
//!
//! # Buffer ownership
//! A buffer is *moved* into [`IoRing::rw`] and stays owned by the worker thread until
//! every segment's completion has arrived from the kernel; only then is it handed back
//! through the returned channel. Dropping the future that waits for the result does not
//! free the buffer while the kernel may still write into it: the worker keeps it until
//! the completion and then drops it. So the kernel never sees a freed buffer.

use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};
use tokio::sync::oneshot;

/// Alignment of every [`AlignedBuf`], in bytes: enough for O_DIRECT on 4Kn devices.
pub const ALIGN: usize = 4096;

/// A zero-initialised heap buffer aligned to [`ALIGN`] bytes, with a *view*: the byte
/// range `[start, start + len)` that `as_ref`/`as_mut` expose. The engine reads and
/// writes whole 4 KiB blocks through the full capacity and hands out the view.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    start: usize,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Vec<u8>); no interior
// mutability, so moving it across threads or sharing `&AlignedBuf` is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `cap` bytes rounded up to a multiple of [`ALIGN`] (at least
    /// one block); the view is the first `cap` bytes.
    pub fn zeroed(cap: usize) -> AlignedBuf {
        let rounded = cap.max(1).div_ceil(ALIGN) * ALIGN;
        let layout = Layout::from_size_align(rounded, ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size (rounded >= ALIGN).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap: rounded, start: 0, len: cap }
    }

    /// Capacity in bytes (a multiple of [`ALIGN`]).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the view to `[start, start + len)`. Panics if it exceeds the capacity
    /// (a bug in the engine, never caused by input).
    pub fn set_view(&mut self, start: usize, len: usize) {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.cap), "view out of buffer");
        self.start = start;
        self.len = len;
    }

    /// Start of the view, in bytes from the beginning of the buffer.
    pub fn view_start(&self) -> usize {
        self.start
    }

    /// The whole buffer, ignoring the view.
    pub fn full(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialised (zeroed) bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    /// The whole buffer, mutably, ignoring the view.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes; &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in `zeroed` with exactly this layout; dropped once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.full()[self.start..self.start + self.len]
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        let (s, l) = (self.start, self.len);
        &mut self.full_mut()[s..s + l]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("cap", &self.cap)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

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

enum Request {
    Rw { dir: Dir, buf: AlignedBuf, segs: Vec<Segment>, done: oneshot::Sender<RwResult> },
    Fsync { done: oneshot::Sender<io::Result<()>> },
}

/// An io_uring owned by a worker thread, executing requests on one file.
///
/// Requests go in through a channel and an eventfd that the worker keeps a read armed
/// on, so one `io_uring_enter` both submits new work and waits for completions.
pub struct IoRing {
    tx: Option<mpsc::Sender<Request>>,
    wake: Arc<OwnedFd>,
    worker: Option<JoinHandle<()>>,
}

impl IoRing {
    /// Starts a worker with a ring of `entries` submission slots on `file`.
    ///
    /// Errors: the kernel refused io_uring (e.g. `ENOSYS`, `EPERM` under a seccomp
    /// profile) or an eventfd could not be made.
    pub fn new(file: Arc<File>, entries: u32) -> io::Result<IoRing> {
        let ring = IoUring::new(entries)?;
        // SAFETY: eventfd returns a new fd we own, or -1 (checked).
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh, valid fd owned by nobody else.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let (tx, rx) = mpsc::channel();
        let worker_wake = wake.clone();
        let worker = std::thread::Builder::new()
            .name("ferrovol-io".into())
            .spawn(move || Worker::new(ring, file, worker_wake, rx).run())?;
        Ok(IoRing { tx: Some(tx), wake, worker: Some(worker) })
    }

    fn send(&self, req: Request) {
        if let Some(tx) = &self.tx {
            if tx.send(req).is_ok() {
                kick(self.wake.as_raw_fd());
            }
        }
    }

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
            self.send(Request::Rw { dir, buf, segs, done });
        }
        rx
    }

    /// `fdatasync` of the pool file through the ring.
    pub fn fdatasync(&self) -> oneshot::Receiver<io::Result<()>> {
        let (done, rx) = oneshot::channel();
        self.send(Request::Fsync { done });
        rx
    }
}

impl Drop for IoRing {
    fn drop(&mut self) {
        self.tx.take();
        kick(self.wake.as_raw_fd());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn kick(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to an eventfd we keep open (Arc<OwnedFd>).
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

const WAKE_TOKEN: u64 = u64::MAX;

struct InFlight {
    dir: Dir,
    buf: Option<AlignedBuf>,
    segs: Vec<Segment>,
    outstanding: usize,
    error: Option<io::Error>,
    done: Option<RwDone>,
}

enum RwDone {
    Rw(oneshot::Sender<RwResult>),
    Fsync(oneshot::Sender<io::Result<()>>),
}

struct Worker {
    ring: IoUring,
    file: Arc<File>,
    wake: Arc<OwnedFd>,
    rx: mpsc::Receiver<Request>,
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    /// (slot, segment index) waiting for room in the submission queue.
    queued: VecDeque<(usize, usize)>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    in_kernel: usize,
    closing: bool,
}

impl Worker {
    fn new(ring: IoUring, file: Arc<File>, wake: Arc<OwnedFd>, rx: mpsc::Receiver<Request>) -> Worker {
        Worker {
            ring,
            file,
            wake,
            rx,
            slots: Vec::new(),
            free_slots: Vec::new(),
            queued: VecDeque::new(),
            wake_buf: Box::new(0),
            wake_armed: false,
            in_kernel: 0,
            closing: false,
        }
    }

    fn run(mut self) {
        loop {
            self.drain_channel();
            if self.closing && self.in_kernel == 0 && self.queued.is_empty() {
                return;
            }
            self.push_sqes();
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                    tracing::error!(error = %e, "io_uring_enter failed");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap();
        }
    }

    fn drain_channel(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(Request::Rw { dir, buf, segs, done }) => {
                    let n = segs.len();
                    let slot = self.new_slot(InFlight {
                        dir,
                        buf: Some(buf),
                        segs,
                        outstanding: n,
                        error: None,
                        done: Some(RwDone::Rw(done)),
                    });
                    self.queued.extend((0..n).map(|i| (slot, i)));
                }
                Ok(Request::Fsync { done }) => {
                    let slot = self.new_slot(InFlight {
                        dir: Dir::Read,
                        buf: None,
                        segs: Vec::new(),
                        outstanding: 1,
                        error: None,
                        done: Some(RwDone::Fsync(done)),
                    });
                    self.queued.push_back((slot, usize::MAX));
                }
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.closing = true;
                    return;
                }
            }
        }
    }

    fn new_slot(&mut self, f: InFlight) -> usize {
        match self.free_slots.pop() {
            Some(i) => {
                self.slots[i] = Some(f);
                i
            }
            None => {
                self.slots.push(Some(f));
                self.slots.len() - 1
            }
        }
    }

    fn push_sqes(&mut self) {
        let fd = types::Fd(self.file.as_raw_fd());
        if !self.wake_armed && !self.closing {
            let e = opcode::Read::new(types::Fd(self.wake.as_raw_fd()), (&mut *self.wake_buf as *mut u64).cast(), 8)
                .build()
                .user_data(WAKE_TOKEN);
            // SAFETY: wake_buf is a Box owned by the worker that outlives the ring's use
            // of it (the worker drains its completion before exiting), and the eventfd
            // stays open through Arc<OwnedFd>.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                self.wake_armed = true;
                self.in_kernel += 1;
            }
        }
        while let Some(&(slot, seg)) = self.queued.front() {
            let Some(f) = self.slots[slot].as_mut() else {
                self.queued.pop_front();
                continue;
            };
            let entry = if seg == usize::MAX {
                opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build()
            } else {
                let s = f.segs[seg];
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
            let entry = entry.user_data(((slot as u64) << 32) | (seg as u64 & 0xffff_ffff));
            // SAFETY: the buffer range lives in `self.slots[slot].buf`, which is not
            // dropped or moved out until this entry's completion is reaped (the heap
            // allocation does not move when the AlignedBuf struct moves); the file stays
            // open through Arc<File>.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break;
            }
            self.in_kernel += 1;
            self.queued.pop_front();
        }
    }

    fn reap(&mut self) {
        let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in cqes {
            self.in_kernel -= 1;
            if ud == WAKE_TOKEN {
                self.wake_armed = false;
                continue;
            }
            let slot = (ud >> 32) as usize;
            let seg = (ud & 0xffff_ffff) as usize;
            let seg = if seg == 0xffff_ffff { usize::MAX } else { seg };
            let Some(f) = self.slots[slot].as_mut() else { continue };
            if res < 0 {
                f.error.get_or_insert(io::Error::from_raw_os_error(-res));
            } else if seg != usize::MAX {
                let n = res as usize;
                let s = &mut f.segs[seg];
                if n == 0 && s.len > 0 {
                    f.error.get_or_insert(io::Error::new(io::ErrorKind::UnexpectedEof, "pool ends before the segment"));
                } else if n < s.len {
                    // Short transfer: retry the remainder.
                    s.file_offset += n as u64;
                    s.buf_offset += n;
                    s.len -= n;
                    self.queued.push_back((slot, seg));
                    continue;
                }
            }
            f.outstanding -= 1;
            if f.outstanding == 0 {
                let mut f = self.slots[slot].take().expect("slot present");
                self.free_slots.push(slot);
                let result = match f.error.take() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                match f.done.take() {
                    Some(RwDone::Rw(tx)) => {
                        let _ = tx.send((f.buf.take().expect("rw slot has a buffer"), result));
                    }
                    Some(RwDone::Fsync(tx)) => {
                        let _ = tx.send(result);
                    }
                    None => {}
                }
            }
        }
    }
}

/// Opens `path` read-write with `O_DIRECT` when the file system allows it, else buffered.
/// Returns the file and whether O_DIRECT is in use.
pub fn open_pool_file(path: &std::path::Path, create: bool) -> io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true).create(create);
    match o.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((o.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// Takes an advisory `flock` on the pool file, exclusive for a server and shared for
/// the checker, without waiting. Held until the file is closed.
///
/// Errors: `WouldBlock` when another process holds a conflicting lock.
pub fn lock_file(file: &File, exclusive: bool) -> io::Result<()> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    // SAFETY: flock on an fd that `file` keeps open; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Size in bytes of a regular file or block device.
pub fn device_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_writes_reads_and_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let (f, _) = open_pool_file(&p, true).unwrap();
        f.set_len(1 << 20).unwrap();
        let ring = IoRing::new(Arc::new(f), 8).unwrap();
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
    fn read_past_end_of_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = open_pool_file(&dir.path().join("f"), true).unwrap();
        f.set_len(4096).unwrap();
        let ring = IoRing::new(Arc::new(f), 4).unwrap();
        let seg = Segment { file_offset: 8192, buf_offset: 0, len: 4096 };
        let (_, r) = ring.rw(Dir::Read, AlignedBuf::zeroed(4096), vec![seg]).blocking_recv().unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
