//! Prometheus metrics: the families the server exports, per-volume handles for the
//! data path, and the HTTP endpoint that serves them (`GET /metrics`, text format).
//!
//! Lives here: [`Metrics`] (the registry and its families), [`VolumeMetrics`] (the
//! counters and histograms of one volume or snapshot, cheap to update per request), and
//! [`serve`]. Pool and connection gauges are read when scraped. Not here: what the
//! numbers mean for the engine (see `storage_engine::PoolStatus`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use storage_engine::Pool;

/// Labels of the per-volume families: the volume (or `VOL@SNAP` snapshot) name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabel {
    /// Volume or snapshot name (the NBD export name).
    pub volume: String,
}

fn latency_histogram() -> Histogram {
    // 10 µs to ~84 s, doubling.
    Histogram::new(exponential_buckets(0.000_01, 2.0, 24))
}

type LatencyFamily = Family<VolumeLabel, Histogram, fn() -> Histogram>;

/// A counter of seconds (a handle: clones add to the same series).
pub type Seconds = Counter<f64, std::sync::atomic::AtomicU64>;

/// Labels of the per-stage request times: the command (`read`, `write`, `other`) and
/// the stage (`receive`, `serve`, `reply`: [`nbd::RequestTimes`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    /// `read`, `write` or `other`.
    pub command: String,
    /// `receive`, `serve` or `reply`.
    pub stage: String,
}

/// The stage histograms of every request, over all volumes (`--request-timing`),
/// indexed by command (read, write, other) then stage (receive, serve, reply).
pub struct RequestStages {
    hist: [[Histogram; 3]; 3],
}

impl RequestStages {
    /// One request's stage times.
    pub fn observe(&self, t: &nbd::RequestTimes) {
        let row = match t.command {
            nbd::proto::Command::Read => &self.hist[0],
            nbd::proto::Command::Write => &self.hist[1],
            _ => &self.hist[2],
        };
        row[0].observe(t.receive.as_secs_f64());
        row[1].observe(t.serve.as_secs_f64());
        row[2].observe(t.reply.as_secs_f64());
    }
}

/// The server's metrics registry and families.
pub struct Metrics {
    registry: Registry,
    read_ops: Family<VolumeLabel, Counter>,
    read_bytes: Family<VolumeLabel, Counter>,
    read_seconds: LatencyFamily,
    write_ops: Family<VolumeLabel, Counter>,
    write_bytes: Family<VolumeLabel, Counter>,
    write_seconds: LatencyFamily,
    flushes: Family<VolumeLabel, Counter>,
    trims: Family<VolumeLabel, Counter>,
    errors: Family<VolumeLabel, Counter>,
    throttled_seconds: Family<VolumeLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    pool_capacity: Gauge,
    pool_used: Gauge,
    pool_metadata: Gauge,
    pool_free: Gauge,
    pool_freeing: Gauge,
    pool_reserved: Gauge,
    pool_failed: Gauge,
    commits: Counter,
    commit_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    commit_max_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    checkpoints: Counter,
    checkpoint_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    checkpoint_max_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    checkpoint_bytes: Counter,
    checkpoint_hold_max_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    nbd_connections: Gauge,
    nbd_stalled: Counter,
    /// Per-stage request times, when they are taken (`--request-timing`).
    stages: Option<Arc<RequestStages>>,
    /// How late each data-plane thread's 10 ms tick ran ([`Metrics::dataplane_lag`]).
    dataplane_lag: Histogram,
    dataplane_lag_max: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Time the data-plane threads spent polling instead of sleeping (`--busy-poll-us`).
    busy_poll_seconds: Seconds,
    /// Names that have series, so that those of deleted volumes can be dropped.
    labelled: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Every family registered, all empty.
    pub fn new() -> Metrics {
        Metrics::with_request_timing(false)
    }

