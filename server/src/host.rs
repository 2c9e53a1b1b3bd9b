//! A storage host: the pool, its NBD listeners and data-plane threads, the management
//! API and the metrics endpoint, started and stopped as one ([`Host`]). `ferrovol serve`
//! runs one; tests (and, in-process, the CSI tests) can start one with [`HostOptions`].
//!
//! Lives here: [`HostOptions`] (plain values: what `ferrovol serve`'s flags set),
//! [`Host::start`] and [`Host::shut_down`], the data-plane threads. Not here: the command
//! line (the binary's args.rs), signals (the binary's main.rs), what is served
//! (exports.rs, mgmt.rs, metrics.rs).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use storage_engine::{Pool, PoolOptions};

use crate::access::{Fences, NbdAccess, NbdAccessMode};
use crate::tls::{MtlsAcceptor, TlsFiles};
use crate::{exports, metrics, mgmt};

/// How to run a storage host. [`HostOptions::new`] gives `ferrovol serve`'s defaults.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// Directory for the default pool file (`pool.img`) and sockets; created if missing.
    pub data_dir: PathBuf,
    /// Pool file or block device (default: `<data_dir>/pool.img`, created if missing).
    pub pool: Option<PathBuf>,
    /// Size in bytes of a new pool file.
    pub pool_size: u64,
    /// Grow an existing pool file smaller than `pool_size` to it at start (`serve
    /// --pool-size` given explicitly); a larger pool is kept as it is (a pool never
    /// shrinks). Not for a block device: `ferrovol pool grow` takes a grown device.
    pub grow_to_pool_size: bool,
    /// Data-unit size in bytes of a new pool.
    pub unit_size: u32,
    /// With `pool` a block device: format it if it holds no pool (destroys its contents).
    pub format: bool,
    /// Allocate the whole pool file on the host file system (`PoolOptions::preallocate`).
    pub preallocate: bool,
    /// Pass freed units down to a block device as discards (`PoolOptions::discard`).
    pub discard: bool,
    /// Open despite a damaged newer superblock slot (`PoolOptions::accept_superblock_rollback`).
    pub accept_superblock_rollback: bool,
    /// Open despite a damaged log batch before later commits (`PoolOptions::accept_log_loss`).
    pub accept_log_loss: bool,
    /// TCP address for NBD (port 0: any free port; [`Host::nbd_addr`] tells which).
    pub listen: SocketAddr,
    /// Unix socket for NBD (default: `<data_dir>/nbd.sock`).
    pub nbd_socket: Option<PathBuf>,
    /// Who may open an export over TCP (`auto`: open on a loopback listener only).
    pub nbd_access: NbdAccessMode,
    /// `host:port` addresses nodes reach NBD at, reported instead of the listen address
    /// (behind NAT, or listening on 0.0.0.0); empty: the listen address.
    pub advertise: Vec<String>,
    /// Unix socket for the management API (default: `<data_dir>/ferrovol.sock`,
    /// mode 0600).
    pub mgmt_socket: Option<PathBuf>,
    /// TCP address for the management API, served only with mutual TLS (`tls`).
    pub api_listen: Option<SocketAddr>,
    /// The TLS files of the management API (required with `api_listen`) and of NBD
    /// (required with `nbd_tls`).
    pub tls: Option<TlsFiles>,
    /// NBD over TLS (`NBD_OPT_STARTTLS`) with the `tls` files, offered or required;
    /// `None`: NBD without TLS.
    pub nbd_tls: Option<nbd::TlsMode>,
    /// HTTP address for Prometheus metrics (`GET /metrics`); none by default.
    pub metrics_listen: Option<SocketAddr>,
    /// Time each NBD request by stage (`ferrovol_nbd_request_stage_seconds`): three
    /// clock reads and three histogram updates per request. Off by default.
    pub request_timing: bool,
    /// Enter the kernel once per request for its storage I/O (`IoOptions::immediate_enter`),
    /// instead of once per turn of a data-plane thread for every request that turn
    /// started (the default: less CPU per I/O, BENCHMARKS.md). For comparing the two.
    pub io_immediate_enter: bool,
    /// NBD data-plane threads (at least 1).
    pub dataplane_threads: usize,
    /// How long a data-plane thread keeps polling its sockets and ring after its last
    /// work before it sleeps ([`busy_poll`]); zero (the default) sleeps at once. At
    /// most a millisecond is useful: it is the time a lone request waits for its
    /// thread's wake-up that polling saves, at the price of a busy core.
    pub busy_poll: Duration,
    /// The NBD server's limits (timeouts, connections, memory budgets, shutdown grace).
    pub nbd: nbd::ServerConfig,
}

