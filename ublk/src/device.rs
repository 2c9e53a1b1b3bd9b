//! One ublk device: its control thread (add, start, stop and delete, through libublk's
//! control commands), its queue threads (fetch a request, hand it to the backend,
//! commit its result and fetch the next), and the way results come back to a queue's
//! thread. Not here: the backend's operations (the [`Backend`] implementation).
//!
//! A queue thread blocks in its io_uring (libublk's `wait_and_handle_io`), where the
//! driver's requests arrive as completions of its `FETCH` commands, and where it must
//! also commit their results: the driver takes a queue's commands from one thread.
//! The backend's futures run on a tokio runtime instead (the engine's data plane); a
//! finished request is put on the queue's list of results and one byte written to a
//! socket pair whose read end the queue's ring polls (a target I/O of libublk's, as
//! its docs suggest for results from another context), so the queue thread wakes,
//! copies read data into the request's buffer and commits each result.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, BufDescList, UblkError, UblkFlags, UblkIORes};

use crate::{Backend, Error, Options};

/// The driver's control device: missing when the kernel has no ublk.
const CONTROL: &str = "/dev/ublk-control";

/// Longest [`Device::add`] waits for the driver to start a device.
const START_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The op byte of the target I/O that polls the wake-up socket (any value the driver's
/// commands do not use; only told apart by the target bit).
const WAKE_OP: u32 = 0xfe;

/// A device, `/dev/ublkbN`, served while this value lives: dropping it (or
/// [`Device::remove`]) stops the device, waits for its queue threads, and deletes it.
pub struct Device {
    id: u32,
    stop: Option<mpsc::Sender<()>>,
    control: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("id", &self.id).finish()
    }
}

/// A request's result, sent from the backend's runtime to the queue's thread.
enum Outcome<B> {
    /// A read: its data (the first `len` bytes), or an errno.
    Read(Result<B, i32>, u32),
    /// Anything else: bytes done (0 for flush, discard, write zeroes), or an errno.
    Done(Result<u32, i32>),
}

/// What the backend's runtime hands back to one queue.
struct Results<B> {
    finished: Mutex<Vec<(u16, Outcome<B>)>>,
    /// Written one byte per result; its peer is polled by the queue's ring.
    wake: UnixStream,
}

impl<B> Results<B> {
    fn push(&self, tag: u16, outcome: Outcome<B>) {
        self.finished.lock().unwrap_or_else(|p| p.into_inner()).push((tag, outcome));
        // A full socket means a wake-up is pending already.
        let _ = (&self.wake).write(&[1]);
    }
}

/// One request's way back to its queue: [`Reply::send`] its outcome, or, if it is
/// dropped unsent (its task panicked, or was dropped by a runtime shutting down),
/// `EIO`. A request never answered would hang in the kernel, and the device's stop
/// with it.
struct Reply<B> {
    tag: u16,
    results: Arc<Results<B>>,
    sent: bool,
}

impl<B> Reply<B> {
    fn new(tag: u16, results: &Arc<Results<B>>) -> Reply<B> {
        Reply { tag, results: Arc::clone(results), sent: false }
    }

    fn send(mut self, outcome: Outcome<B>) {
        self.sent = true;
        self.results.push(self.tag, outcome);
    }

    /// Answered on the queue's thread instead.
    fn answered_here(mut self) {
        self.sent = true;
    }
}

impl<B> Drop for Reply<B> {
    fn drop(&mut self) {
        if !self.sent {
            self.results.push(self.tag, Outcome::Done(Err(libc::EIO)));
        }
    }
}

