//! Per-volume quality of service: limits on a volume's read and write operations and
//! bytes per second, with a burst, kept with the volume (its `ferrovol/qos` label) and
//! enforced on the data path before a request reaches the engine, whichever frontend
//! it came in by.
//!
//! Lives here: the limits ([`QosLimits`]) and their label encoding, one volume's
//! limiter ([`Limiter`]) and the limiters of the served volumes ([`Limiters`]). Not
//! here: the management calls that set them (mgmt.rs), the CSI parameters that name
//! them (the `csi` crate), the time spent throttled (metrics.rs).
//!
//! A limiter is a generic cell rate algorithm (GCRA, the virtual-scheduling form of a
//! token bucket, ITU-T I.371): each limited quantity (read operations, read bytes,
//! write operations, write bytes) keeps a theoretical arrival time `tat`; a request of
//! cost `c` against a rate `r` is released at `max(now, tat - burst)` and moves `tat`
//! on by `c / r`. Requests are released in the order they asked, never before their
//! time. A request is released before its cost is paid: one larger than `burst × rate`
//! goes when its turn comes and holds the next back until it is paid for. So over a
//! long interval a volume gets its rate, ahead by at most one request and the burst,
//! and a volume idle for `burst` may spend `burst × rate` at once. Snapshots are read
//! only and not limited.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The label a volume's limits are kept in, set only by the server (SetVolumeQos, or
/// CreateVolume's `qos`): `read-iops=N,write-iops=N,read-bps=N,write-bps=N,burst-ms=N`,
/// only the limits set.
pub const QOS_LABEL: &str = mgmt_api::QOS_LABEL;

/// Longest burst, in milliseconds (a minute).
pub const MAX_BURST_MS: u32 = 60_000;

/// Lowest byte rate, in bytes per second (1 MiB/s: the largest NBD request, 32 MiB,
/// then holds its volume back at most 32 s).
pub const MIN_BYTES_PER_SECOND: u64 = 1 << 20;

/// One volume's limits; 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosLimits {
    /// READ requests per second.
    pub read_iops: u64,
    /// WRITE, TRIM and WRITE_ZEROES requests per second.
    pub write_iops: u64,
    /// Bytes read per second.
    pub read_bytes_per_second: u64,
    /// Bytes written per second (a WRITE's payload, a WRITE_ZEROES that writes zeros;
    /// TRIM and WRITE_ZEROES that unmap count none).
    pub write_bytes_per_second: u64,
    /// How far ahead of its limits a volume that was idle may run, in milliseconds of
    /// each limit (0: none; at most [`MAX_BURST_MS`]).
    pub burst_ms: u32,
}

/// The label's keys, in the order they are written.
const KEYS: [&str; 5] = ["read-iops", "write-iops", "read-bps", "write-bps", "burst-ms"];

