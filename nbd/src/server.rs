//! Public entry points of the NBD server: one connection, or accept loops on TCP and
//! Unix listeners.
//!
//! Lives here: [`ServerConfig`], [`Server`] (the registry, the config, the live
//! connection counts that the caps apply to and the runtimes connections are placed
//! on), its accept loops on TCP and Unix listeners and [`Server::serve_connection`]
//! (handshake under a timeout, then the transmission phase), and the free functions
//! [`serve_tcp`], [`serve_unix`] and [`serve_connection`] for a server of one listener.
//! Not here: the option haggling itself (`handshake`), request handling (`transmission`),
//! wire encoding (`proto`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tracing::Instrument;

use crate::error::Error;
use crate::export::ExportRegistry;
use crate::{handshake, transmission};

/// Tunables of the protocol server. Every field is public; start from
/// [`ServerConfig::default`] and override what you need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// How long a client in the handshake may go without sending or reading a byte;
    /// past it the connection is closed with [`Error::HandshakeTimeout`]. Default 30 s.
    /// A timeout on progress: a client listing hundreds of exports one option at a time
    /// (`nbdinfo --list`, whose libnbd waits about 200 ms per export over TCP, against
    /// any server) is not cut off. The whole handshake may take ten times this at most.
    pub handshake_timeout: Duration,
    /// Largest option data accepted during option haggling, in bytes; a longer option is
    /// a hard disconnect (no buffer of the claimed size is allocated). Default 64 KiB.
    pub max_option_length: u32,
    /// Cap on the maximum block size advertised in `NBD_INFO_BLOCK_SIZE` and enforced on
    /// READ, WRITE and CACHE, in bytes: the export's own maximum is lowered to this (and
    /// never exceeds 1 GiB). Default 32 MiB, the spec's interoperable maximum.
    pub max_payload: u32,
    /// Requests of one connection being processed or waiting for their reply to be
    /// written; when reached, the server stops reading requests (backpressure).
    /// Default 128.
    pub max_in_flight_requests: usize,
    /// READ and WRITE payload bytes of one connection buffered at once (in flight or
    /// waiting to be written); when reached, the server stops reading requests. A single
    /// request larger than this still proceeds, alone. Default 128 MiB.
    pub max_in_flight_bytes: usize,
    /// Bytes requests hold in memory over every connection of one [`Server`]: READ data
    /// and BLOCK_STATUS replies until written (charged when the request is read), WRITE
    /// payloads until the write is answered (charged to the connection's allowance 256
    /// KiB at a time as they arrive while it has room, then the rest to this budget in
    /// one piece, so a header whose payload never comes holds one piece of the
    /// allowance, and no WRITE holds part of this budget while waiting for more). A
    /// request that would pass it waits. So that no client can stop another through
    /// it, each connection also has an allowance of [`UNMETERED_BYTES_PER_CONNECTION`]
    /// outside it, used first: memory is bounded by this plus 2 MiB per connection.
    /// Default 1 GiB.
    pub max_total_in_flight_bytes: usize,
    /// The longest a connection may go without moving 256 KiB of a reply it is being
    /// sent, or of a WRITE payload it is sending (less when less is left); a connection
    /// that takes longer is closed ([`Error::Stalled`]), freeing what it held. A client
    /// that stops reading replies, or sends a payload a byte at a time, holds the server's
    /// memory for at most about this long; a slow client that keeps reading or sending
    /// is not closed (the socket's buffers set how much must drain before the server can
    /// write again: about a third of them). Default 60 s.
    pub stall_timeout: Duration,
    /// Connections open at once over all listeners of one [`Server`]; a client accepted
    /// beyond it is closed at once. Default 1024.
    pub max_connections: usize,
    /// Connections in the transmission phase on one export; `NBD_OPT_GO` beyond it gets
    /// `NBD_REP_ERR_POLICY` (the client may try again later), `NBD_OPT_EXPORT_NAME` a
    /// hard disconnect. Default 128.
    pub max_connections_per_export: usize,
    /// Closes a connection in the transmission phase when no request arrived for this
    /// long while none was in flight. `None` (the default) never closes: the kernel's
    /// client keeps idle connections open for as long as a device is attached.
    pub idle_timeout: Option<Duration>,
    /// After [`Server::shut_down`], how long a connection keeps reading requests
    /// (answering each new one with `NBD_ESHUTDOWN`, finishing those in flight) before
    /// the server closes it. Default 2 s.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(30),
            max_option_length: 64 * 1024,
            max_payload: 32 * 1024 * 1024,
            max_in_flight_requests: 128,
            max_in_flight_bytes: 128 * 1024 * 1024,
            max_total_in_flight_bytes: 1024 * 1024 * 1024,
            stall_timeout: Duration::from_secs(60),
            max_connections: 1024,
            max_connections_per_export: 128,
            idle_timeout: None,
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

