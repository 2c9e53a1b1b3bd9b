//! Giving the data units a pool file frees back to the host file system (hole
//! punching, `fallocate(PUNCH_HOLE)`), so that deleting a volume or trimming frees
//! space on the host, not only in the pool.
//!
//! Lives here: the order that makes it safe and the thread that does it. A unit's
//! blocks are punched only after its free is durable and before it is allocatable:
//! a release of pending frees ([`Store::release_pending`]) queues the units
//! ([`Allocator::punch_queue`]) instead of freeing them; a thread of its own takes
//! them in batches of [`PUNCH_BATCH`], punches them with no lock held, and then frees
//! them. So no write to a unit taken again is ever punched away, and no lock of the
//! data path waits for the host file system (a fragmented unit takes it some 45 µs).
//! The thread holds the pool only to take and free a batch, and a close or the pool's
//! drop waits for the punch in flight ([`Signal::stop`]): nothing is punched once
//! either returned, whatever writes the file next.
//! When room is needed now, the make-room protocol frees the queued units unpunched
//! (room.rs). A block device gets the units as discards instead, when asked
//! (`PoolOptions::discard`). Not done: on a preallocated pool file or a block device not
//! asked to (`backed_all`), while the host file system is full, and once the host file
//! system or the device answers `EOPNOTSUPP`. Units freed but not yet punched
//! when the pool closes or crashes are found at the next open and punched then
//! ([`Store::queue_leftover_punches`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use super::Store;
use crate::error::{Error, Result};
use crate::meta::PendingMark;

#[cfg(doc)]
use crate::meta::Allocator;

/// Units punched per batch: each batch is freed as a whole once punched, so a writer
/// that needs room waits for at most one batch (about 3 ms on ext4).
pub(crate) const PUNCH_BATCH: usize = 64;

/// Gives `len` bytes at an offset of the pool file or device back (`io::punch_hole`,
/// `io::discard`).
type GiveBack = fn(&std::fs::File, u64, u64) -> std::io::Result<()>;

/// Wakes the punching thread, and tells it to stop.
#[derive(Default)]
pub(crate) struct Signal {
    /// (work queued, stop)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
    /// Notified when a batch is freed.
    punched: tokio::sync::Notify,
    /// Held across each punch, and set once the pool stops punching: no punch reaches
    /// the file after [`Signal::stop`] returns.
    stopped: Mutex<bool>,
    /// The punching thread, joined by [`Signal::stop`].
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Signal {
    fn set(&self, work: bool, stop: bool) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.0 |= work;
        st.1 |= stop;
        self.cv.notify_all();
    }

    /// Stops the punching thread (the pool's close, or its drop) and waits for it: a
    /// punch in flight completes, none starts after, and the thread has let go of
    /// the pool file when this returns (unless this runs on that thread, which
    /// returns right after). So whatever writes the pool file next, a test building
    /// a power-cut image in its place or another open, finds no punch of this pool
    /// landing on it.
    pub(crate) fn stop(&self) {
        self.set(false, true);
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle.filter(|h| h.thread().id() != std::thread::current().id()) {
            let _ = h.join();
        }
    }
}

impl Store {
    /// Whether freed units are given back now: to the host file system by a pool file
    /// that is not preallocated, on a file system that punches holes, which is not
    /// full (with the host full, space the pool frees stays the pool's, for its own
    /// writes); or to a block device as discards, when asked (`PoolOptions::discard`)
    /// and the device takes them.
    pub(crate) fn punches_holes(&self) -> bool {
        self.punch_holes.load(Ordering::Relaxed)
            && (self.discard_device
                || (!self.backed_all.load(Ordering::Relaxed) && !self.host_full.load(Ordering::Relaxed)))
    }