impl Device {
    /// Adds a device serving `backend` and starts it: on return `/dev/ublkbN`
    /// ([`Device::path`]) exists and takes I/O, in 4096-byte logical blocks (as the
    /// kernel's NBD client's for the same volume). Queue `q`'s requests run on
    /// `runtimes[q % runtimes.len()]`. Blocks while the driver starts the device (the
    /// kernel reads its partition table), so call it off the data plane.
    ///
    /// Errors: [`Error::NotSupported`] without `/dev/ublk-control`;
    /// [`Error::Denied`] without the rights to add a device; [`Error::Invalid`] for
    /// options out of range or a size that is not a multiple of 4096;
    /// [`Error::Driver`] when the driver refuses.
    pub fn add<B: Backend>(
        backend: Arc<B>,
        runtimes: Vec<tokio::runtime::Handle>,
        opts: &Options,
    ) -> Result<Device, Error> {
        check(opts, backend.size(), runtimes.len())?;
        if !Path::new(CONTROL).exists() {
            return Err(Error::NotSupported);
        }
        let (ready_tx, ready_rx) = mpsc::channel::<Result<u32, Error>>();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let opts = opts.clone();
        let control = std::thread::Builder::new()
            .name("ferrovol-ublk".into())
            .spawn(move || control(backend, runtimes, opts, ready_tx, stop_rx))
            .map_err(|e| Error::Driver(format!("start the control thread: {e}")))?;
        // The driver starts a device in well under a second; a start that hangs (the
        // kernel waiting for a queue that never fetched) must not hang the caller.
        match ready_rx.recv_timeout(START_LIMIT) {
            Ok(Ok(id)) => Ok(Device { id, stop: Some(stop_tx), control: Some(control) }),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // The control thread is left behind, stuck in the driver.
                Err(Error::Driver(format!("the device did not start in {} s", START_LIMIT.as_secs())))
            }
            Ok(Err(e)) => {
                drop(stop_tx);
                let _ = control.join();
                Err(e)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = control.join();
                Err(Error::Driver("the control thread ended before the device started".to_owned()))
            }
        }
    }

    /// The driver's device number `N`.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The block device: `/dev/ublkbN`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.id))
    }

    /// Sets the device's size to `size` bytes (a multiple of 4096), online, after the
    /// backend grew: the kernel sees it at once (and tells udev).
    ///
    /// Errors: [`Error::NoOnlineResize`] when the driver lacks UBLK_F_UPDATE_SIZE;
    /// [`Error::Invalid`] for a size not a multiple of 4096; [`Error::Driver`].
    pub fn set_size(&self, size: u64) -> Result<(), Error> {
        check_size(size)?;
        if UblkCtrl::get_features().is_none_or(|f| f & u64::from(sys::UBLK_F_UPDATE_SIZE) == 0) {
            return Err(Error::NoOnlineResize);
        }
        let ctrl = UblkCtrl::new_simple(self.id as i32).map_err(|e| driver_error("open the device", e))?;
        ctrl.update_size(size).map_err(|e| driver_error("change the device's size", e))?;
        Ok(())
    }

    /// Stops the device (requests in flight in the kernel fail), waits for its queue
    /// threads, and deletes it.
    pub fn remove(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.control.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.shut();
    }
}

/// Deletes the devices of target `name` ([`Options::name`]) whose server process is
/// gone: a server killed without stopping its devices leaves them stopped by the
/// kernel (the block device removed, its requests failed) but still added, each with
/// its control device `/dev/ublkcN`, until somebody deletes them. Devices of a live
/// process, of another target, or whose details cannot be read are left alone.
/// Returns the numbers of those deleted; nothing without a ublk driver.
pub fn remove_stale(name: &str) -> Vec<u32> {
    if !Path::new(CONTROL).exists() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir("/dev") else { return Vec::new() };
    let ids: Vec<u32> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok()).collect();
    let mut removed = Vec::new();
    for id in ids {
        let Ok(ctrl) = UblkCtrl::new_simple(id as i32) else { continue };
        let pid = ctrl.dev_info().ublksrv_pid;
        if pid > 0 && Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if !matches!(ctrl.get_target_type_from_json(), Ok(t) if t == name) {
            continue;
        }
        match ctrl.del_dev() {
            Ok(_) => removed.push(id),
            Err(e) => tracing::warn!(id, error = ?e, "ublk: deleting a stale device failed"),
        }
    }
    removed
}

/// Checks the options against the driver's limits and the backend's size.
fn check(opts: &Options, size: u64, runtimes: usize) -> Result<(), Error> {
    if !(1..=32).contains(&opts.queues) {
        return Err(Error::Invalid(format!("{} queues: 1 to 32", opts.queues)));
    }
    if !(1..=4096).contains(&opts.depth) {
        return Err(Error::Invalid(format!("a depth of {}: 1 to 4096", opts.depth)));
    }
    if opts.max_io_bytes == 0 || !opts.max_io_bytes.is_multiple_of(4096) || opts.max_io_bytes > 1 << 20 {
        return Err(Error::Invalid(format!(
            "{} bytes per request: a multiple of 4096, at most 1 MiB",
            opts.max_io_bytes
        )));
    }
    check_size(size)?;
    if runtimes == 0 {
        return Err(Error::Invalid("no runtime to serve requests on".to_owned()));
    }
    Ok(())
}

/// A device's size: a multiple of 4096 bytes, not 0.
fn check_size(size: u64) -> Result<(), Error> {
    if size == 0 || !size.is_multiple_of(4096) {
        return Err(Error::Invalid(format!("a size of {size} bytes: a multiple of 4096, not 0")));
    }
    Ok(())
}