impl QosLimits {
    /// No limit at all.
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(|r| *r == 0)
    }

    /// The four rates: read operations, read bytes, write operations, write bytes.
    fn rates(&self) -> [u64; 4] {
        [self.read_iops, self.read_bytes_per_second, self.write_iops, self.write_bytes_per_second]
    }

    fn values(&self) -> [u64; 5] {
        [
            self.read_iops,
            self.write_iops,
            self.read_bytes_per_second,
            self.write_bytes_per_second,
            u64::from(self.burst_ms),
        ]
    }

    /// Checks the values: byte rates of at least [`MIN_BYTES_PER_SECOND`], a burst of
    /// at most [`MAX_BURST_MS`], and a burst only with a limit to apply it to.
    ///
    /// Errors: the reason, for an INVALID_ARGUMENT.
    pub fn validate(&self) -> Result<(), String> {
        for (what, r) in [("read", self.read_bytes_per_second), ("write", self.write_bytes_per_second)] {
            if r != 0 && r < MIN_BYTES_PER_SECOND {
                return Err(format!("{what} limit of {r} bytes per second is below {MIN_BYTES_PER_SECOND}"));
            }
        }
        if self.burst_ms > MAX_BURST_MS {
            return Err(format!("burst of {} ms is longer than {MAX_BURST_MS} ms", self.burst_ms));
        }
        if self.burst_ms > 0 && self.is_unlimited() {
            return Err("a burst without a limit to apply it to".to_owned());
        }
        Ok(())
    }

    /// The label value; `None` when unlimited (no label).
    pub fn to_label(&self) -> Option<String> {
        if self.is_unlimited() {
            return None;
        }
        let parts: Vec<String> =
            KEYS.iter().zip(self.values()).filter(|(_, v)| *v != 0).map(|(k, v)| format!("{k}={v}")).collect();
        Some(parts.join(","))
    }

    /// Reads a label value written by [`QosLimits::to_label`].
    ///
    /// Errors: the reason, when it is not one (an unknown or repeated key, a value that
    /// is not a number, or limits [`QosLimits::validate`] refuses).
    pub fn from_label(value: &str) -> Result<QosLimits, String> {
        let mut values = [None::<u64>; 5];
        for part in value.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("'{part}' is not KEY=VALUE"))?;
            let i = KEYS.iter().position(|key| *key == k).ok_or_else(|| format!("unknown limit '{k}'"))?;
            let n: u64 = v.parse().map_err(|_| format!("'{k}' is not a number: '{v}'"))?;
            if values[i].replace(n).is_some() {
                return Err(format!("'{k}' given twice"));
            }
        }
        let [ri, wi, rb, wb, burst] = values.map(|v| v.unwrap_or(0));
        let limits = QosLimits {
            read_iops: ri,
            write_iops: wi,
            read_bytes_per_second: rb,
            write_bytes_per_second: wb,
            burst_ms: u32::try_from(burst).map_err(|_| format!("burst of {burst} ms is too long"))?,
        };
        limits.validate()?;
        Ok(limits)
    }

    /// The limits a volume's labels hold: none when there is no label, and none (with
    /// a warning) when the label cannot be read, so that a bad label never stops a
    /// volume from being served.
    pub fn of_labels(name: &str, labels: &storage_engine::Labels) -> QosLimits {
        match labels.get(QOS_LABEL).map(|v| QosLimits::from_label(v)) {
            None => QosLimits::default(),
            Some(Ok(l)) => l,
            Some(Err(why)) => {
                tracing::warn!(volume = name, why, "ignoring an unreadable {QOS_LABEL} label");
                QosLimits::default()
            }
        }
    }
}

impl fmt::Display for QosLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.to_label().as_deref().unwrap_or("unlimited"))
    }
}

/// Which limits a request counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// READ.
    Read,
    /// WRITE, TRIM, WRITE_ZEROES.
    Write,
}

/// The limiter of one volume, shared by every connection (and device) serving it.
pub struct Limiter {
    /// False when unlimited: the data path then takes no lock.
    limited: AtomicBool,
    state: Mutex<Schedule>,
    /// Woken when the limits change, so that waiting requests are scheduled again.
    changed: Notify,
}

/// The limits and, per rate, its theoretical arrival time.
struct Schedule {
    limits: QosLimits,
    /// Read operations, read bytes, write operations, write bytes.
    tat: [Instant; 4],
    /// Counts the changes of limits: a reservation made under older ones is made again.
    generation: u64,
}

impl Schedule {
    /// Reserves a request's place: when it may go. Moves the schedule on.
    fn reserve(&mut self, dir: Direction, bytes: u64, now: Instant) -> Instant {
        let rates = self.limits.rates();
        let burst = Duration::from_millis(u64::from(self.limits.burst_ms));
        let (first, costs) = match dir {
            Direction::Read => (0, [1, bytes]),
            Direction::Write => (2, [1, bytes]),
        };
        let mut at = now;
        for (i, cost) in (first..first + 2).zip(costs) {
            if rates[i] != 0 && cost != 0 {
                at = at.max(self.tat[i].checked_sub(burst).unwrap_or(self.tat[i]));
            }
        }
        for (i, cost) in (first..first + 2).zip(costs) {
            if rates[i] != 0 && cost != 0 {
                // Rounded up: a step is never shorter than the rate allows.
                let nanos = (u128::from(cost) * 1_000_000_000).div_ceil(u128::from(rates[i]));
                let step = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
                self.tat[i] = self.tat[i].max(at) + step;
            }
        }
        at
    }
}

