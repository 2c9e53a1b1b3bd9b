//! NBD over TLS (proto.md, "TLS support"): the server's TLS modes ([`TlsMode`], the
//! spec's SELECTIVETLS with no TLS-only export, and FORCEDTLS), where its rustls
//! configuration comes from ([`TlsSource`], so that certificates can be replaced while
//! it runs), and the connection's stream, plain until `NBD_OPT_STARTTLS` and TLS after
//! ([`MaybeTls`]).
//!
//! Not here: the option rules (handshake.rs), certificate files and their reloading
//! (the server crate gives a [`TlsSource`]).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// When the server lets a client use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// TLS at the client's choice (`NBD_OPT_STARTTLS` answered, every option and export
    /// served without it too): the spec's SELECTIVETLS mode with no TLS-only export.
    Optional,
    /// TLS first (the spec's FORCEDTLS mode): before `NBD_OPT_STARTTLS`, every option
    /// but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` gets `NBD_REP_ERR_TLS_REQD`, and
    /// `NBD_OPT_EXPORT_NAME`, which cannot be refused, ends the connection.
    Required,
}

/// Gives the rustls configuration for each new TLS session: the server's certificate
/// and key, and how client certificates are verified. Called once per
/// `NBD_OPT_STARTTLS`, so a source that returns a new configuration after its files
/// change (the server reloads them on SIGHUP) takes effect for new sessions only.
pub trait TlsSource: Send + Sync + 'static {
    /// The configuration for a session starting now.
    fn server_config(&self) -> Arc<rustls::ServerConfig>;
}

impl TlsSource for Arc<rustls::ServerConfig> {
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(self)
    }
}

/// A server's TLS: its mode and the source of its configuration
/// ([`crate::ServerConfig::tls`]; `None` there is the spec's NOTLS mode, in which
/// `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`).
#[derive(Clone)]
pub struct NbdTls {
    /// When TLS is offered or required.
    pub mode: TlsMode,
    /// Where each session's configuration comes from.
    pub source: Arc<dyn TlsSource>,
}

impl std::fmt::Debug for NbdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdTls").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl PartialEq for NbdTls {
    fn eq(&self, other: &Self) -> bool {
        self.mode == other.mode && Arc::ptr_eq(&self.source, &other.source)
    }
}

impl Eq for NbdTls {}

/// A connection's stream: plain, then TLS once [`MaybeTls::start_tls`] has run.
pub(crate) enum MaybeTls<S> {
    Plain(S),
    Tls(Box<tokio_rustls::server::TlsStream<S>>),
    /// Between taking the plain stream and the end of the TLS handshake, and for
    /// good after a failed one: every read and write fails.
    Gone,
}

impl<S: AsyncRead + AsyncWrite + Unpin> MaybeTls<S> {
    /// Runs the server side of a TLS handshake on the plain stream.
    ///
    /// Errors: the handshake failed (the client's certificate was refused, the
    /// connection broke); the stream is then unusable. Called on a TLS stream: an error
    /// (the handshake code checks that first).
    pub(crate) async fn start_tls(&mut self, config: Arc<rustls::ServerConfig>) -> io::Result<()> {
        let MaybeTls::Plain(plain) = std::mem::replace(self, MaybeTls::Gone) else {
            return Err(io::Error::other("TLS is already in use on this connection"));
        };
        let tls = tokio_rustls::TlsAcceptor::from(config).accept(plain).await?;
        *self = MaybeTls::Tls(Box::new(tls));
        Ok(())
    }

    /// Whether TLS is in use.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }

    /// The client's certificate (DER, the leaf), when TLS is in use and it gave one.
    pub(crate) fn peer_certificate(&self) -> Option<Arc<[u8]>> {
        match self {
            MaybeTls::Tls(t) => t.get_ref().1.peer_certificates()?.first().map(|c| Arc::from(c.as_ref())),
            _ => None,
        }
    }
}

fn gone() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the connection's TLS handshake failed")
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            MaybeTls::Gone => Poll::Ready(Err(gone())),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            MaybeTls::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            MaybeTls::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
            MaybeTls::Gone => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            MaybeTls::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            MaybeTls::Gone => Poll::Ready(Ok(())),
        }
    }
}