impl HostOptions {
    /// `ferrovol serve`'s defaults on `data_dir`: a 64 GiB pool of 64 KiB units,
    /// NBD on 127.0.0.1:10809, one data-plane thread, the NBD server's default limits.
    pub fn new(data_dir: impl Into<PathBuf>) -> HostOptions {
        HostOptions {
            data_dir: data_dir.into(),
            pool: None,
            pool_size: storage_engine::DEFAULT_POOL_SIZE,
            grow_to_pool_size: false,
            unit_size: storage_engine::DEFAULT_UNIT_SIZE,
            format: false,
            preallocate: false,
            discard: false,
            accept_superblock_rollback: false,
            accept_log_loss: false,
            listen: SocketAddr::from(([127, 0, 0, 1], 10809)),
            nbd_socket: None,
            nbd_access: NbdAccessMode::Auto,
            advertise: Vec::new(),
            mgmt_socket: None,
            api_listen: None,
            tls: None,
            nbd_tls: None,
            metrics_listen: None,
            request_timing: false,
            io_immediate_enter: false,
            dataplane_threads: 1,
            busy_poll: Duration::ZERO,
            nbd: nbd::ServerConfig::default(),
        }
    }

    /// The pool file or device this host opens.
    pub fn pool_path(&self) -> PathBuf {
        self.pool.clone().unwrap_or_else(|| self.data_dir.join("pool.img"))
    }

    /// The management socket this host listens on.
    pub fn mgmt_socket_path(&self) -> PathBuf {
        self.mgmt_socket.clone().unwrap_or_else(|| self.data_dir.join("ferrovol.sock"))
    }

    /// The NBD unix socket this host listens on.
    pub fn nbd_socket_path(&self) -> PathBuf {
        self.nbd_socket.clone().unwrap_or_else(|| self.data_dir.join("nbd.sock"))
    }
}

/// A running storage host. Dropping it without [`Host::shut_down`] leaves the pool as a
/// crash would (everything acknowledged stays durable).
pub struct Host {
    pool: Pool,
    nbd_addr: SocketAddr,
    nbd_access: NbdAccess,
    nbd_socket: PathBuf,
    mgmt_socket: PathBuf,
    nbd_server: Arc<nbd::Server<exports::PoolRegistry>>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    tcp_task: tokio::task::JoinHandle<std::io::Result<()>>,
    unix_task: tokio::task::JoinHandle<std::io::Result<()>>,
    mgmt_task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    api_task: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
    api_addr: Option<SocketAddr>,
    tls: Option<Arc<MtlsAcceptor>>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    /// Volumes served as local block devices (before `dataplane`: dropped first, as
    /// their requests run there).
    local: Arc<crate::local::LocalDevices>,
    dataplane: DataPlane,
    generation: CrashGenerationFile,
}

