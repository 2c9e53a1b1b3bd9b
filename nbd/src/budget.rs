//! Backpressure: the budgets a connection's requests take before they run (a request
//! count and a byte budget per connection, an allowance outside the server's memory
//! budget per connection, and the server's memory budget, [`TotalBudget`]), and waiting
//! for them unless the writer goes away or the server shuts down. Not here: the limits'
//! values (config.rs), requests (transmission.rs).

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::config::{ServerConfig, BYTE_UNIT, UNMETERED_BYTES_PER_CONNECTION};
use crate::export::Errno;
use crate::reply::{Outgoing, Permits, Rejection};

/// The memory budget shared by every connection of one server
/// ([`ServerConfig::max_total_in_flight_bytes`]), in units of [`BYTE_UNIT`].
pub(crate) struct TotalBudget {
    bytes: Arc<Semaphore>,
    units: u32,
}

impl TotalBudget {
    /// A budget of `bytes` (at least one unit).
    pub(crate) fn new(bytes: usize) -> Self {
        let units = (bytes / BYTE_UNIT).clamp(1, u32::MAX as usize);
        Self { bytes: Arc::new(Semaphore::new(units)), units: units as u32 }
    }
}

/// Budgets shared by the requests of one connection, and its share of the server's.
pub(crate) struct Budget {
    pub(crate) count: Arc<Semaphore>,
    pub(crate) count_total: usize,
    pub(crate) bytes: Arc<Semaphore>,
    pub(crate) byte_units: u32,
    /// This connection's allowance outside the server's budget
    /// ([`UNMETERED_BYTES_PER_CONNECTION`]), in units of [`BYTE_UNIT`].
    pub(crate) unmetered: Arc<Semaphore>,
    pub(crate) total: Arc<TotalBudget>,
}

pub(crate) const UNMETERED_UNITS: u32 = (UNMETERED_BYTES_PER_CONNECTION / BYTE_UNIT) as u32;

impl Budget {
    pub(crate) fn new(config: &ServerConfig, total: Arc<TotalBudget>) -> Self {
        let count = config.max_in_flight_requests.clamp(1, Semaphore::MAX_PERMITS);
        let units = (config.max_in_flight_bytes / BYTE_UNIT).clamp(1, u32::MAX as usize);
        Self {
            count: Arc::new(Semaphore::new(count)),
            count_total: count,
            bytes: Arc::new(Semaphore::new(units)),
            byte_units: units as u32,
            unmetered: Arc::new(Semaphore::new(UNMETERED_UNITS as usize)),
            total,
        }
    }

    /// Waits until one more request holding `bytes` in memory fits in the connection's
    /// budget (a request larger than the whole budget waits for all of it). The memory
    /// is then charged with [`Budget::charge`].
    pub(crate) async fn admit(&self, bytes: usize) -> Option<Permits> {
        let count = Arc::clone(&self.count).acquire_owned().await.ok()?;
        let units = bytes.div_ceil(BYTE_UNIT).min(self.byte_units as usize) as u32;
        let bytes = if units == 0 { None } else { Some(Arc::clone(&self.bytes).acquire_many_owned(units).await.ok()?) };
        Some(Permits { _count: count, _bytes: bytes, unmetered: None, total: None })
    }

    /// Charges `bytes` more of a request's memory to `permits`: to the connection's
    /// unmetered allowance or to the server's budget, whichever has room first (the
    /// allowance when both do; only the server's when `bytes` exceeds the allowance).
    /// Clients holding the server's budget can so slow another client to what its
    /// allowance holds at a time, but not stop it.
    pub(crate) async fn charge(&self, permits: &mut Permits, bytes: usize) -> Option<()> {
        let units = self.total_units(bytes);
        if units > UNMETERED_UNITS {
            return self.reserve_total(permits, bytes).await;
        }
        if self.try_unmetered(permits, units) {
            return Some(());
        }
        tokio::select! {
            biased;
            p = Arc::clone(&self.unmetered).acquire_many_owned(units) => add(&mut permits.unmetered, p.ok()?),
            p = Arc::clone(&self.total.bytes).acquire_many_owned(units) => add(&mut permits.total, p.ok()?),
        }
        Some(())
    }

    /// Units of the server's budget `bytes` take (at most the whole budget).
    pub(crate) fn total_units(&self, bytes: usize) -> u32 {
        bytes.div_ceil(BYTE_UNIT).min(self.total.units as usize) as u32
    }

    /// Charges `units` ([`BYTE_UNIT`]s) to the connection's unmetered allowance if it
    /// has room for them now; false (nothing charged) if not.
    pub(crate) fn try_unmetered(&self, permits: &mut Permits, units: u32) -> bool {
        if units == 0 {
            return true;
        }
        match Arc::clone(&self.unmetered).try_acquire_many_owned(units) {
            Ok(p) => {
                add(&mut permits.unmetered, p);
                true
            }
            Err(_) => false,
        }
    }

    /// Charges `bytes` to the server's budget in one piece (at most the whole budget),
    /// waiting until it is free. A request takes from the server's budget once, never
    /// a part while it waits for more: parts held while waiting for the rest let WRITEs
    /// deadlock each other.
    pub(crate) async fn reserve_total(&self, permits: &mut Permits, bytes: usize) -> Option<()> {
        let units = self.total_units(bytes);
        if units > 0 {
            add(&mut permits.total, Arc::clone(&self.total.bytes).acquire_many_owned(units).await.ok()?);
        }
        Some(())
    }

    /// [`Budget::admit`] and [`Budget::charge`] of the whole of `bytes`.
    pub(crate) async fn acquire(&self, bytes: usize) -> Option<Permits> {
        let mut permits = self.admit(bytes).await?;
        self.charge(&mut permits, bytes).await?;
        Some(permits)
    }
}

/// Adds `permit` to `slot` (permits of one semaphore).
pub(crate) fn add(slot: &mut Option<OwnedSemaphorePermit>, permit: OwnedSemaphorePermit) {
    match slot {
        Some(held) => held.merge(permit),
        None => *slot = Some(permit),
    }
}

/// The answer to a request that was not run because the server began shutting down
/// (NBD proto.md, "Server-side soft disconnect" and `NBD_ESHUTDOWN`).
pub(crate) const SHUTTING_DOWN: Rejection =
    Rejection { errno: Errno::Eshutdown, message: "the server is shutting down" };

/// How a wait for budget ended.
pub(crate) enum Waited<T> {
    Got(T),
    /// The writer is gone (or the budget closed, as the connection ends): stop reading.
    Gone,
    /// The server began shutting down first: the request is answered `NBD_ESHUTDOWN`
    /// instead of being run.
    ShuttingDown,
}

/// Waits for `budget` (a request's share of the budgets, which other connections may
/// hold for long) unless the writer goes away or, when `shutting_down` is given, the
/// server begins shutting down: a request that has not got its memory yet is not run.
pub(crate) async fn budget_unless_interrupted<T, B>(
    budget: impl Future<Output = Option<T>>,
    tx: &mpsc::Sender<Outgoing<B>>,
    shutting_down: Option<&mut watch::Receiver<bool>>,
) -> Waited<T> {
    let shutdown = async {
        match shutting_down {
            Some(rx) => drop(rx.wait_for(|s| *s).await),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        got = budget => got.map_or(Waited::Gone, Waited::Got),
        _ = tx.closed() => Waited::Gone,
        _ = shutdown => Waited::ShuttingDown,
    }
}
