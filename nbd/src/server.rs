//! Public entry points of the NBD server: one connection, or accept loops on TCP and
//! Unix listeners.
//!
//! Lives here: [`ServerConfig`], [`serve_connection`] (handshake under a timeout, then
//! the transmission phase), [`serve_tcp`] and [`serve_unix`].
//! Not here: the option haggling itself (`handshake`), request handling (`transmission`),
//! wire encoding (`proto`).

use std::future::Future;
use std::sync::Arc;
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
    /// How long a client may take from connecting until it enters the transmission
    /// phase (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`); past it the connection is closed
    /// with [`Error::HandshakeTimeout`]. Default 30 s.
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(30),
            max_option_length: 64 * 1024,
            max_payload: 32 * 1024 * 1024,
            max_in_flight_requests: 128,
            max_in_flight_bytes: 128 * 1024 * 1024,
        }
    }
}

/// Serves one NBD client on `stream` until it disconnects.
///
/// Runs the fixed newstyle handshake (bounded by [`ServerConfig::handshake_timeout`]),
/// then the transmission phase with many requests in flight and replies sent as they
/// complete. Returns `Ok(())` when the client ends the session itself (`NBD_OPT_ABORT`,
/// `NBD_CMD_DISC`, or closing the connection between messages), after every in-flight
/// request has been answered. Returns an [`Error`] when the connection broke or the
/// server hard-disconnected because the client violated the protocol (bad magic,
/// unknown client flags, oversized option data, unknown export with
/// `NBD_OPT_EXPORT_NAME`). Per-request failures never end the connection: they are sent
/// as error replies.
///
/// Set `TCP_NODELAY` on TCP streams before calling this ([`serve_tcp`] does).
pub async fn serve_connection<R, S>(registry: Arc<R>, mut stream: S, config: Arc<ServerConfig>) -> Result<(), Error>
where
    R: ExportRegistry,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let negotiated =
        tokio::time::timeout(config.handshake_timeout, handshake::handshake(&mut stream, &*registry, &config))
            .await
            .map_err(|_| Error::HandshakeTimeout(config.handshake_timeout))??;
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
    transmission::transmission(stream, negotiated, &config).await
}

/// Accepts TCP clients until `shutdown` resolves, serving each with
/// [`serve_connection`] on its own task with `TCP_NODELAY` set.
///
/// Connection errors are logged with `tracing` (info level) and never stop the loop;
/// accept errors (such as running out of file descriptors) are logged and retried after
/// a short pause. When `shutdown` resolves the listener is dropped and this returns
/// `Ok(())`; connections already accepted keep running until their clients disconnect.
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
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
                    }
                    spawn_connection(&registry, &config, stream, tracing::info_span!("nbd", %peer));
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
}

/// Accepts clients on a Unix socket until `shutdown` resolves, serving each with
/// [`serve_connection`] on its own task. Behaves like [`serve_tcp`] otherwise.
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
    tokio::pin!(shutdown);
    let mut next_id: u64 = 0;
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, _addr)) => {
                    next_id += 1;
                    spawn_connection(&registry, &config, stream, tracing::info_span!("nbd", unix_conn = next_id));
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
}

fn spawn_connection<R, S>(registry: &Arc<R>, config: &Arc<ServerConfig>, stream: S, span: tracing::Span)
where
    R: ExportRegistry,
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let registry = Arc::clone(registry);
    let config = Arc::clone(config);
    tokio::spawn(
        async move {
            tracing::debug!("client connected");
            match serve_connection(registry, stream, config).await {
                Ok(()) => tracing::debug!("client disconnected"),
                Err(e) => tracing::info!(error = %e, "connection ended with an error"),
            }
        }
        .instrument(span),
    );
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