impl Host {
    /// Starts a host: binds the NBD listeners (TCP first, so a busy port leaves no
    /// socket file behind), the metrics endpoint and the management socket, then opens
    /// or creates the pool (on the blocking pool) and serves. Call on a tokio runtime,
    /// which then runs the management API and metrics; NBD runs on data-plane threads
    /// of its own.
    ///
    /// Errors: invalid options (`format` on a file, in-flight budgets under 1 MiB), a
    /// busy address or socket, a pool that does not open (its error names the path).
    pub async fn start(opts: HostOptions) -> anyhow::Result<Host> {
        let pool_path = opts.pool_path();
        if opts.format {
            use std::os::unix::fs::FileTypeExt;
            let is_dev = std::fs::metadata(&pool_path).is_ok_and(|m| m.file_type().is_block_device());
            anyhow::ensure!(
                is_dev,
                "--format formats a block device, and {} is not one (a missing pool file is created without it)",
                pool_path.display()
            );
        }
        anyhow::ensure!(
            opts.nbd.max_in_flight_bytes >= 1 << 20,
            "--max-in-flight-bytes must be at least 1MiB (one maximum-size request may still exceed it)"
        );
        anyhow::ensure!(
            opts.nbd.max_total_in_flight_bytes >= 1 << 20,
            "--max-total-in-flight-bytes must be at least 1MiB (one maximum-size request may still exceed it)"
        );
        anyhow::ensure!(
            opts.api_listen.is_none() || opts.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
            "--api-listen serves the management API over TCP only with mutual TLS: give --tls-cert, --tls-key and \
             --tls-client-ca"
        );
        anyhow::ensure!(
            opts.nbd_tls.is_none() || opts.tls.as_ref().is_some_and(|t| t.nbd_client_ca.is_some()),
            "--nbd-tls needs the TLS files: give --tls-cert, --tls-key and --nbd-tls-client-ca"
        );
        if let Some(TlsFiles { client_ca: Some(api), nbd_client_ca: Some(nbd), .. }) = &opts.tls {
            let same =
                std::fs::canonicalize(api).ok().zip(std::fs::canonicalize(nbd).ok()).is_some_and(|(a, b)| a == b)
                    || std::fs::read(api).ok().zip(std::fs::read(nbd).ok()).is_some_and(|(a, b)| a == b);
            anyhow::ensure!(
                !same,
                "--tls-client-ca and --nbd-tls-client-ca name the same CA: every node's certificate would also be \
                 a management API caller's (able to publish any volume to itself); give the nodes a CA of their own"
            );
        }
        if opts.tls.is_some() && opts.api_listen.is_none() && opts.nbd_tls.is_none() {
            tracing::warn!("TLS files given without --api-listen or --nbd-tls: nothing uses them");
        }
        let tls = match &opts.tls {
            Some(files) => Some(Arc::new(MtlsAcceptor::load(files.clone()).context("the TLS files")?)),
            None => None,
        };
        let mut nbd_config = opts.nbd.clone();
        if let (Some(mode), Some(tls)) = (opts.nbd_tls, &tls) {
            nbd_config.tls = Some(nbd::NbdTls { mode, source: Arc::clone(tls) as Arc<dyn nbd::TlsSource> });
        }
        let data_dir = &opts.data_dir;
        std::fs::create_dir_all(data_dir).with_context(|| format!("create data dir {}", data_dir.display()))?;
        let metrics = Arc::new(metrics::Metrics::with_request_timing(opts.request_timing));
        let dataplane = DataPlane::start(opts.dataplane_threads, opts.busy_poll, &metrics.busy_poll_seconds())
            .context("start the NBD data-plane threads")?;
        let pool_opts = PoolOptions {
            size: opts.pool_size,
            unit_size: opts.unit_size,
            io: storage_engine::IoOptions {
                reaper: storage_engine::Reaper::PerRuntime(dataplane.handles.clone()),
                immediate_enter: opts.io_immediate_enter,
                ..Default::default()
            },
            accept_superblock_rollback: opts.accept_superblock_rollback,
            accept_log_loss: opts.accept_log_loss,
            preallocate: opts.preallocate,
            discard: opts.discard,
        };
        // Listen first, so a busy port or socket leaves no new pool file behind.
        let Listeners { tcp, metrics: metrics_listener, unix, mgmt: mgmt_listener, api, nbd_socket, mgmt_socket } =
            Listeners::bind(&opts, &dataplane).await?;
        let pool_existed = pool_path.exists();
        let p = pool_path.clone();
        let format = opts.format;
        let pool = dataplane
            .handle()
            .spawn_blocking(move || {
                // `format` was checked to name a block device above.
                if format {
                    Pool::open_or_format_device(&p, &pool_opts)
                } else {
                    Pool::open_or_create(&p, &pool_opts)
                }
            })
            .await?;
        // A start that fails from here on removes the sockets it bound, and closes the
        // pool once it is open.
        let give_up = |pool: Option<Pool>, e: anyhow::Error| {
            let _ = std::fs::remove_file(&nbd_socket);
            let _ = std::fs::remove_file(&mgmt_socket);
            if let Some(pool) = pool {
                let _ = pool.close();
            }
            e
        };
        let pool = match pool {
            Ok(pool) => pool,
            Err(e) => return Err(give_up(None, anyhow::anyhow!("pool {}: {e}", pool_path.display()))),
        };
        let is_file = std::fs::metadata(&pool_path).is_ok_and(|m| m.file_type().is_file());
        if opts.grow_to_pool_size && pool_existed && is_file {
            let size = pool.status().size;
            if size < opts.pool_size {
                if let Err(e) = pool.grow(Some(opts.pool_size)).await {
                    let e = anyhow::anyhow!("grow pool {} to --pool-size: {e}", pool_path.display());
                    return Err(give_up(Some(pool), e));
                }
            } else if size > opts.pool_size {
                tracing::warn!(
                    pool_bytes = size,
                    pool_size = opts.pool_size,
                    "the pool is larger than --pool-size and a pool never shrinks: kept as it is"
                );
            }
        }
        // Opening with accepted losses drops committed writes: a new generation as well.
        let lossy = opts.accept_log_loss || opts.accept_superblock_rollback;
        let generation = match CrashGenerationFile::start(data_dir, &pool.status().uuid, pool_existed, lossy) {
            Ok(g) => g,
            Err(e) => return Err(give_up(Some(pool), e)),
        };
        let nbd_addr = tcp.local_addr()?;
        let endpoints = vec![format!("nbd://{nbd_addr}"), format!("nbd+unix:///?socket={}", nbd_socket.display())];
        let nbd_access = opts.nbd_access.resolve(nbd_addr);
        let nbd_addresses = if opts.advertise.is_empty() { vec![nbd_addr.to_string()] } else { opts.advertise.clone() };
        tracing::info!(
            nbd_tcp = %nbd_addr,
            nbd_access = nbd_access.as_str(),
            nbd_unix = %nbd_socket.display(),
            management = %mgmt_socket.display(),
            "serving"
        );
        let fences = Arc::new(Fences::default());
        let mut identity = mgmt::HostIdentity {
            endpoints,
            nbd_addresses,
            access: nbd_access,
            tls: opts.nbd_tls,
            fences: Arc::clone(&fences),
            limits: Arc::new(crate::qos::Limiters::default()),
            local: Arc::new(crate::local::LocalDevices::none()),
        };

        if opts.metrics_listen.is_some() {
            // Dropped with the runtimes when they stop.
            for h in &dataplane.handles {
                h.spawn(metrics.dataplane_lag());
            }
        }
        let registry = Arc::new(
            exports::PoolRegistry::new(pool.clone(), metrics.clone(), nbd_access, fences, Arc::clone(&identity.limits))
                .with_crash_generation(&generation.current),
        );
        tracing::info!(crash_generation = %generation.current, "pool generation");
        let local = Arc::new(crate::local::LocalDevices::new(Arc::clone(&registry), dataplane.handles.clone()));
        identity.local = Arc::clone(&local);
        let nbd_server = nbd::Server::new_on(registry, nbd_config, dataplane.handles.clone());
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let metrics_task = metrics_listener.map(|l| {
            if let Ok(addr) = l.local_addr() {
                tracing::info!(%addr, "serving Prometheus metrics at /metrics");
            }
            let server = nbd_server.clone();
            tokio::spawn(metrics::serve(
                l,
                metrics.clone(),
                pool.clone(),
                move || metrics::NbdCounts {
                    connections: server.connections(),
                    stalled_connections: server.stalled_connections(),
                },
                stopped(stop_rx.clone()),
            ))
        });
        let dp = dataplane.handle();
        let tcp_task = dp.spawn(nbd_server.clone().serve_tcp(tcp, stopped(stop_rx.clone())));
        let unix_task = dp.spawn(nbd_server.clone().serve_unix(unix, stopped(stop_rx.clone())));
        let api_addr = api.as_ref().and_then(|l| l.local_addr().ok());
        let api_task = match (api, &tls) {
            (Some(listener), Some(tls)) => {
                tracing::info!(addr = ?api_addr, "serving the management API over mutual TLS");
                let router = tonic::transport::Server::builder()
                    .add_service(mgmt::ManagementService::new(pool.clone(), identity.clone()));
                let incoming = crate::tls::incoming(listener, Arc::clone(tls));
                Some(tokio::spawn(drained(stopped(stop_rx.clone()), |stop| {
                    router.serve_with_incoming_shutdown(incoming, stop)
                })))
            }
            _ => None,
        };
        let router =
            tonic::transport::Server::builder().add_service(mgmt::ManagementService::new(pool.clone(), identity));
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(mgmt_listener);
        let mgmt_task =
            tokio::spawn(drained(stopped(stop_rx.clone()), |stop| router.serve_with_incoming_shutdown(incoming, stop)));
        Ok(Host {
            pool,
            nbd_addr,
            nbd_access,
            nbd_socket,
            mgmt_socket,
            nbd_server,
            stop_tx,
            tcp_task,
            unix_task,
            mgmt_task,
            api_task,
            api_addr,
            tls,
            metrics_task,
            dataplane,
            generation,
            local,
        })
    }