/// libublk's error as ours: a refused permission is [`Error::Denied`].
fn driver_error(what: &str, e: UblkError) -> Error {
    let text = format!("{what}: {e:?}");
    match e {
        UblkError::OtherError(code) | UblkError::UringIOError(code)
            if code == -libc::EPERM || code == -libc::EACCES =>
        {
            Error::Denied(text)
        }
        UblkError::IOError(io) if io.kind() == std::io::ErrorKind::PermissionDenied => Error::Denied(text),
        _ => Error::Driver(text),
    }
}

/// The control thread: adds the device, runs its queues, reports it started, waits
/// for the stop, stops it; the driver's handle, dropped at the end, deletes it.
fn control<B: Backend>(
    backend: Arc<B>,
    runtimes: Vec<tokio::runtime::Handle>,
    opts: Options,
    ready: mpsc::Sender<Result<u32, Error>>,
    stop: mpsc::Receiver<()>,
) {
    let ctrl = match UblkCtrlBuilder::default()
        .name(&opts.name)
        .nr_queues(opts.queues)
        .depth(opts.depth)
        .io_buf_bytes(opts.max_io_bytes)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(driver_error("add the device", e)));
            return;
        }
    };
    let size = backend.size();
    let read_only = opts.read_only;
    let set_params = move |dev: &mut UblkDev| {
        dev.set_default_params(size);
        let p = &mut dev.tgt.params;
        // 4096-byte logical blocks (sizes are multiples of 4096), as the kernel's NBD
        // client takes for an export that prefers them: a file system made through
        // either device mounts through the other (ext4 makes 1 KiB blocks on a small
        // device of 512-byte sectors, which a device of 4096-byte sectors cannot mount).
        p.basic.logical_bs_shift = 12;
        p.basic.physical_bs_shift = 12;
        p.basic.io_min_shift = 12;
        p.basic.io_opt_shift = 12;
        // A volatile write cache (the kernel sends FLUSH) that takes FUA writes.
        p.basic.attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
        if read_only {
            p.basic.attrs |= sys::UBLK_ATTR_READ_ONLY;
        } else {
            p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
            p.discard = sys::ublk_param_discard {
                discard_granularity: 4096,
                max_discard_sectors: u32::MAX >> 9,
                max_write_zeroes_sectors: u32::MAX >> 9,
                max_discard_segments: 1,
                ..Default::default()
            };
        }
        Ok(())
    };
    let runtimes = Arc::new(runtimes);
    // A queue that could not be set up: why (the start then fails).
    let queue_failed = Arc::new(Mutex::new(None::<String>));
    let failed = Arc::clone(&queue_failed);
    let serve = move |qid: u16, dev: &UblkDev| {
        let rt = runtimes[usize::from(qid) % runtimes.len()].clone();
        if let Err(why) = serve_queue(qid, dev, backend.clone(), rt) {
            tracing::error!(qid, error = why, "ublk: setting up a queue failed");
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
            // Ends the driver's wait for this queue's buffers: the start fails.
            dev.notify_buffer_registration_complete(true);
        }
    };
    let stop = Mutex::new(stop);
    let started = ready.clone();
    let run = ctrl.run_target(set_params, serve, move |ctrl: &UblkCtrl| {
        let _ = started.send(Ok(ctrl.dev_info().dev_id));
        // Until the Device is removed (or dropped: its sender goes).
        let _ = stop.lock().unwrap_or_else(|p| p.into_inner()).recv();
        if let Err(e) = ctrl.kill_dev() {
            tracing::warn!(error = ?e, "ublk: stopping the device failed");
        }
    });
    if let Err(e) = run {
        let why = queue_failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        let _ = ready.send(Err(match why {
            Some(why) => Error::Driver(format!("set up a queue: {why}")),
            None => driver_error("start the device", e),
        }));
    }
    // Deleted without waiting for the device's release: a file system still mounted
    // on it (or any opener) holds that until it lets go, and a detach must not wait
    // for it. Kernels without DEL_DEV_ASYNC delete it when `ctrl` drops, waiting.
    if let Err(e) = ctrl.del_dev_async() {
        tracing::debug!(error = ?e, "ublk: DEL_DEV_ASYNC refused; deleting and waiting for the release");
    }
}

