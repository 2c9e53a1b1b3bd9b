//! Stream helpers: moving an accepted stream to another runtime ([`Rehome`]), reading a
//! whole message or a clean end ([`read_full_or_eof`]), watching a handshake's
//! progress for its timeout ([`Progress`]), and one transfer's stall timeout
//! ([`within`]). Not here: the protocol (handshake.rs,
//! transmission.rs).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use crate::error::Error;

/// A stream an accept loop can hand to another runtime: taken off the accepting
/// runtime's reactor as a std stream, and registered with the target's.
pub(crate) trait Rehome: Sized {
    /// The std stream (non-blocking).
    type Std: Send + 'static;
    /// The std stream, off this runtime's reactor.
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
pub(crate) const HANDSHAKE_TIMEOUTS_IN_ALL: u32 = 10;

/// When a connection in the handshake last moved a byte, for a timeout on progress.
pub(crate) struct Progress {
    start: tokio::time::Instant,
    /// Nanoseconds from `start` to the last byte read or written.
    last: AtomicU64,
}

impl Progress {
    pub(crate) fn new() -> Progress {
        Progress { start: tokio::time::Instant::now(), last: AtomicU64::new(0) }
    }

    pub(crate) fn touch(&self) {
        self.last.store(self.start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// `stream`, noting here each read or write that moves bytes.
    pub(crate) fn track<'a, S>(&'a self, stream: &'a mut S) -> Tracked<'a, S> {
        Tracked { inner: stream, progress: self }
    }

    /// Resolves once `timeout` has passed without progress.
    pub(crate) async fn stalled(&self, timeout: Duration) {
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
pub(crate) struct Tracked<'a, S> {
    inner: &'a mut S,
    progress: &'a Progress,
}

impl<S> Tracked<'_, S> {
    /// The stream itself (what is done through this is not counted as progress).
    pub(crate) fn inner(&mut self) -> &mut S {
        self.inner
    }
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

/// Runs one socket transfer, ending the connection with [`Error::Stalled`] (`what`) if it
/// takes longer than `stall`.
pub(crate) async fn within<T>(
    stall: Duration,
    what: &'static str,
    transfer: impl Future<Output = std::io::Result<T>>,
) -> Result<T, Error> {
    match tokio::time::timeout(stall, transfer).await {
        Ok(r) => Ok(r?),
        Err(_) => {
            tracing::info!(?stall, what, "closing a stalled connection");
            Err(Error::Stalled(what, stall))
        }
    }
}