    /// The crash generation served (see [`nbd::client::CrashGeneration`]).
    pub fn crash_generation(&self) -> &nbd::client::CrashGeneration {
        &self.generation.current
    }

    /// The NBD TCP address the host listens on.
    pub fn nbd_addr(&self) -> SocketAddr {
        self.nbd_addr
    }

    /// Who may open an export over TCP, `--nbd-access` resolved.
    pub fn nbd_access(&self) -> NbdAccess {
        self.nbd_access
    }

    /// The NBD unix socket.
    pub fn nbd_socket(&self) -> &Path {
        &self.nbd_socket
    }

    /// The management API's TCP address (with `api_listen`).
    pub fn api_addr(&self) -> Option<SocketAddr> {
        self.api_addr
    }

    /// Reads the TLS files again (SIGHUP): new management API connections and new NBD
    /// TLS sessions use them (sessions already open keep theirs);
    /// on error the files in force stay and the error is returned. Nothing to do
    /// without TLS.
    ///
    /// Errors: as [`MtlsAcceptor::load`].
    pub fn reload_tls(&self) -> anyhow::Result<()> {
        match &self.tls {
            Some(t) => t.reload(),
            None => Ok(()),
        }
    }

    /// The management socket.
    pub fn mgmt_socket(&self) -> &Path {
        &self.mgmt_socket
    }