    /// Every family registered, all empty; with `timing`, each NBD request's stage
    /// times are taken and exported as `ferrovol_nbd_request_stage_seconds`.
    pub fn with_request_timing(timing: bool) -> Metrics {
        let mut r = Registry::with_prefix("ferrovol");
        let stage_family: Family<StageLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let stages = timing.then(|| {
            let h = |command: &str, stage: &str| {
                stage_family.get_or_create(&StageLabel { command: command.into(), stage: stage.into() }).clone()
            };
            let row = |c: &str| [h(c, "receive"), h(c, "serve"), h(c, "reply")];
            Arc::new(RequestStages { hist: [row("read"), row("write"), row("other")] })
        });
        let m = Metrics {
            read_ops: Family::default(),
            read_bytes: Family::default(),
            read_seconds: Family::new_with_constructor(latency_histogram),
            write_ops: Family::default(),
            write_bytes: Family::default(),
            write_seconds: Family::new_with_constructor(latency_histogram),
            flushes: Family::default(),
            trims: Family::default(),
            errors: Family::default(),
            throttled_seconds: Family::default(),
            pool_capacity: Gauge::default(),
            pool_used: Gauge::default(),
            pool_metadata: Gauge::default(),
            pool_free: Gauge::default(),
            pool_freeing: Gauge::default(),
            pool_reserved: Gauge::default(),
            pool_failed: Gauge::default(),
            commits: Counter::default(),
            commit_seconds: Counter::default(),
            commit_max_seconds: Gauge::default(),
            checkpoints: Counter::default(),
            checkpoint_seconds: Counter::default(),
            checkpoint_max_seconds: Gauge::default(),
            checkpoint_bytes: Counter::default(),
            checkpoint_hold_max_seconds: Gauge::default(),
            nbd_connections: Gauge::default(),
            nbd_stalled: Counter::default(),
            stages,
            dataplane_lag: Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
            dataplane_lag_max: Gauge::default(),
            busy_poll_seconds: Counter::default(),
            labelled: Default::default(),
            registry: Registry::default(),
        };
        r.register("volume_read_ops", "NBD READ requests answered", m.read_ops.clone());
        r.register("volume_read_bytes", "bytes read", m.read_bytes.clone());
        r.register("volume_read_seconds", "READ latency in the server, seconds", m.read_seconds.clone());
        r.register("volume_write_ops", "NBD WRITE requests answered", m.write_ops.clone());
        r.register("volume_write_bytes", "bytes written", m.write_bytes.clone());
        r.register("volume_write_seconds", "WRITE latency in the server, seconds", m.write_seconds.clone());
        r.register("volume_flushes", "NBD FLUSH requests answered", m.flushes.clone());
        r.register("volume_trims", "NBD TRIM and WRITE_ZEROES requests answered", m.trims.clone());
        r.register("volume_errors", "requests answered with an error", m.errors.clone());
        r.register(
            "volume_throttled_seconds",
            "seconds requests waited for the volume's QoS limits",
            m.throttled_seconds.clone(),
        );
        r.register("pool_capacity_bytes", "pool data capacity", m.pool_capacity.clone());
        r.register("pool_used_bytes", "bytes held by volumes and snapshots", m.pool_used.clone());
        r.register("pool_metadata_bytes", "bytes held by checkpoints", m.pool_metadata.clone());
        r.register("pool_free_bytes", "bytes free", m.pool_free.clone());
        r.register(
            "pool_freeing_bytes",
            "bytes freed by deletes and trims waiting for the commit that makes them allocatable",
            m.pool_freeing.clone(),
        );
        r.register(
            "pool_reserved_bytes",
            "of the free bytes, those held back for metadata checkpoints now (it grows with the metadata)",
            m.pool_reserved.clone(),
        );
        r.register("pool_failed", "1 when the pool refuses writes after an I/O error", m.pool_failed.clone());
        r.register("pool_commits", "metadata commit cycles that wrote log batches", m.commits.clone());
        r.register("pool_commit_seconds", "seconds the commit cycles took", m.commit_seconds.clone());
        r.register(
            "pool_commit_max_seconds",
            "the longest commit cycle since the pool opened",
            m.commit_max_seconds.clone(),
        );
        r.register("pool_checkpoints", "metadata checkpoints written", m.checkpoints.clone());
        r.register("pool_checkpoint_seconds", "seconds the checkpoints took", m.checkpoint_seconds.clone());
        r.register(
            "pool_checkpoint_max_seconds",
            "the longest checkpoint since the pool opened",
            m.checkpoint_max_seconds.clone(),
        );
        r.register(
            "pool_checkpoint_bytes",
            "bytes checkpoints wrote (the blocks of their page and directory chunks)",
            m.checkpoint_bytes.clone(),
        );
        r.register(
            "pool_checkpoint_hold_max_seconds",
            "the longest a checkpoint's first step held the volumes' maps and the allocator (writes that map or \
             allocate waited that long)",
            m.checkpoint_hold_max_seconds.clone(),
        );
        r.register("nbd_connections", "NBD connections open", m.nbd_connections.clone());
        r.register(
            "nbd_stalled_connections",
            "NBD connections closed because a reply or a WRITE payload made no progress for --stall-timeout",
            m.nbd_stalled.clone(),
        );
        r.register(
            "nbd_request_stage_seconds",
            "NBD request times by stage (with --request-timing): receive (header read to start: memory budgets and \
             a WRITE's payload), serve (start to the volume's answer), reply (answer to the reply flushed)",
            stage_family,
        );
        r.register(
            "dataplane_lag_seconds",
            "how late each data-plane thread ran its 10 ms tick: time the thread was busy or blocked",
            m.dataplane_lag.clone(),
        );
        r.register(
            "dataplane_lag_max_seconds",
            "the latest a data-plane thread ran its 10 ms tick since the server started",
            m.dataplane_lag_max.clone(),
        );
        r.register(
            "dataplane_busy_poll_seconds",
            "time the data-plane threads spent in polling windows instead of sleeping, the work done in them included \
             (serve --busy-poll-us)",
            m.busy_poll_seconds.clone(),
        );
        Metrics { registry: r, ..m }
    }