/// One queue's thread: fetches the driver's requests, hands each to the backend on
/// `rt`, and commits the results as they come back, until the device stops.
///
/// Errors: why the queue could not be set up (nothing served).
fn serve_queue<B: Backend>(qid: u16, dev: &UblkDev, backend: Arc<B>, rt: tokio::runtime::Handle) -> Result<(), String> {
    let (woken, wake) = UnixStream::pair().map_err(|e| format!("a socket pair: {e}"))?;
    woken.set_nonblocking(true).and_then(|()| wake.set_nonblocking(true)).map_err(|e| format!("a socket pair: {e}"))?;
    let results = Arc::new(Results::<B::Buf> { finished: Mutex::new(Vec::new()), wake });
    let mut bufs = dev.alloc_queue_io_bufs();
    let q = UblkQueue::new(qid, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
        .map_err(|e| format!("{e:?}"))?;
    let poll_woken = |q: &UblkQueue| {
        let sqe = io_uring::opcode::PollAdd::new(io_uring::types::Fd(woken.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(UblkIOCtx::build_user_data(0, WAKE_OP, 0, true));
        if let Err(e) = q.ublk_submit_sqe_sync(sqe) {
            tracing::error!(qid, error = ?e, "ublk: polling the wake-up socket failed");
        }
    };
    poll_woken(&q);
    q.wait_and_handle_io(|q: &UblkQueue, tag: u16, ctx: &UblkIOCtx| {
        if ctx.is_tgt_io() {
            // The wake-up socket is readable: results came back.
            let mut sink = [0u8; 256];
            while matches!((&woken).read(&mut sink), Ok(n) if n > 0) {}
            let finished = std::mem::take(&mut *results.finished.lock().unwrap_or_else(|p| p.into_inner()));
            for (tag, outcome) in finished {
                let buf = &mut bufs[usize::from(tag)];
                let res = match outcome {
                    Outcome::Read(Ok(data), len) => {
                        let len = len as usize;
                        match data.as_ref().get(..len) {
                            Some(d) if len <= buf.len() => {
                                buf.as_mut_slice()[..len].copy_from_slice(d);
                                len as i32
                            }
                            // A backend that broke its contract fails the request,
                            // not the queue.
                            _ => -libc::EIO,
                        }
                    }
                    Outcome::Read(Err(errno), _) | Outcome::Done(Err(errno)) => -errno,
                    Outcome::Done(Ok(n)) => n as i32,
                };
                let _ = q.complete_io_cmd_unified(tag, BufDesc::Slice(buf.as_slice()), Ok(UblkIORes::Result(res)));
            }
            if !q.is_stopping() {
                poll_woken(q);
            }
            return;
        }
        let iod = q.get_iod(tag);
        let (op, flags) = (iod.op_flags & 0xff, iod.op_flags);
        let offset = iod.start_sector << 9;
        let len = iod.nr_sectors << 9;
        let fua = flags & sys::UBLK_IO_F_FUA != 0;
        let b = backend.clone();
        // A runtime shut down drops the task at once: the reply sends EIO then.
        let reply = Reply::new(tag, &results);
        let refuse = |errno: i32| {
            let buf = bufs[usize::from(tag)].as_slice();
            let _ = q.complete_io_cmd_unified(tag, BufDesc::Slice(buf), Ok(UblkIORes::Result(-errno)));
        };
        match op {
            sys::UBLK_IO_OP_READ => {
                rt.spawn(async move { reply.send(Outcome::Read(b.read(offset, len).await, len)) });
            }
            sys::UBLK_IO_OP_WRITE => {
                let mut data = b.alloc_buf(offset, len as usize);
                let src = bufs[usize::from(tag)].as_slice().get(..len as usize);
                let (Some(dst), Some(src)) = (data.as_mut().get_mut(..len as usize), src) else {
                    reply.answered_here();
                    return refuse(libc::EIO);
                };
                dst.copy_from_slice(src);
                rt.spawn(async move { reply.send(Outcome::Done(b.write(offset, data, fua).await.map(|()| len))) });
            }
            sys::UBLK_IO_OP_FLUSH => {
                rt.spawn(async move { reply.send(Outcome::Done(b.flush().await.map(|()| 0))) });
            }
            sys::UBLK_IO_OP_DISCARD => {
                rt.spawn(async move {
                    reply.send(Outcome::Done(b.discard(offset, u64::from(len)).await.map(|()| 0)));
                });
            }
            sys::UBLK_IO_OP_WRITE_ZEROES => {
                let may_unmap = flags & sys::UBLK_IO_F_NOUNMAP == 0;
                rt.spawn(async move {
                    let done = b.write_zeroes(offset, u64::from(len), may_unmap, fua).await;
                    reply.send(Outcome::Done(done.map(|()| 0)));
                });
            }
            _ => {
                reply.answered_here();
                refuse(libc::EOPNOTSUPP);
            }
        }
    });
    Ok(())
}