    /// The pool served.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Stops serving: the listeners close, connections get a soft disconnect (requests
    /// in flight are answered, the rest are left to a reconnecting client unless
    /// `--soft-disconnect eshutdown`; see [`nbd::Server::shut_down`]), the management
    /// API stops, and the
    /// pool is flushed and closed with a checkpoint; the sockets' files are removed.
    ///
    /// Errors: the final checkpoint failed (the log still holds every commit).
    pub async fn shut_down(self) -> anyhow::Result<()> {
        tracing::info!("shutting down: committing what is left and closing the pool");
        let _ = self.stop_tx.send(true);
        let _ = self.tcp_task.await;
        let _ = self.unix_task.await;
        self.nbd_server.shut_down();
        let grace_end = tokio::time::Instant::now() + self.nbd_server.config().shutdown_grace + Duration::from_secs(1);
        while self.nbd_server.connections() > 0 && tokio::time::Instant::now() < grace_end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.mgmt_task.await;
        if let Some(t) = self.api_task {
            let _ = t.await;
        }
        // Local devices go before the pool closes (their requests fail from then on).
        let local = Arc::clone(&self.local);
        let _ = tokio::task::spawn_blocking(move || local.remove_all()).await;
        if let Some(t) = self.metrics_task {
            let _ = t.await;
        }
        let _ = std::fs::remove_file(&self.nbd_socket);
        let _ = std::fs::remove_file(&self.mgmt_socket);
        let flushed = match self.pool.flush().await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "final flush failed");
                false
            }
        };
        let pool = self.pool;
        tokio::task::spawn_blocking(move || pool.close()).await??;
        // Every acknowledged write is in the pool's metadata now: the next start keeps
        // the generation (not after a failed flush: what it lost is unknown).
        if flushed {
            self.generation.stopped_cleanly()?;
        }
        self.dataplane.stop();
        tracing::info!("pool closed cleanly");
        Ok(())
    }
}