impl Limiter {
    /// A limiter applying `limits`.
    pub fn new(limits: QosLimits) -> Limiter {
        let now = Instant::now();
        Limiter {
            limited: AtomicBool::new(!limits.is_unlimited()),
            state: Mutex::new(Schedule { limits, tat: [now; 4], generation: 0 }),
            changed: Notify::new(),
        }
    }

    /// Whether any limit applies (a request may then have to wait).
    pub fn is_limited(&self) -> bool {
        self.limited.load(Ordering::Relaxed)
    }

    /// The limits applied now.
    pub fn limits(&self) -> QosLimits {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).limits
    }

    /// Applies `limits` from now on, to the requests waiting too: they are scheduled
    /// again under the new limits, from a start with no credit (the burst counts as
    /// spent) and no debt. The same limits again change nothing.
    pub fn set(&self, limits: QosLimits) {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.limits == limits {
                return;
            }
            s.limits = limits;
            let spent = Instant::now() + Duration::from_millis(u64::from(limits.burst_ms));
            s.tat = [spent; 4];
            s.generation += 1;
            self.limited.store(!limits.is_unlimited(), Ordering::SeqCst);
        }
        self.changed.notify_waiters();
    }

    /// Waits until a request in direction `dir` moving `bytes` may go, and returns how
    /// long it waited (zero when it was not held back). Cancel safe: a request dropped
    /// while waiting only leaves its place in the schedule used.
    pub async fn admit(&self, dir: Direction, bytes: u64) -> Duration {
        if !self.limited.load(Ordering::Relaxed) {
            return Duration::ZERO;
        }
        let start = Instant::now();
        // A place kept across a wake-up: (when, under which limits).
        let mut place: Option<(Instant, u64)> = None;
        loop {
            // Registered before the schedule is read: a change after it wakes this one.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = Instant::now();
            let at = {
                let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                match place {
                    // Reserved under the limits in force: keep the place.
                    Some((at, generation)) if generation == s.generation => at,
                    _ => {
                        let at = s.reserve(dir, bytes, now);
                        place = Some((at, s.generation));
                        at
                    }
                }
            };
            if at <= now {
                return now - start;
            }
            tokio::select! {
                biased;
                _ = tokio::time::sleep_until(at) => return Instant::now() - start,
                _ = changed => continue,
            }
        }
    }
}

/// The limiters of the volumes being served, by name, each for the volume's id (a
/// volume deleted and made again under its name gets a new limiter; ids only grow, so
/// a look-up that still holds an older volume never replaces a newer one's).
#[derive(Default)]
pub struct Limiters {
    by_name: Mutex<HashMap<String, (u64, Arc<Limiter>)>>,
    /// Held by whoever changes limits, from storing them to applying them, so that the
    /// limits applied are the ones stored last (every management listener shares it).
    changes: tokio::sync::Mutex<()>,
}

impl Limiters {
    /// The limiter of volume `name` whose id is `id`, made with the limits of its
    /// `labels` when it has none yet. A volume older than the one registered under its
    /// name gets a limiter of its own, not registered (its connections are about to
    /// fail: it was deleted).
    pub fn get(&self, name: &str, id: u64, labels: &storage_engine::Labels) -> Arc<Limiter> {
        let mut m = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(name) {
            Some((i, l)) if *i == id => Arc::clone(l),
            Some((i, _)) if *i > id => Arc::new(Limiter::new(QosLimits::of_labels(name, labels))),
            _ => {
                let l = Arc::new(Limiter::new(QosLimits::of_labels(name, labels)));
                m.insert(name.to_owned(), (id, Arc::clone(&l)));
                l
            }
        }
    }

    /// Applies `limits` to volume `name` (id `id`) at once, on every connection serving
    /// it; called once they are stored with the volume.
    pub fn set(&self, name: &str, id: u64, limits: QosLimits) {
        let mut m = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(name) {
            Some((i, l)) if *i == id => l.set(limits),
            Some((i, _)) if *i > id => {}
            _ => {
                m.insert(name.to_owned(), (id, Arc::new(Limiter::new(limits))));
            }
        }
    }