/// An NBD server: the exports it offers, its limits, and the connections it has open
/// (which `max_connections` and `max_connections_per_export` count, over every listener
/// it serves).
pub struct Server<R> {
    registry: Arc<R>,
    config: ServerConfig,
    live: Arc<Live>,
    /// Becomes true at [`Server::shut_down`].
    shutting_down: tokio::sync::watch::Sender<bool>,
    /// Where accepted connections run ([`Server::new_on`]); empty: the accept loop's own
    /// runtime.
    runtimes: Vec<Placement>,
    /// The server-wide memory budget ([`ServerConfig::max_total_in_flight_bytes`]).
    total_in_flight: Arc<transmission::TotalBudget>,
    /// Connections closed so far because they stalled ([`Error::Stalled`]).
    stalled: AtomicU64,
}

/// Bytes of memory each connection's requests may hold outside
/// [`ServerConfig::max_total_in_flight_bytes`]: 2 MiB, above the 1280 KiB the
/// Linux kernel's client sends at most in one request by default (its queue's
/// `max_sectors_kb`, seen on Debian's 6.12 kernel).
pub const UNMETERED_BYTES_PER_CONNECTION: usize = 2 << 20;

/// A runtime connections may be placed on, and how many of them it serves now.
struct Placement {
    handle: tokio::runtime::Handle,
    connections: Arc<AtomicUsize>,
}

/// One connection counted on a [`Placement`]; uncounted on drop.
struct PlacementSlot(Arc<AtomicUsize>);

impl Drop for PlacementSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A stream an accept loop can hand to another runtime: taken off the accepting
/// runtime's reactor as a std stream, and registered with the target's.
pub(crate) trait Rehome: Sized {
    /// The std stream (non-blocking).
    type Std: Send + 'static;
    fn into_std(self) -> std::io::Result<Self::Std>;
    /// Must run inside the target runtime.
    fn from_std(s: Self::Std) -> std::io::Result<Self>;
}

impl Rehome for tokio::net::TcpStream {
    type Std = std::net::TcpStream;
    fn into_std(self) -> std::io::Result<Self::Std> {
        tokio::net::TcpStream::into_std(self)
    }
    fn from_std(s: Self::Std) -> std::io::Result<Self> {
        tokio::net::TcpStream::from_std(s)
    }
}

impl Rehome for tokio::net::UnixStream {
    type Std = std::os::unix::net::UnixStream;
    fn into_std(self) -> std::io::Result<Self::Std> {
        tokio::net::UnixStream::into_std(self)
    }
    fn from_std(s: Self::Std) -> std::io::Result<Self> {
        tokio::net::UnixStream::from_std(s)
    }
}

/// Open connections, in all and per export.
#[derive(Default)]
pub(crate) struct Live {
    total: AtomicUsize,
    per_export: Mutex<HashMap<String, usize>>,
}

/// One connection counted in [`Live`]'s total; uncounted on drop.
struct ConnectionSlot(Arc<Live>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection counted against an export; uncounted on drop.
pub(crate) struct ExportSlot {
    live: Arc<Live>,
    name: String,
}

impl Drop for ExportSlot {
    fn drop(&mut self) {
        let mut m = self.live.per_export.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.name);
            }
        }
    }
}