/// Serves a management API until `stop`, then gives its calls in flight up to
/// [`mgmt_api::drain::DRAIN_LIMIT`]: a client that stops answering (a CSI controller
/// partitioned away, say) cannot hold the host's shutdown, and so its checkpoint.
async fn drained<F>(
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    serve: impl FnOnce(mgmt_api::drain::Shutdown) -> F,
) -> Result<(), tonic::transport::Error>
where
    F: std::future::Future<Output = Result<(), tonic::transport::Error>>,
{
    use mgmt_api::drain::{serve_with_drain_limit, Stopped, DRAIN_LIMIT};
    if serve_with_drain_limit(stop, DRAIN_LIMIT, serve).await? == Stopped::LimitReached {
        tracing::warn!(limit = ?DRAIN_LIMIT, "management connections still open at the end of the drain; closed");
    }
    Ok(())
}

/// `<data_dir>/crash-generation`: the pool's crash generation and whether a server
/// runs on it (`running`) or stopped cleanly (`stopped`). A start that finds `running`
/// (the last server crashed or was killed) takes the next generation: writes it
/// acknowledged without a flush may be gone, and reconnecting clients must know. So does
/// a start that accepts a damaged log or superblock. A missing file starts a new pool at
/// generation 0, and an existing pool (its file lost) at a random generation of 2^62 or
/// more, which no client can have seen; a file of another pool (the pool was replaced)
/// goes on from the old number plus one.
struct CrashGenerationFile {
    path: PathBuf,
    current: nbd::client::CrashGeneration,
}

