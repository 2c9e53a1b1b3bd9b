//! Socket I/O of one connection on a data-plane thread, where receives and sends are
//! entries of the thread's io_uring.
//!
//! Lives here: the [`Socket`] trait over compio's TCP and Unix streams, [`RecvBuf`] (the
//! connection's receive buffer: headers and small payloads are taken from it, and a
//! receive in progress survives the caller giving up on it), [`PayloadBuf`] (a WRITE
//! payload received straight into the export's buffer), [`Vectored`] (replies sent
//! with one `sendmsg`, straight from their buffers), and deadlines that never overflow.
//! This is the only module of the crate with `unsafe`.
//! Not here: what the bytes mean (`transmission`, `proto`).
//!
//! # Buffer ownership
//! A receive or send owns its buffer until the kernel's completion arrives: the buffer
//! moves into the operation and comes back with its result. An operation whose future
//! is dropped before then is cancelled, and its buffer is freed only once the kernel is
//! done with it (compio keeps it). Bytes a cancelled receive had taken are lost with
//! it, which would break the framing of the stream, so [`RecvBuf::fill`] never drops a
//! receive it started: a caller that stops waiting leaves it pending for the next
//! call. Direct payload receives and reply sends are dropped only when the connection
//! is given up.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use compio::buf::{BufResult, IntoInner, IoBuf, IoBufMut, IoVectoredBuf, SetLen};
use compio::io::{AsyncRead, AsyncWrite};

/// A connected stream socket on a data-plane thread.
pub trait Socket: 'static {
    /// Receives into `buf` from its first byte (`as_uninit()`, its length then set to
    /// what arrived); `Ok(0)` at end of stream.
    fn recv<B: IoBufMut>(&self, buf: B) -> impl Future<Output = BufResult<usize, B>>;
    /// Sends the slices of `buf` with one `sendmsg`; may send fewer bytes than given.
    fn send<B: IoVectoredBuf>(&self, buf: B) -> impl Future<Output = BufResult<usize, B>>;
    /// Shuts the write side down (the client then reads end of stream).
    fn shutdown_write(&self) -> impl Future<Output = io::Result<()>>;
}

macro_rules! socket_impl {
    ($t:ty) => {
        impl Socket for $t {
            async fn recv<B: IoBufMut>(&self, buf: B) -> BufResult<usize, B> {
                let mut s: &$t = self;
                s.read(buf).await
            }
            async fn send<B: IoVectoredBuf>(&self, buf: B) -> BufResult<usize, B> {
                let mut s: &$t = self;
                s.write_vectored(buf).await
            }
            async fn shutdown_write(&self) -> io::Result<()> {
                let mut s: &$t = self;
                s.shutdown().await
            }
        }
    };
}
socket_impl!(compio::net::TcpStream);
socket_impl!(compio::net::UnixStream);

/// Capacity of a connection's receive buffer, in bytes: at high queue depth one
/// receive takes many request headers (and 4 KiB payloads) at once.
const RECV_CAPACITY: usize = 64 * 1024;

/// Free room below which the receive buffer moves its unread bytes to the front
/// before receiving, in bytes.
const RECV_MIN_ROOM: usize = 16 * 1024;

type Receiving<'s> = Pin<Box<dyn Future<Output = BufResult<usize, Vec<u8>>> + 's>>;

/// The receive side of a connection: bytes received and not yet taken.
pub(crate) struct RecvBuf<'s, S> {
    socket: &'s S,
    /// `buf[start..]` is received and not yet taken; `None` while a receive owns it.
    buf: Option<Vec<u8>>,
    start: usize,
    /// The receive in progress, if any (it owns the buffer).
    receiving: Option<Receiving<'s>>,
}

impl<'s, S: Socket> RecvBuf<'s, S> {
    pub(crate) fn new(socket: &'s S) -> Self {
        RecvBuf { socket, buf: Some(Vec::with_capacity(RECV_CAPACITY)), start: 0, receiving: None }
    }