    /// Forgets volume `name` whose id was `id` (deleted); a newer volume of that name
    /// keeps its limiter.
    pub fn forget(&self, name: &str, id: u64) {
        let mut m = self.by_name.lock().unwrap_or_else(|e| e.into_inner());
        if m.get(name).is_some_and(|(i, _)| *i == id) {
            m.remove(name);
        }
    }

    /// Taken while limits are stored and applied ([`Limiters::set`]).
    pub async fn changing(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.changes.lock().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_bad_ones_are_refused() {
        let l = QosLimits { read_iops: 100, write_bytes_per_second: 1 << 20, burst_ms: 500, ..Default::default() };
        let s = l.to_label().unwrap();
        assert_eq!(s, "read-iops=100,write-bps=1048576,burst-ms=500");
        assert_eq!(QosLimits::from_label(&s), Ok(l));
        assert_eq!(QosLimits::default().to_label(), None);
        for bad in [
            "read-iops",
            "read-iops=x",
            "iops=1",
            "read-iops=1,read-iops=2",
            "burst-ms=10",
            "read-iops=1,burst-ms=60001",
        ] {
            assert!(QosLimits::from_label(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_limited_volume_gets_its_rate_and_a_burst_after_idling() {
        let l = Limiter::new(QosLimits { write_iops: 100, burst_ms: 200, ..Default::default() });
        let start = Instant::now();
        // Idle long enough for the burst: 21 go at once (the one due now and 200 ms
        // worth), the 22nd waits one step.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = Instant::now();
        for _ in 0..21 {
            assert_eq!(l.admit(Direction::Write, 4096).await, Duration::ZERO);
        }
        for _ in 0..1 {
            l.admit(Direction::Write, 4096).await;
        }
        assert_eq!(Instant::now() - t0, Duration::from_millis(10));
        // Then 100 per second, reads untouched.
        let t1 = Instant::now();
        for _ in 0..100 {
            l.admit(Direction::Write, 4096).await;
        }
        assert_eq!(Instant::now() - t1, Duration::from_secs(1));
        assert_eq!(l.admit(Direction::Read, 1 << 20).await, Duration::ZERO);
        assert!(Instant::now() - start < Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_and_operations_both_hold_a_request_back() {
        let l = Limiter::new(QosLimits { read_iops: 1000, read_bytes_per_second: 1 << 20, ..Default::default() });
        let t0 = Instant::now();
        for _ in 0..4 {
            l.admit(Direction::Read, 1 << 18).await;
        }
        // Four quarter-MiB reads at 1 MiB/s: the fourth goes at 0.75 s.
        assert_eq!(Instant::now() - t0, Duration::from_millis(750));
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_grants_no_burst_and_the_same_limits_change_nothing() {
        let limits = QosLimits { write_iops: 100, burst_ms: 1000, ..Default::default() };
        let l = Limiter::new(QosLimits { write_iops: 50, ..Default::default() });
        l.set(limits);
        // No credit after a change: one now, then one every 10 ms.
        let t0 = Instant::now();
        for _ in 0..11 {
            l.admit(Direction::Write, 0).await;
        }
        assert_eq!(Instant::now() - t0, Duration::from_millis(100));
        // Setting the same limits again resets nothing: still one per 10 ms.
        l.set(limits);
        let t1 = Instant::now();
        l.admit(Direction::Write, 0).await;
        assert_eq!(Instant::now() - t1, Duration::from_millis(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_larger_than_the_burst_goes_then_holds_the_next_back() {
        let l = Limiter::new(QosLimits { write_bytes_per_second: 1 << 20, ..Default::default() });
        assert_eq!(l.admit(Direction::Write, 32 << 20).await, Duration::ZERO);
        assert_eq!(l.admit(Direction::Write, 4096).await, Duration::from_secs(32));
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_limit_reaches_requests_already_waiting() {
        let l = Arc::new(Limiter::new(QosLimits { write_iops: 1, ..Default::default() }));
        l.admit(Direction::Write, 0).await;
        // The next would wait a second under the old limit.
        let waiting = tokio::spawn({
            let l = Arc::clone(&l);
            async move { l.admit(Direction::Write, 0).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        l.set(QosLimits::default());
        let waited = waiting.await.unwrap();
        assert_eq!(waited, Duration::from_millis(10));
    }
}