    /// The counter of the time data-plane threads spend polling (`--busy-poll-us`),
    /// exported as `ferrovol_dataplane_busy_poll_seconds_total`: a handle to add to.
    pub fn busy_poll_seconds(&self) -> Seconds {
        self.busy_poll_seconds.clone()
    }

    /// Ticks every 10 ms on the calling runtime until dropped, recording how late each
    /// tick ran: a data-plane thread kept from its tasks (a blocking call, a long
    /// poll, the host descheduling it) shows as lag. Spawn it on each data-plane thread.
    pub fn dataplane_lag(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let m = Arc::clone(self);
        async move {
            const TICK: Duration = Duration::from_millis(10);
            let mut next = tokio::time::Instant::now() + TICK;
            loop {
                tokio::time::sleep_until(next).await;
                let late = tokio::time::Instant::now().saturating_duration_since(next).as_secs_f64();
                m.dataplane_lag.observe(late);
                if late > m.dataplane_lag_max.get() {
                    m.dataplane_lag_max.set(late);
                }
                next = tokio::time::Instant::now() + TICK;
            }
        }
    }

    /// Handles for the series of volume `name` whose id is `id` (created on first use).
    /// The series of an earlier volume of that name (another id, since deleted) are
    /// dropped first, so the new volume's start from zero, and handles still held for
    /// the old one no longer reach the exposition.
    pub fn volume(&self, name: &str, id: u64) -> VolumeMetrics {
        {
            let mut labelled = self.labelled.lock().unwrap_or_else(|e| e.into_inner());
            if labelled.insert(name.to_owned(), id).is_some_and(|old| old != id) {
                self.remove_series(name);
            }
        }
        let l = VolumeLabel { volume: name.to_owned() };
        VolumeMetrics {
            read_ops: self.read_ops.get_or_create(&l).clone(),
            read_bytes: self.read_bytes.get_or_create(&l).clone(),
            read_seconds: self.read_seconds.get_or_create(&l).clone(),
            write_ops: self.write_ops.get_or_create(&l).clone(),
            write_bytes: self.write_bytes.get_or_create(&l).clone(),
            write_seconds: self.write_seconds.get_or_create(&l).clone(),
            flushes: self.flushes.get_or_create(&l).clone(),
            trims: self.trims.get_or_create(&l).clone(),
            errors: self.errors.get_or_create(&l).clone(),
            throttled_seconds: self.throttled_seconds.get_or_create(&l).clone(),
            stages: self.stages.clone(),
        }
    }

    /// Drops the series of volumes and snapshots that no longer exist (by id: a volume
    /// deleted and created again under its name between two scrapes is gone too), so
    /// that a deleted volume's series leave the exposition (a volume created again
    /// under the same name starts new series from zero, which Prometheus reads as a
    /// reset).
    fn forget_deleted(&self, pool: &Pool) {
        let mut labelled = self.labelled.lock().unwrap_or_else(|e| e.into_inner());
        labelled.retain(|name, id| {
            if pool.volume(name).is_ok_and(|v| v.id() == *id) {
                return true;
            }
            self.remove_series(name);
            false
        });
    }

    /// Removes every series labelled with volume `name`.
    fn remove_series(&self, name: &str) {
        let l = VolumeLabel { volume: name.to_owned() };
        for f in [&self.read_ops, &self.read_bytes, &self.write_ops, &self.write_bytes] {
            f.remove(&l);
        }
        for f in [&self.flushes, &self.trims, &self.errors] {
            f.remove(&l);
        }
        self.read_seconds.remove(&l);
        self.write_seconds.remove(&l);
        self.throttled_seconds.remove(&l);
    }

