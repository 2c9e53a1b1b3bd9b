//! The pool's io_urings reaped on the NBD data-plane threads.
//!
//! Lives here: [`Lanes`], the engine's [`LaneDriver`] over an [`nbd::DataPlane`]: one
//! pool ring per data-plane thread, whose completions raise an eventfd that the
//! thread's own io_uring reads, so a request's storage I/O completes on the thread that
//! received it and its reply leaves from there, with no hand-off.
//! Not here: the data-plane threads (`nbd::dataplane`) or the rings (`storage_engine::io`).

use std::sync::Arc;

use storage_engine::{LaneDriver, LaneReaper};

/// One pool ring per thread of a data plane, each reaped on its thread.
pub struct Lanes(Arc<nbd::DataPlane>);

impl Lanes {
    /// Lanes for the threads of `dataplane`.
    pub fn new(dataplane: Arc<nbd::DataPlane>) -> Lanes {
        Lanes(dataplane)
    }
}

impl LaneDriver for Lanes {
    fn lanes(&self) -> usize {
        self.0.threads()
    }

    fn drive(&self, index: usize, lane: LaneReaper) -> std::io::Result<()> {
        let fd = lane.eventfd().try_clone_to_owned()?;
        self.0.watch_eventfd(index, fd, move || lane.reap())
    }
}
