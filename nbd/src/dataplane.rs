//! The data-plane threads, on which the transmission phase runs.
//!
//! Lives here: [`DataPlane`], a set of threads each running a compio runtime: an event
//! loop whose only wait point is its own io_uring, where socket receives and sends and
//! timers are ring entries, so that a thread sleeps in one `io_uring_enter` that also
//! submits what it queued. A connection placed on a thread ([`DataPlane::place`])
//! stays there. Other threads hand work in through a channel (a cross-thread wake-up
//! is an eventfd read on the ring), and [`DataPlane::watch_eventfd`] lets a storage
//! engine's own ring complete on the same thread.
//! Not here: the protocol (`transmission`), accepting and the handshake (`server`, on
//! tokio).
//!
//! Tasks on a data-plane thread are not `Send` and never move; anything handed in
//! from another thread is `Send`.

use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc;

/// Work handed to a data-plane thread: runs there, inside its runtime.
type Job = Box<dyn FnOnce() + Send>;

/// Threads serving the transmission phase of NBD connections, each on an event loop of
/// its own (a compio runtime on one io_uring).
///
/// Dropping it (or [`DataPlane::stop`]) ends the threads: tasks still running there
/// are dropped.
pub struct DataPlane {
    workers: Vec<Worker>,
}

struct Worker {
    jobs: Mutex<Option<mpsc::UnboundedSender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Connections placed here and still open.
    connections: Arc<AtomicUsize>,
}

/// A connection counted on the thread it was placed on; uncounted on drop.
pub(crate) struct Placed {
    pub thread: usize,
    connections: Arc<AtomicUsize>,
}

impl Drop for Placed {
    fn drop(&mut self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

impl DataPlane {
    /// Starts `threads` threads (at least one) named `name`, `name-1`, `name-2`, ….
    ///
    /// Errors: a thread or its io_uring could not be set up (io_uring refused by the
    /// kernel or a seccomp profile, the memory lock limit for rings).
    pub fn start(threads: usize, name: &str) -> io::Result<Arc<DataPlane>> {
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
            let thread_name = if i == 0 { name.to_owned() } else { format!("{name}-{i}") };
            let thread = std::thread::Builder::new().name(thread_name).spawn(move || {
                let runtime = match compio::runtime::RuntimeBuilder::new().build() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                runtime.block_on(async move {
                    while let Some(job) = rx.recv().await {
                        job();
                    }
                });
            })?;
            let started = ready_rx.recv().unwrap_or_else(|_| Err(io::Error::other("data-plane thread died")));
            if let Err(e) = started {
                let _ = thread.join();
                return Err(e);
            }
            workers.push(Worker {
                jobs: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                connections: Arc::default(),
            });
        }
        Ok(Arc::new(DataPlane { workers }))
    }

    /// How many threads there are.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Runs `job` on thread `thread` (`0..threads()`), inside its runtime, where it may
    /// start tasks with [`spawn_local`].
    ///
    /// Errors: `thread` is out of range, or the plane has stopped.
    pub fn run_on(&self, thread: usize, job: impl FnOnce() + Send + 'static) -> io::Result<()> {
        let worker = self
            .workers
            .get(thread)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no such data-plane thread"))?;
        let jobs = worker.jobs.lock().unwrap_or_else(|p| p.into_inner());
        match jobs.as_ref() {
            Some(tx) if tx.send(Box::new(job)).is_ok() => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::NotConnected, "the data plane has stopped")),
        }
    }

    /// Counts one more connection on the thread serving the fewest now, and returns it.
    pub(crate) fn place(&self) -> Placed {
        let (thread, worker) = self
            .workers
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| w.connections.load(Ordering::Acquire))
            .expect("a data plane has at least one thread");
        worker.connections.fetch_add(1, Ordering::AcqRel);
        Placed { thread, connections: worker.connections.clone() }
    }

    /// On thread `thread`, calls `on_ready` once, then each time the eventfd `fd` is
    /// readable, after reading (and so resetting) its counter, until `on_ready` returns
    /// true; then closes `fd`. The read is an entry of the thread's io_uring, so a
    /// completion posted to another ring wakes this thread's loop: for a storage
    /// engine's ring whose completions raise `fd`. `fd` must be a blocking eventfd (an
    /// io_uring read of a non-blocking one fails at once instead of waiting).
    ///
    /// Errors: as [`DataPlane::run_on`].
    pub fn watch_eventfd(
        &self,
        thread: usize,
        fd: OwnedFd,
        mut on_ready: impl FnMut() -> bool + Send + 'static,
    ) -> io::Result<()> {
        self.run_on(thread, move || {
            spawn_local(async move {
                use compio::io::AsyncRead;
                if on_ready() {
                    return;
                }
                let mut file = match compio::runtime::fd::AsyncFd::new(fd) {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot watch an eventfd on the data plane");
                        return;
                    }
                };
                let mut counter = Vec::with_capacity(8);
                loop {
                    let compio::BufResult(r, back) = file.read(counter).await;
                    counter = back;
                    counter.clear();
                    if let Err(e) = r {
                        tracing::error!(error = %e, "reading an eventfd on the data plane failed");
                        // Keep reaping by polling rather than stop for good.
                        compio::runtime::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                    if on_ready() {
                        return;
                    }
                }
            });
        })
    }

    /// Ends the threads, dropping the tasks still on them, and waits for them.
    pub fn stop(&self) {
        for w in &self.workers {
            w.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
        for w in &self.workers {
            if let Some(t) = w.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
                if t.thread().id() != std::thread::current().id() {
                    let _ = t.join();
                }
            }
        }
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts `fut` as a task of this data-plane thread, detached.
///
/// Panics if called on a thread that is not a data-plane thread.
pub fn spawn_local(fut: impl Future<Output = ()> + 'static) {
    compio::runtime::spawn(fut).detach();
}

/// [`spawn_local`] for a boxed `Send` future: a function a storage engine can keep as
/// the way to start a detached task on the current data-plane thread.
pub fn spawn_boxed(fut: Pin<Box<dyn Future<Output = ()> + Send + 'static>>) {
    spawn_local(fut);
}