    /// The text exposition (OpenMetrics text format), with the pool gauges read from
    /// `pool` and the NBD server's counts `nbd` now.
    pub fn render(&self, pool: &Pool, nbd: NbdCounts) -> String {
        let s = pool.status();
        self.pool_capacity.set(s.capacity as i64);
        self.pool_used.set(s.used as i64);
        self.pool_metadata.set(s.metadata as i64);
        self.pool_free.set(s.free as i64);
        self.pool_freeing.set(s.freeing as i64);
        self.pool_reserved.set(s.reserved as i64);
        self.forget_deleted(pool);
        self.pool_failed.set(i64::from(s.failed));
        let c = pool.commit_stats();
        follow(&self.commits, c.commits);
        follow_seconds(&self.commit_seconds, c.commit_seconds);
        self.commit_max_seconds.set(c.commit_max_seconds);
        follow(&self.checkpoints, c.checkpoints);
        follow_seconds(&self.checkpoint_seconds, c.checkpoint_seconds);
        self.checkpoint_max_seconds.set(c.checkpoint_max_seconds);
        follow(&self.checkpoint_bytes, c.checkpoint_bytes);
        self.checkpoint_hold_max_seconds.set(c.checkpoint_hold_max_seconds);
        self.nbd_connections.set(nbd.connections as i64);
        follow(&self.nbd_stalled, nbd.stalled_connections);
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

/// Brings `counter` up to `total`, a count kept elsewhere that only grows (the pool's,
/// the NBD server's).
fn follow(counter: &Counter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

/// [`follow`] for a total of seconds.
fn follow_seconds(counter: &Counter<f64, std::sync::atomic::AtomicU64>, total: f64) {
    counter.inc_by((total - counter.get()).max(0.0));
}

/// The series of one volume or snapshot; clones share the same series.
#[derive(Clone)]
pub struct VolumeMetrics {
    read_ops: Counter,
    read_bytes: Counter,
    read_seconds: Histogram,
    write_ops: Counter,
    write_bytes: Counter,
    write_seconds: Histogram,
    flushes: Counter,
    trims: Counter,
    errors: Counter,
    throttled_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// The server's stage histograms, when requests are timed.
    stages: Option<Arc<RequestStages>>,
}

impl VolumeMetrics {
    /// Whether requests are timed by stage (`--request-timing`).
    pub fn times_requests(&self) -> bool {
        self.stages.is_some()
    }

    /// One request's stage times (when timed).
    pub fn request_timed(&self, t: &nbd::RequestTimes) {
        if let Some(s) = &self.stages {
            s.observe(t);
        }
    }

    /// A request held back `took` by the volume's QoS limits.
    pub fn throttled(&self, took: Duration) {
        self.throttled_seconds.inc_by(took.as_secs_f64());
    }

    /// A READ of `bytes` that took `took`; `ok` false counts an error instead.
    pub fn read(&self, bytes: u64, took: Duration, ok: bool) {
        if ok {
            self.read_ops.inc();
            self.read_bytes.inc_by(bytes);
            self.read_seconds.observe(took.as_secs_f64());
        } else {
            self.errors.inc();
        }
    }

    /// A WRITE of `bytes` that took `took`; `ok` false counts an error instead.
    pub fn write(&self, bytes: u64, took: Duration, ok: bool) {
        if ok {
            self.write_ops.inc();
            self.write_bytes.inc_by(bytes);
            self.write_seconds.observe(took.as_secs_f64());
        } else {
            self.errors.inc();
        }
    }

    /// A FLUSH; `ok` false counts an error instead.
    pub fn flush(&self, ok: bool) {
        if ok { &self.flushes } else { &self.errors }.inc();
    }

    /// A TRIM or WRITE_ZEROES; `ok` false counts an error instead.
    pub fn trim(&self, ok: bool) {
        if ok { &self.trims } else { &self.errors }.inc();
    }
}

/// The NBD server's counts at one scrape ([`nbd::Server::connections`],
/// [`nbd::Server::stalled_connections`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NbdCounts {
    /// Connections open now.
    pub connections: usize,
    /// Connections closed for stalling since the server started.
    pub stalled_connections: u64,
}

/// Serves `GET /metrics` (any path) over HTTP/1.1 on `listener` until `shutdown`
/// resolves; `connections` gives the NBD server's counts at scrape time.
pub async fn serve<F, C>(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    pool: Pool,
    connections: C,
    shutdown: F,
) where
    F: Future,
    C: Fn() -> NbdCounts + Clone + Send + Sync + 'static,
{
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::info!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (metrics, pool, connections) = (metrics.clone(), pool.clone(), connections.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |_req| {
                let body = metrics.render(&pool, connections());
                async move {
                    let mut resp = hyper::Response::new(Full::new(Bytes::from(body)));
                    resp.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                    );
                    Ok::<_, Infallible>(resp)
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await
            {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}