impl CrashGenerationFile {
    /// Reads the file, takes this run's generation and records it as running
    /// (written and synced before any client is served).
    ///
    /// Errors: the file cannot be written or synced, or holds something else.
    fn start(data_dir: &Path, pool_uuid: &str, pool_existed: bool, lossy: bool) -> anyhow::Result<CrashGenerationFile> {
        let path = data_dir.join("crash-generation");
        let pool: String =
            pool_uuid.chars().filter(char::is_ascii_hexdigit).take(12).collect::<String>().to_lowercase();
        let generation = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let mut words = text.split_whitespace();
                let (Some(g), Some(state)) = (words.next().and_then(nbd::client::CrashGeneration::parse), words.next())
                else {
                    anyhow::bail!("{} holds {text:?}, not \"POOL.GENERATION running|stopped\"", path.display());
                };
                if g.pool != pool || state != "stopped" || lossy {
                    g.generation + 1
                } else {
                    g.generation
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !pool_existed => 0,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                use std::hash::{BuildHasher, Hasher};
                let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
                (1 << 62) | (random >> 2)
            }
            Err(e) => return Err(anyhow::anyhow!("read {}: {e}", path.display())),
        };
        let file = CrashGenerationFile { path, current: nbd::client::CrashGeneration { pool, generation } };
        file.write("running")?;
        Ok(file)
    }

    fn write(&self, state: &str) -> anyhow::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let ctx = || format!("write {}", self.path.display());
        {
            let mut f = std::fs::File::create(&tmp).with_context(ctx)?;
            std::io::Write::write_all(&mut f, format!("{} {state}\n", self.current).as_bytes()).with_context(ctx)?;
            f.sync_all().with_context(ctx)?;
        }
        std::fs::rename(&tmp, &self.path).with_context(ctx)?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir).and_then(|d| d.sync_all()).with_context(ctx)?;
        }
        Ok(())
    }

    fn stopped_cleanly(&self) -> anyhow::Result<()> {
        self.write("stopped")
    }
}

/// The listeners of a host, bound before its pool is opened.
struct Listeners {
    tcp: tokio::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
    unix: tokio::net::UnixListener,
    mgmt: tokio::net::UnixListener,
    api: Option<tokio::net::TcpListener>,
    nbd_socket: PathBuf,
    mgmt_socket: PathBuf,
}

impl Listeners {
    /// Binds NBD on TCP, then metrics, then the unix sockets (NBD, management): a busy
    /// port leaves no socket file behind, and a busy socket removes those bound before
    /// it. The NBD listeners belong to the data plane's first runtime, the others to the
    /// caller's.
    ///
    /// Errors: an address or socket in use, or not bindable.
    async fn bind(opts: &HostOptions, dataplane: &DataPlane) -> anyhow::Result<Listeners> {
        let nbd_socket = opts.nbd_socket_path();
        let mgmt_socket = opts.mgmt_socket_path();
        let tcp = std::net::TcpListener::bind(opts.listen)
            .and_then(|l| {
                l.set_nonblocking(true)?;
                let _rt = dataplane.handle().enter();
                tokio::net::TcpListener::from_std(l)
            })
            .with_context(|| format!("bind NBD on {}", opts.listen))?;
        // TCP before the unix sockets: a busy port leaves no socket file behind either.
        let metrics_listener = bind_tcp(opts.metrics_listen, "the metrics endpoint").await?;
        let api = bind_tcp(opts.api_listen, "the management API").await?;
        let unix = {
            let _rt = dataplane.handle().enter();
            bind_unix(&nbd_socket)?
        };
        let mgmt_listener = match bind_unix(&mgmt_socket).and_then(|l| {
            // Only the server's user may call the management API over its socket.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&mgmt_socket, std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("make {} private", mgmt_socket.display()))?;
            Ok(l)
        }) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&nbd_socket);
                let _ = std::fs::remove_file(&mgmt_socket);
                return Err(e);
            }
        };
        Ok(Listeners { tcp, metrics: metrics_listener, unix, mgmt: mgmt_listener, api, nbd_socket, mgmt_socket })
    }
}

/// Binds `what` on `addr`, if given, on the caller's runtime.
async fn bind_tcp(addr: Option<SocketAddr>, what: &str) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    match addr {
        Some(addr) => {
            Ok(Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind {what} on {addr}"))?))
        }
        None => Ok(None),
    }
}

/// Binds a unix socket at `path`, replacing a stale socket file (one nobody listens on).
fn bind_unix(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{} is in use by a running server", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("remove stale socket {}", path.display()))?;
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("bind {}", path.display()))
}