    /// Releases the pending frees and settles before `mark` (their records are
    /// durable); the freed units wait for their hole punch when the pool
    /// [punches holes](Self::punches_holes).
    pub(crate) fn release_pending(&self, mark: PendingMark) {
        let queued = {
            let mut a = self.alloc.lock();
            a.release_pending_punching(mark, &self.pins, self.punches_holes());
            !a.punch_queue.is_empty()
        };
        if queued {
            self.puncher.set(true, false);
        }
    }

    /// Takes the next batch of queued units and the way they are given back, or None
    /// when the queue is empty.
    fn take_batch(&self) -> Option<Batch> {
        let units = self.alloc.lock().take_punch_batch(PUNCH_BATCH);
        if units.is_empty() {
            return None;
        }
        let mut sorted = units.clone();
        sorted.sort_unstable();
        let us = self.geo.unit_size;
        let mut ranges = Vec::new();
        let mut i = 0;
        while i < sorted.len() {
            let mut j = i + 1;
            while j < sorted.len() && sorted[j] == sorted[j - 1] + 1 {
                j += 1;
            }
            ranges.push((self.geo.unit_offset(u64::from(sorted[i])), (j - i) as u64 * us));
            i = j;
        }
        let (give_back, unsupported) = match self.discard_device {
            true => (crate::io::discard as GiveBack, "the device takes no discards: freed units are not passed down"),
            false => (
                crate::io::punch_hole as GiveBack,
                "the host file system does not punch holes: freed space stays in the pool file",
            ),
        };
        Some(Batch { units, ranges, give_back, unsupported })
    }

    /// Frees a batch once punched (or given up on), and wakes writers waiting for it.
    fn finish_batch(&self, batch: &Batch) {
        {
            let mut a = self.alloc.lock();
            a.finish_punch(&batch.units);
            if !self.punches_holes() {
                a.free_punch_queue();
            }
        }
        self.puncher.punched.notify_waiters();
    }

    /// Queues for their punch the free units that hold blocks of the pool file: units
    /// whose free a crash or a close made durable before the punching thread reached
    /// them, and the units of earlier checkpoints. Called at open, once the spare has
    /// taken the backed units it needs ([`Store::prepare_at_open`]) and any checkpoint
    /// at open is written, before the punching thread starts; returns how many units
    /// it queued. The file's data ranges are found with `SEEK_DATA` and `SEEK_HOLE`, so
    /// the cost follows the ranges, not the pool's size. Nothing is queued when the
    /// pool does not [punch holes](Self::punches_holes), is a block device (what a
    /// device holds for a free unit is not known; discards only follow frees), or when
    /// the host file system is full (the pool's writes can still take those units).
    ///
    /// Errors: [`ErrorKind::Io`](crate::ErrorKind::Io) when the data ranges cannot be
    /// found.
    pub(crate) fn queue_leftover_punches(&self) -> Result<u64> {
        let us = self.geo.unit_size;
        if !self.punches_holes() || self.discard_device {
            return Ok(0);
        }
        // A host file system that is full (less room than 16 units, as the data path
        // judges it) keeps what the pool holds: writes can still take those units.
        if crate::io::available_bytes(&self.file).is_ok_and(|room| room < 16 * us) {
            return Ok(0);
        }
        let start = self.geo.data_offset;
        let end = self.geo.unit_offset(self.alloc.lock().unit_count());
        let ranges = crate::io::data_ranges(&self.file, start, end, usize::MAX)
            .map_err(|e| Error::io("look for the pool file's holes", e))?;
        let mut queued = 0;
        let mut a = self.alloc.lock();
        let backed: std::collections::HashSet<u32> = a.backed_free.iter().copied().collect();
        for (off, len) in ranges {
            // Every unit the range touches: a unit partly backed holds blocks too.
            for u in (off - start) / us..(off + len - start).div_ceil(us) {
                let u = u as u32;
                if !backed.contains(&u) && a.take_unit(u) {
                    a.punch_queue.push(u);
                    queued += 1;
                }
            }
        }
        drop(a);
        if queued > 0 {
            self.puncher.set(true, false);
        }
        Ok(queued)
    }