    /// The bytes received and not yet taken (empty while a receive is in progress).
    pub(crate) fn available(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| &b[self.start..])
    }

    /// Marks the first `n` available bytes as taken.
    pub(crate) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.available().len());
        self.start += n;
    }

    /// Moves up to `dst.len()` available bytes into `dst`; returns how many.
    pub(crate) fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.available().len());
        dst[..n].copy_from_slice(&self.available()[..n]);
        self.consume(n);
        n
    }

    /// Receives more bytes; returns how many arrived (0: end of stream).
    ///
    /// Cancellation-safe: if the returned future is dropped before it completes, the
    /// receive goes on, and the next call takes its bytes.
    pub(crate) fn fill(&mut self) -> impl Future<Output = io::Result<usize>> + use<'_, 's, S> {
        std::future::poll_fn(move |cx| self.poll_fill(cx))
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.receiving.is_none() {
            let mut buf = self.buf.take().expect("idle receive buffer");
            if self.start == buf.len() {
                buf.clear();
                self.start = 0;
            } else if buf.capacity() - buf.len() < RECV_MIN_ROOM {
                buf.drain(..self.start);
                self.start = 0;
            }
            let socket = self.socket;
            self.receiving = Some(Box::pin(async move {
                // Into the room after the bytes already held.
                let held = buf.len();
                let tail = IoBuf::slice(buf, held..);
                let BufResult(r, tail) = socket.recv(tail).await;
                BufResult(r, tail.into_inner())
            }));
        }
        let receiving = self.receiving.as_mut().expect("set above");
        let BufResult(result, buf) = std::task::ready!(receiving.as_mut().poll(cx));
        self.receiving = None;
        self.buf = Some(buf);
        Poll::Ready(result)
    }

    /// Reads one request header of `N` bytes. `Ok(None)`: the stream ended cleanly
    /// before its first byte; an `UnexpectedEof` error if it ended within it.
    /// Cancellation-safe as [`RecvBuf::fill`].
    pub(crate) async fn header<const N: usize>(&mut self) -> io::Result<Option<[u8; N]>> {
        loop {
            if let Some(h) = self.available().get(..N) {
                let h: [u8; N] = h.try_into().expect("N bytes");
                self.consume(N);
                return Ok(Some(h));
            }
            if self.fill().await? == 0 {
                return match self.available().is_empty() {
                    true => Ok(None),
                    false => Err(io::ErrorKind::UnexpectedEof.into()),
                };
            }
        }
    }

    /// Receives into `buf` (a payload's remainder) straight from the socket, after the
    /// available bytes have all been taken. Not cancellation-safe: drop the future only
    /// when giving the connection up.
    pub(crate) async fn recv_direct<B: AsMut<[u8]> + AsRef<[u8]> + 'static>(
        &mut self,
        buf: PayloadBuf<B>,
    ) -> BufResult<usize, PayloadBuf<B>> {
        debug_assert!(self.available().is_empty() && self.receiving.is_none());
        self.socket.recv(buf).await
    }
}

/// The part `buf[at..end]` of a WRITE payload buffer, received into directly; `got`
/// bytes of it have arrived.
pub(crate) struct PayloadBuf<B> {
    pub buf: B,
    pub at: usize,
    pub end: usize,
    pub got: usize,
}

impl<B: AsMut<[u8]> + AsRef<[u8]> + 'static> IoBuf for PayloadBuf<B> {
    fn as_init(&self) -> &[u8] {
        &self.buf.as_ref()[self.at..self.at + self.got]
    }
}

impl<B: AsMut<[u8]> + AsRef<[u8]> + 'static> SetLen for PayloadBuf<B> {
    unsafe fn set_len(&mut self, len: usize) {
        self.got = len.min(self.end - self.at);
    }
}

impl<B: AsMut<[u8]> + AsRef<[u8]> + 'static> IoBufMut for PayloadBuf<B> {
    fn as_uninit(&mut self) -> &mut [MaybeUninit<u8>] {
        let bytes = &mut self.buf.as_mut()[self.at..self.end];
        // SAFETY: MaybeUninit<u8> has the layout of u8, and every byte here is
        // initialised; the kernel only writes initialised bytes into it, so the slice
        // stays valid as `[u8]` for the buffer's owner afterwards.
        unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) }
    }
}

/// Most slices one `sendmsg` is given (the kernel's `UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;

/// Something made of byte slices, sent in order: a batch of replies.
pub(crate) trait Slices: 'static {
    /// Calls `f` with each slice in order until it returns false.
    fn for_each_slice<'a>(&'a self, f: &mut dyn FnMut(&'a [u8]) -> bool);
}

/// `T`'s bytes from `skip` on, at most `limit` of them and [`MAX_IOVECS`] slices, as
/// one vectored send: the part of a batch one `sendmsg` takes.
pub(crate) struct Vectored<T> {
    pub inner: T,
    pub skip: usize,
    pub limit: usize,
}

impl<T: Slices> IoVectoredBuf for Vectored<T> {
    fn iter_slice(&self) -> impl Iterator<Item = &[u8]> {
        let mut out: Vec<&[u8]> = Vec::new();
        let (mut skip, mut left) = (self.skip, self.limit);
        self.inner.for_each_slice(&mut |s: &[u8]| {
            if skip >= s.len() {
                skip -= s.len();
                return true;
            }
            let s = &s[skip..];
            skip = 0;
            let s = &s[..s.len().min(left)];
            left -= s.len();
            if !s.is_empty() {
                out.push(s);
            }
            left > 0 && out.len() < MAX_IOVECS
        });
        out.into_iter()
    }
}

/// `now + d`, or `None` when that is past what an `Instant` holds (never).
pub(crate) fn deadline_after(d: Duration) -> Option<Instant> {
    Instant::now().checked_add(d)
}

/// Resolves at `at`; never if `at` is `None`.
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => compio::runtime::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// `fut`'s output, or `None` if `at` came first (`fut` is then dropped).
pub(crate) async fn before<T>(at: Option<Instant>, fut: impl Future<Output = T>) -> Option<T> {
    let Some(at) = at else {
        return Some(fut.await);
    };
    let fut = std::pin::pin!(fut);
    let timer = std::pin::pin!(compio::runtime::time::sleep_until(at));
    match futures_util::future::select(fut, timer).await {
        futures_util::future::Either::Left((v, _)) => Some(v),
        futures_util::future::Either::Right(_) => None,
    }
}