thread_local! {
    /// Requests started and finished on this thread: the work [`busy_poll`] watches for.
    static WORK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one request (NBD, or a ublk device's, which the data-plane threads also
/// run) started or finished on the calling thread, for its
/// [`busy_poll`] task: a guard that counts once when made and once when dropped (the
/// request answered or abandoned). Costs two thread-local increments.
pub(crate) struct Working;

impl Working {
    pub(crate) fn begin() -> Working {
        WORK.with(|w| w.set(w.get().wrapping_add(1)));
        Working
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        WORK.with(|w| w.set(w.get().wrapping_add(1)));
    }
}

/// Keeps its data-plane thread from sleeping for `window` after the thread's last NBD
/// request started or finished ([`Working`]): the task yields in a loop, so that the
/// runtime, having a task to come back to, polls its sockets and the ring's eventfd
/// with a zero timeout instead of sleeping in `epoll_wait`. A request or completion
/// arriving meanwhile is then picked up without the thread's sleep and wake-up, which
/// on a virtual machine whose idle vCPU exits to its host is a large part of a QD1
/// round trip (BENCHMARKS.md). After `window` with no request started or finished the
/// task waits on `woke`, which the runtime's unpark hook signals after each sleep, so
/// an idle thread sleeps as before; a wake-up that started or finished no request (a
/// timer, such as the metrics' 10 ms lag probe) polls not at all. The time spent
/// polling is added to `polled` (seconds). The cost: the thread's core stays busy while
/// it polls.
async fn busy_poll(window: Duration, woke: Arc<tokio::sync::Notify>, polled: metrics::Seconds) {
    let work = || WORK.with(std::cell::Cell::get);
    let mut seen = work();
    loop {
        woke.notified().await;
        if work() == seen {
            continue;
        }
        let start = Instant::now();
        let mut until = start + window;
        let mut now = start;
        while now < until {
            seen = work();
            tokio::task::yield_now().await;
            now = Instant::now();
            if work() != seen {
                until = now + window;
            }
        }
        seen = work();
        polled.inc_by((now - start).as_secs_f64());
    }
}

/// The NBD data plane: threads each driving a current-thread tokio runtime that reaps
/// one of the pool's io_urings and serves the NBD connections placed on it, so that a
/// request is received, submitted, completed and answered on one thread with no
/// hand-off. The first also owns the listeners. Management requests run on the caller's
/// runtime.
struct DataPlane {
    /// Every thread's runtime; the first also owns the listeners and opens the pool.
    handles: Vec<tokio::runtime::Handle>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl DataPlane {
    /// Starts `n` (at least 1) threads: `ferrovol-nbd`, then `ferrovol-nbd-1` and on;
    /// each polls for `poll` after its last work before it sleeps ([`busy_poll`]),
    /// counting the time in `polled`.
    fn start(n: usize, poll: Duration, polled: &metrics::Seconds) -> std::io::Result<DataPlane> {
        let (mut handles, mut stops, mut threads) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n.max(1) {
            let woke = Arc::new(tokio::sync::Notify::new());
            let mut builder = tokio::runtime::Builder::new_current_thread();
            builder.enable_all();
            if !poll.is_zero() {
                let woke = Arc::clone(&woke);
                builder.on_thread_unpark(move || woke.notify_one());
            }
            let polled = polled.clone();
            let rt = builder.build()?;
            handles.push(rt.handle().clone());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            stops.push(stop);
            let name = if i == 0 { "ferrovol-nbd".to_owned() } else { format!("ferrovol-nbd-{i}") };
            threads.push(std::thread::Builder::new().name(name).spawn(move || {
                rt.block_on(async {
                    if !poll.is_zero() {
                        tokio::spawn(busy_poll(poll, woke, polled));
                    }
                    let _ = stopped.await;
                });
            })?);
        }
        Ok(DataPlane { handles, stops, threads })
    }

    /// The first thread's runtime (listeners, opening the pool).
    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handles[0]
    }

    /// Stops the runtimes (dropping whatever tasks are left) once the pool is closed.
    fn stop(self) {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}