    /// Starts the thread that punches freed units.
    ///
    /// Errors: [`ErrorKind::Io`](crate::ErrorKind::Io) when the thread cannot be made.
    pub(crate) fn start_puncher(self: &Arc<Self>) -> Result<()> {
        let (weak, signal, file) = (Arc::downgrade(self), Arc::clone(&self.puncher), Arc::clone(&self.file));
        let handle = std::thread::Builder::new()
            .name("ferrovol-punch".into())
            .spawn(move || puncher(weak, signal, file))
            .map_err(|e| Error::io("start the hole puncher", e))?;
        *self.puncher.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(())
    }

    /// Stops the punching thread (the pool's close) and waits for it; units still
    /// queued are freed unpunched.
    pub(crate) fn stop_puncher(&self) {
        self.puncher.stop();
        self.alloc.lock().free_punch_queue();
    }

    /// Frees the units waiting for their punch at once, and waits for the batch being
    /// punched (a writer that needs room: every freed unit is free when this returns).
    pub(crate) async fn unpunch(&self) {
        self.alloc.lock().free_punch_queue();
        self.wait_punching().await;
    }

    /// Waits until no batch is being punched.
    async fn wait_punching(&self) {
        loop {
            let punched = self.puncher.punched.notified();
            tokio::pin!(punched);
            punched.as_mut().enable();
            if self.alloc.lock().punching == 0 {
                return;
            }
            punched.await;
        }
    }
}

/// A batch of units to punch: the units, their contiguous byte ranges `(offset,
/// length)` in the pool file, and how they are given back.
struct Batch {
    units: Vec<u32>,
    ranges: Vec<(u64, u64)>,
    give_back: GiveBack,
    unsupported: &'static str,
}

/// The punching thread: waits for queued units and punches them batch after batch,
/// until the pool closes or is dropped. It holds the pool only to take a batch and to
/// free it, never across a punch: a pool dropped while a batch is punched is dropped
/// then, and its drop waits for the punch in flight ([`Signal::stop`]).
fn puncher(store: Weak<Store>, signal: Arc<Signal>, file: Arc<std::fs::File>) {
    loop {
        {
            let st = signal.state.lock().unwrap_or_else(|e| e.into_inner());
            let (mut st, _) = signal
                .cv
                .wait_timeout_while(st, Duration::from_millis(500), |(work, stop)| !*work && !*stop)
                .unwrap_or_else(|e| e.into_inner());
            if st.1 {
                return;
            }
            st.0 = false;
        }
        loop {
            let batch = {
                let Some(s) = store.upgrade() else { return };
                if s.closed.load(Ordering::SeqCst) || s.failed.load(Ordering::SeqCst) {
                    return;
                }
                match s.take_batch() {
                    Some(b) => b,
                    None => break,
                }
            };
            for &(off, len) in &batch.ranges {
                // Whether to go on asks the pool (the host file system may have filled);
                // the pool is let go again before the punch.
                let go_on = store.upgrade().is_some_and(|s| s.punches_holes());
                let stopped = signal.stopped.lock().unwrap_or_else(|e| e.into_inner());
                if !go_on || *stopped {
                    break;
                }
                let punched = (batch.give_back)(&file, off, len);
                // Let go before asking the pool again: a drop of the pool on this
                // thread takes the lock.
                drop(stopped);
                match punched {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                        tracing::info!(error = %e, "{}", batch.unsupported);
                        if let Some(s) = store.upgrade() {
                            s.punch_holes.store(false, Ordering::Relaxed);
                        }
                    }
                    // The units are free all the same: only the host's space is not given back.
                    Err(e) => {
                        tracing::warn!(error = %e, offset = off, len, "punching freed units out of the pool file failed")
                    }
                }
            }
            // Freed punched or not: a batch cut short by a stop or a full host is free.
            let Some(s) = store.upgrade() else { return };
            s.finish_batch(&batch);
        }
    }
}