impl Live {
    fn enter(self: &Arc<Self>, max: usize) -> Option<ConnectionSlot> {
        let mut cur = self.total.load(Ordering::Acquire);
        loop {
            if cur >= max {
                return None;
            }
            match self.total.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(ConnectionSlot(Arc::clone(self))),
                Err(now) => cur = now,
            }
        }
    }

    /// Counts one more connection on export `name`, unless it already has `max`.
    pub(crate) fn enter_export(self: &Arc<Self>, name: &str, max: usize) -> Option<ExportSlot> {
        let mut m = self.per_export.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(name.to_owned()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ExportSlot { live: Arc::clone(self), name: name.to_owned() })
    }
}

impl<R: ExportRegistry> Server<R> {
    /// A server of the exports in `registry` with `config`'s limits.
    pub fn new(registry: Arc<R>, config: ServerConfig) -> Arc<Self> {
        Server::new_on(registry, config, Vec::new())
    }

    /// A server like [`Server::new`] whose accept loops place each connection on one of
    /// `runtimes`: the one serving the fewest connections at that moment. With one
    /// current-thread runtime per core, a connection's requests, its storage I/O and its
    /// replies stay on one thread, and connections spread over the cores. The runtimes
    /// need I/O and time enabled and must keep running while connections are open. An
    /// empty list: connections run on the accept loop's runtime.
    pub fn new_on(registry: Arc<R>, config: ServerConfig, runtimes: Vec<tokio::runtime::Handle>) -> Arc<Self> {
        let runtimes = runtimes.into_iter().map(|handle| Placement { handle, connections: Arc::default() }).collect();
        let total_in_flight = Arc::new(transmission::TotalBudget::new(config.max_total_in_flight_bytes));
        Arc::new(Server {
            registry,
            config,
            live: Arc::default(),
            shutting_down: Default::default(),
            runtimes,
            total_in_flight,
            stalled: AtomicU64::new(0),
        })
    }

    /// Starts a soft shutdown of every open connection (NBD proto.md, "Terminating the
    /// transmission phase"): requests already in flight are answered as usual, each
    /// request received from now on gets `NBD_ESHUTDOWN` (as does one still waiting for
    /// its share of the memory budget: it has not run), and a connection is closed
    /// when its client disconnects or [`ServerConfig::shutdown_grace`] has passed.
    /// Connections still in the handshake are unaffected (they end with it or with
    /// the handshake timeout). Stop the listeners first: this does not.
    pub fn shut_down(&self) {
        self.shutting_down.send_replace(true);
    }

    /// The limits this server applies.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Connections open now (handshake or transmission phase), over all listeners.
    pub fn connections(&self) -> usize {
        self.live.total.load(Ordering::Acquire)
    }

    /// Connections the accept loops have closed since the server started because a
    /// reply or a WRITE payload made no progress for [`ServerConfig::stall_timeout`].
    pub fn stalled_connections(&self) -> u64 {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Serves one NBD client on `stream` until it disconnects.
    ///
    /// Runs the fixed newstyle handshake (bounded by [`ServerConfig::handshake_timeout`]),
    /// then the transmission phase with many requests in flight and replies sent as they
    /// complete. Returns `Ok(())` when the client ends the session itself
    /// (`NBD_OPT_ABORT`, `NBD_CMD_DISC`, or closing the connection between messages),
    /// after every in-flight request has been answered. Returns an [`Error`] when the
    /// connection broke, timed out ([`ServerConfig::idle_timeout`],
    /// [`ServerConfig::stall_timeout`]), hit a connection cap
    /// with `NBD_OPT_EXPORT_NAME`, or the server hard-disconnected because the client
    /// violated the protocol (bad magic, unknown client flags, oversized option data,
    /// unknown export with `NBD_OPT_EXPORT_NAME`). Per-request failures never end the
    /// connection: they are sent as error replies.
    ///
    /// This does not count against `max_connections` (the accept loops do). Set
    /// `TCP_NODELAY` on TCP streams before calling this ([`Server::serve_tcp`] does).
    pub async fn serve_connection<S>(&self, mut stream: S) -> Result<(), Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let config = &self.config;
        let progress = Progress::new();
        let mut tracked = progress.track(&mut stream);
        let negotiated = tokio::select! {
            r = handshake::handshake(&mut tracked, &*self.registry, config, &self.live) => r?,
            () = progress.stalled(config.handshake_timeout) => {
                return Err(Error::HandshakeTimeout(config.handshake_timeout));
            }
            // Progress or not, a connection slot is not held in the handshake for ever.
            () = tokio::time::sleep(config.handshake_timeout.saturating_mul(HANDSHAKE_TIMEOUTS_IN_ALL)) => {
                return Err(Error::HandshakeTimeout(config.handshake_timeout));
            }
        };
        let Some(negotiated) = negotiated else {
            tracing::debug!("client ended option haggling");
            return Ok(());
        };
        tracing::debug!(
            export = %negotiated.name,
            structured = negotiated.params.structured,
            block_status = negotiated.params.base_allocation.is_some(),
            "entering transmission phase"
        );
        let total = Arc::clone(&self.total_in_flight);
        transmission::transmission(stream, negotiated, config, total, self.shutting_down.subscribe()).await
    }

