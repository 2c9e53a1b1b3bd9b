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

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tracing::Instrument;

pub use crate::config::{ServerConfig, UNMETERED_BYTES_PER_CONNECTION};
use crate::error::Error;
use crate::export::{Client, ExportRegistry};
use crate::slots::{ConnectionSlot, Live, Placement, PlacementSlot};
use crate::stream::{Progress, Rehome, HANDSHAKE_TIMEOUTS_IN_ALL};
use crate::tls::MaybeTls;
use crate::{budget, handshake, transmission};

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
    total_in_flight: Arc<budget::TotalBudget>,
    /// Connections closed so far because they stalled ([`Error::Stalled`]).
    stalled: AtomicU64,
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
        let total_in_flight = Arc::new(budget::TotalBudget::new(config.max_total_in_flight_bytes));
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
    /// transmission phase"): requests already in flight are answered as usual; with
    /// [`crate::SoftDisconnect::Close`] (the default) no more are read, one not yet run
    /// (still waiting for its share of the memory budget, or for the rest of its
    /// payload) is neither run nor answered, and the connection closes once those in
    /// flight are answered; with [`crate::SoftDisconnect::Eshutdown`] each request
    /// received from now on (and one not yet run) gets `NBD_ESHUTDOWN`, and a
    /// connection is closed when its client disconnects or
    /// [`ServerConfig::shutdown_grace`] has passed.
    /// Connections still in the handshake get `NBD_REP_ERR_SHUTDOWN` for each option
    /// from now on (proto.md "Termination"; `NBD_OPT_EXPORT_NAME` is closed). Stop the
    /// listeners first: this does not.
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
    /// The registry sees the client as [`Client::Other`]; see
    /// [`Server::serve_connection_from`].
    pub async fn serve_connection<S>(&self, stream: S) -> Result<(), Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        self.serve_connection_from(stream, Client::Other).await
    }

    /// [`Server::serve_connection`] for a stream from `client`, which the registry's
    /// lookups and listings are given. Ends with [`Error::Revoked`] when the export is
    /// revoked from the client ([`crate::Export::revoked`]), after answering what is in
    /// flight.
    pub async fn serve_connection_from<S>(&self, stream: S, client: Client) -> Result<(), Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let config = &self.config;
        let mut stream = MaybeTls::Plain(stream);
        let progress = Progress::new();
        let mut tracked = progress.track(&mut stream);
        let shutting_down = self.shutting_down.subscribe();
        let negotiated = tokio::select! {
            r = handshake::handshake(&mut tracked, &*self.registry, &client, config, &self.live, &shutting_down) => r,
            () = progress.stalled(config.handshake_timeout) => Err(Error::HandshakeTimeout(config.handshake_timeout)),
            // Progress or not, a connection slot is not held in the handshake for ever.
            () = tokio::time::sleep(config.handshake_timeout.saturating_mul(HANDSHAKE_TIMEOUTS_IN_ALL)) => {
                Err(Error::HandshakeTimeout(config.handshake_timeout))
            }
        };
        let negotiated = match negotiated {
            Ok(Some(n)) => n,
            end => {
                // proto.md "Termination": a party that ends a TLS session sends TLS's
                // close first (briefly: the peer may be gone).
                if stream.is_tls() {
                    let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
                }
                if end.is_ok() {
                    tracing::debug!("client ended option haggling");
                }
                return end.map(|_| ());
            }
        };
        tracing::debug!(
            export = %self.registry.shown_name(&negotiated.name),
            tls = stream.is_tls(),
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
                let client = match stream.local_addr() {
                    Ok(local) => Client::Tcp { peer, local },
                    Err(_) => Client::Other,
                };
                Ok((stream, client, tracing::info_span!("nbd", %peer)))
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
                Ok((stream, Client::Unix, tracing::info_span!("nbd", unix_conn = id)))
            },
            shutdown,
        )
        .await
    }

    async fn accept_loop<A, AF, S, F>(self: Arc<Self>, mut accept: A, shutdown: F) -> std::io::Result<()>
    where
        A: FnMut() -> AF,
        AF: Future<Output = std::io::Result<(S, Client, tracing::Span)>>,
        S: AsyncRead + AsyncWrite + Unpin + Send + Rehome + 'static,
        F: Future,
    {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return Ok(()),
                accepted = accept() => match accepted {
                    Ok((stream, client, span)) => {
                        let Some(slot) = self.live.enter(self.config.max_connections) else {
                            span.in_scope(|| tracing::warn!(max = self.config.max_connections, "too many connections; closing the new one"));
                            continue;
                        };
                        let server = Arc::clone(&self);
                        let Some(place) = self.runtimes.iter().min_by_key(|p| p.connections.load(Ordering::Acquire)) else {
                            tokio::spawn(server.run_connection(stream, client, slot).instrument(span));
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
                                    Ok(stream) => server.run_connection(stream, client, slot).await,
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
    async fn run_connection<S>(self: Arc<Self>, stream: S, client: Client, slot: ConnectionSlot)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let _slot = slot;
        tracing::debug!("client connected");
        match self.serve_connection_from(stream, client).await {
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