    /// Accepts TCP clients until `shutdown` resolves, serving each with
    /// [`Server::serve_connection`] on its own task with `TCP_NODELAY` set.
    ///
    /// A client beyond [`ServerConfig::max_connections`] is closed as soon as it is
    /// accepted. Connection errors are logged with `tracing` (info level) and never stop
    /// the loop; accept errors (such as running out of file descriptors) are logged and
    /// retried after a short pause. When `shutdown` resolves the listener is dropped and
    /// this returns `Ok(())`; connections already accepted keep running until their
    /// clients disconnect.
    pub async fn serve_tcp<F: Future>(self: Arc<Self>, listener: TcpListener, shutdown: F) -> std::io::Result<()> {
        self.accept_loop(
            || async {
                let (stream, peer) = listener.accept().await?;
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
                }
                Ok((stream, tracing::info_span!("nbd", %peer)))
            },
            shutdown,
        )
        .await
    }

    /// Accepts clients on a Unix socket until `shutdown` resolves, serving each with
    /// [`Server::serve_connection`] on its own task. Behaves like [`Server::serve_tcp`]
    /// otherwise.
    pub async fn serve_unix<F: Future>(self: Arc<Self>, listener: UnixListener, shutdown: F) -> std::io::Result<()> {
        let next_id = AtomicU64::new(0);
        self.accept_loop(
            || async {
                let (stream, _addr) = listener.accept().await?;
                let id = next_id.fetch_add(1, Ordering::Relaxed) + 1;
                Ok((stream, tracing::info_span!("nbd", unix_conn = id)))
            },
            shutdown,
        )
        .await
    }

    async fn accept_loop<A, AF, S, F>(self: Arc<Self>, mut accept: A, shutdown: F) -> std::io::Result<()>
    where
        A: FnMut() -> AF,
        AF: Future<Output = std::io::Result<(S, tracing::Span)>>,
        S: AsyncRead + AsyncWrite + Unpin + Send + Rehome + 'static,
        F: Future,
    {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                accepted = accept() => match accepted {
                    Ok((stream, span)) => {
                        let Some(slot) = self.live.enter(self.config.max_connections) else {
                            span.in_scope(|| tracing::warn!(max = self.config.max_connections, "too many connections; closing the new one"));
                            continue;
                        };
                        let server = Arc::clone(&self);
                        let Some(place) = self.runtimes.iter().min_by_key(|p| p.connections.load(Ordering::Acquire)) else {
                            tokio::spawn(server.run_connection(stream, slot).instrument(span));
                            continue;
                        };
                        let std_stream = match stream.into_std() {
                            Ok(s) => s,
                            Err(e) => {
                                span.in_scope(|| tracing::info!(error = %e, "cannot move the connection to its runtime"));
                                continue;
                            }
                        };
                        place.connections.fetch_add(1, Ordering::AcqRel);
                        let placed = PlacementSlot(place.connections.clone());
                        place.handle.spawn(
                            async move {
                                let _placed = placed;
                                match S::from_std(std_stream) {
                                    Ok(stream) => server.run_connection(stream, slot).await,
                                    Err(e) => tracing::info!(error = %e, "cannot register the connection with its runtime"),
                                }
                            }
                            .instrument(span),
                        );
                    }
                    Err(e) => accept_failed(e).await,
                },
            }
        }
    }

    /// An accepted connection's task: serves it and logs how it ended; `slot` counts it
    /// until then.
    async fn run_connection<S>(self: Arc<Self>, stream: S, slot: ConnectionSlot)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let _slot = slot;
        tracing::debug!("client connected");
        match self.serve_connection(stream).await {
            Ok(()) => tracing::debug!("client disconnected"),
            Err(e) => {
                if matches!(e, Error::Stalled(..)) {
                    self.stalled.fetch_add(1, Ordering::Relaxed);
                }
                tracing::info!(error = %e, "connection ended with an error")
            }
        }
    }
}

/// Serves one NBD client on `stream` until it disconnects: [`Server::serve_connection`]
/// on a server of its own.
pub async fn serve_connection<R, S>(registry: Arc<R>, stream: S, config: Arc<ServerConfig>) -> Result<(), Error>
where
    R: ExportRegistry,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    Server::new(registry, (*config).clone()).serve_connection(stream).await
}

/// [`Server::serve_tcp`] on a server of its own (its caps count this listener only).
pub async fn serve_tcp<R, F>(
    listener: TcpListener,
    registry: Arc<R>,
    config: Arc<ServerConfig>,
    shutdown: F,
) -> std::io::Result<()>
where
    R: ExportRegistry,
    F: Future,
{
    Server::new(registry, (*config).clone()).serve_tcp(listener, shutdown).await
}

/// [`Server::serve_unix`] on a server of its own (its caps count this listener only).
pub async fn serve_unix<R, F>(
    listener: UnixListener,
    registry: Arc<R>,
    config: Arc<ServerConfig>,
    shutdown: F,
) -> std::io::Result<()>
where
    R: ExportRegistry,
    F: Future,
{
    Server::new(registry, (*config).clone()).serve_unix(listener, shutdown).await
}

async fn accept_failed(e: std::io::Error) {
    tracing::info!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Fills `buf` from `reader`. Returns `Ok(false)` if the stream ended before the first
/// byte (a clean close between messages) and an `UnexpectedEof` error if it ended part
/// way through.
pub(crate) async fn read_full_or_eof<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..]).await?;
        if n == 0 {
            if filled == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
    }
    Ok(true)
}

/// The longest a whole handshake may take, in handshake timeouts (5 minutes by default:
/// `nbdinfo --list` of 1,500 exports), so that a client trickling bytes cannot hold a
/// connection slot for ever.
const HANDSHAKE_TIMEOUTS_IN_ALL: u32 = 10;

/// When a connection in the handshake last moved a byte, for a timeout on progress.
struct Progress {
    start: tokio::time::Instant,
    /// Nanoseconds from `start` to the last byte read or written.
    last: AtomicU64,
}

impl Progress {
    fn new() -> Progress {
        Progress { start: tokio::time::Instant::now(), last: AtomicU64::new(0) }
    }

    fn touch(&self) {
        self.last.store(self.start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// `stream`, noting here each read or write that moves bytes.
    fn track<'a, S>(&'a self, stream: &'a mut S) -> Tracked<'a, S> {
        Tracked { inner: stream, progress: self }
    }

    /// Resolves once `timeout` has passed without progress.
    async fn stalled(&self, timeout: Duration) {
        loop {
            let last = self.start + Duration::from_nanos(self.last.load(Ordering::Relaxed));
            if last.elapsed() >= timeout {
                return;
            }
            match last.checked_add(timeout) {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                // Past what an Instant can hold: never.
                None => std::future::pending().await,
            }
        }
    }
}

/// A stream that reports its progress to a [`Progress`].
struct Tracked<'a, S> {
    inner: &'a mut S,
    progress: &'a Progress,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<'_, S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut *self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.progress.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<'_, S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut *self.inner).poll_write(cx, buf);
        if matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.progress.touch();
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut *self.inner).poll_shutdown(cx)
    }
}
