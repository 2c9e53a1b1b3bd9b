//! The transmission phase (proto.md, "Transmission", "Request types", "Error values",
//! "Block size constraints").
//!
//! Lives here: the request reader (parses headers, validates each request against the
//! negotiated state and the export size read at that moment, receives or discards WRITE
//! payloads, and runs each accepted request as a future polled inside the connection's
//! task), the execution of requests against the export, and the stall timeout on
//! replies and WRITE payloads. Not here: option haggling (`handshake`), byte layouts
//! (`proto`), replies and their writer (`reply`), the budgets requests wait for
//! (`budget`).
//!
//! Ordering: replies go out as requests complete, in any order (proto.md, "Ordering of
//! messages and writes"). `NBD_CMD_FLUSH` calls [`Export::flush`] when it is processed;
//! every write replied to before the flush was received has completed, and the export
//! contract makes completed writes durable on flush. `NBD_CMD_DISC` stops reading, waits
//! for every in-flight request, writes their replies and closes.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, BufReader};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::budget::{budget_unless_interrupted, Budget, TotalBudget, Waited, SHUTTING_DOWN};
use crate::config::{ServerConfig, SoftDisconnect, BYTE_UNIT, MAX_BLOCK_STATUS_DESCRIPTORS, STALL_CHUNK};
use crate::error::Error;
use crate::export::{Errno, Export};
use crate::handshake::{Negotiated, Params};
use crate::proto::*;
use crate::reply::*;
use crate::stream::{read_full_or_eof, within};

/// A request that passed validation, ready to run against the export. Offsets and
/// lengths are in bytes and within the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read { offset: u64, len: u32, df: bool },
    Write { offset: u64, len: u32, fua: bool },
    Flush,
    Trim { offset: u64, len: u32, fua: bool },
    WriteZeroes { offset: u64, len: u32, may_unmap: bool, fast_only: bool, fua: bool },
    Cache { offset: u64, len: u32 },
    BlockStatus { offset: u64, len: u32, req_one: bool, context_id: u32 },
}

impl Op {
    /// Bytes this request holds in memory until its reply is written: its READ data or
    /// WRITE payload, or the descriptors of its BLOCK_STATUS reply (8 bytes each, at most
    /// one per byte of the range and [`MAX_BLOCK_STATUS_DESCRIPTORS`] in all).
    fn memory_bytes(&self) -> usize {
        match *self {
            Op::Read { len, .. } | Op::Write { len, .. } => len as usize,
            Op::BlockStatus { len, .. } => (len as usize).min(MAX_BLOCK_STATUS_DESCRIPTORS) * 8,
            _ => 0,
        }
    }
}

fn reject(errno: Errno, message: &'static str) -> Rejection {
    Rejection { errno, message }
}

/// Validates a request (anything but `NBD_CMD_DISC`) against the negotiated parameters
/// and the current export size in bytes, following proto.md "Error values", "Command
/// flags" and "Block size constraints":
///
/// - unknown command, or a flag not valid for the command → `NBD_EINVAL`;
/// - WRITE, TRIM or WRITE_ZEROES on a read-only export → `NBD_EPERM`;
/// - TRIM / WRITE_ZEROES not offered, BLOCK_STATUS without a negotiated context → `NBD_EINVAL`;
/// - FLUSH with nonzero offset or length → `NBD_EINVAL`;
/// - zero length, misalignment to the minimum block size (except a request ending exactly
///   at the end of the export), or READ/WRITE/CACHE longer than the maximum block size →
///   `NBD_EINVAL`;
/// - past the end of the export → `NBD_ENOSPC` for WRITE and WRITE_ZEROES, `NBD_EINVAL`
///   otherwise.
///
/// TRIM and WRITE_ZEROES are not held to the maximum block size: they carry no payload,
/// and clients such as the Linux kernel send large ones.
pub(crate) fn check(req: &Request, params: &Params, size: u64) -> Result<Op, Rejection> {
    let tflags = params.transmission_flags;
    let flag_if = |cond: bool, flag: u16| if cond { flag } else { 0 };
    let allowed = match req.command {
        Command::Read => NBD_CMD_FLAG_FUA | flag_if(tflags & NBD_FLAG_SEND_DF != 0, NBD_CMD_FLAG_DF),
        Command::Write | Command::Flush | Command::Trim | Command::Cache | Command::Disc => NBD_CMD_FLAG_FUA,
        Command::WriteZeroes => {
            NBD_CMD_FLAG_FUA
                | NBD_CMD_FLAG_NO_HOLE
                | flag_if(tflags & NBD_FLAG_SEND_FAST_ZERO != 0, NBD_CMD_FLAG_FAST_ZERO)
        }
        Command::BlockStatus => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
        Command::Unsupported(_) => return Err(reject(Errno::Einval, "unknown command")),
    };
    if req.flags & !allowed != 0 {
        return Err(reject(Errno::Einval, "command flag not valid for this command"));
    }
    let fua = req.flags & NBD_CMD_FLAG_FUA != 0;

    let writes = matches!(req.command, Command::Write | Command::Trim | Command::WriteZeroes);
    if writes && tflags & NBD_FLAG_READ_ONLY != 0 {
        return Err(reject(Errno::Eperm, "export is read-only"));
    }
    match req.command {
        Command::Trim if tflags & NBD_FLAG_SEND_TRIM == 0 => {
            return Err(reject(Errno::Einval, "trim is not supported by this export"));
        }
        Command::WriteZeroes if tflags & NBD_FLAG_SEND_WRITE_ZEROES == 0 => {
            return Err(reject(Errno::Einval, "write zeroes is not supported by this export"));
        }
        Command::BlockStatus if params.base_allocation.is_none() => {
            return Err(reject(Errno::Einval, "no metadata context was negotiated"));
        }
        Command::Flush => {
            if req.offset != 0 || req.length != 0 {
                return Err(reject(Errno::Einval, "flush offset and length must be zero"));
            }
            return Ok(Op::Flush);
        }
        _ => {}
    }

    let (offset, len) = (req.offset, req.length);
    if len == 0 {
        return Err(reject(Errno::Einval, "zero-length request"));
    }
    let end = offset.checked_add(u64::from(len));
    let min = u64::from(params.limits.minimum);
    if offset % min != 0 || (u64::from(len) % min != 0 && end != Some(size)) {
        return Err(reject(Errno::Einval, "request not aligned to the minimum block size"));
    }
    if matches!(req.command, Command::Read | Command::Write | Command::Cache) && len > params.limits.maximum {
        return Err(reject(Errno::Einval, "request longer than the maximum block size"));
    }
    if end.is_none_or(|end| end > size) {
        return Err(match req.command {
            Command::Write | Command::WriteZeroes => {
                reject(Errno::Enospc, "request extends past the end of the export")
            }
            _ => reject(Errno::Einval, "request extends past the end of the export"),
        });
    }

    Ok(match req.command {
        Command::Read => Op::Read { offset, len, df: req.flags & NBD_CMD_FLAG_DF != 0 },
        Command::Write => Op::Write { offset, len, fua },
        Command::Trim => Op::Trim { offset, len, fua },
        Command::WriteZeroes => Op::WriteZeroes {
            offset,
            len,
            may_unmap: req.flags & NBD_CMD_FLAG_NO_HOLE == 0,
            fast_only: req.flags & NBD_CMD_FLAG_FAST_ZERO != 0,
            fua,
        },
        Command::Cache => Op::Cache { offset, len },
        Command::BlockStatus => Op::BlockStatus {
            offset,
            len,
            req_one: req.flags & NBD_CMD_FLAG_REQ_ONE != 0,
            context_id: params.base_allocation.unwrap_or(0),
        },
        // Handled above or before calling; kept total without panicking.
        Command::Flush => Op::Flush,
        Command::Disc | Command::Unsupported(_) => {
            return Err(reject(Errno::Einval, "unexpected command"));
        }
    })
}

/// Runs one validated READ and builds its reply. Apart from [`execute`] so that the boxed
/// future of a read, the most frequent request, holds only the read's state: a request's
/// future is moved into its own allocation, and `execute`'s holds the largest of every
/// operation's futures.
async fn execute_read<E: Export>(
    export: &E,
    structured: bool,
    handle: u64,
    offset: u64,
    len: u32,
    df: bool,
) -> Reply<E::ReadBuf> {
    match export.read(offset, len).await {
        Ok(data) => read_reply(structured, handle, offset, len, df, data),
        Err(errno) => error_reply(structured, handle, errno, "read failed"),
    }
}

/// Runs one validated request against the export and builds its reply.
async fn execute<E: Export>(export: &E, structured: bool, handle: u64, op: Op) -> Reply<E::ReadBuf> {
    match op {
        Op::Read { offset, len, df } => execute_read(export, structured, handle, offset, len, df).await,
        Op::Flush => done(structured, handle, export.flush().await, "flush failed"),
        Op::Trim { offset, len, fua } => {
            done(structured, handle, export.trim(offset, u64::from(len), fua).await, "trim failed")
        }
        Op::WriteZeroes { offset, len, may_unmap, fast_only, fua } => done(
            structured,
            handle,
            export.write_zeroes(offset, u64::from(len), may_unmap, fast_only, fua).await,
            "write zeroes failed",
        ),
        Op::Cache { offset, len } => {
            done(structured, handle, export.cache(offset, u64::from(len)).await, "cache failed")
        }
        Op::BlockStatus { offset, len, req_one, context_id } => match export.block_status(offset, u64::from(len)) {
            Ok(extents) => {
                let d = block_descriptors(&extents, len, req_one);
                Reply::bytes(encode_block_status(handle, context_id, &d, true))
            }
            Err(errno) => error_reply(structured, handle, errno, "block status failed"),
        },
        // WRITE carries a buffer and runs through `execute_write`.
        Op::Write { .. } => error_reply(structured, handle, Errno::Eio, "internal error"),
    }
}

// ---------------------------------------------------------------------------------------
// Reader, writer, and the connection
// ---------------------------------------------------------------------------------------

/// Runs the transmission phase on `stream` until the client disconnects.
pub(crate) async fn transmission<E, S>(
    stream: S,
    negotiated: Negotiated<E>,
    config: &ServerConfig,
    total: Arc<TotalBudget>,
    shutting_down: watch::Receiver<bool>,
) -> Result<(), Error>
where
    E: Export,
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let stall = config.stall_timeout;
    let timed_export = negotiated.export.times_requests().then(|| Arc::clone(&negotiated.export));
    let report = |t: &crate::export::RequestTimes| {
        if let Some(e) = &timed_export {
            e.request_timed(t)
        }
    };
    let (reader, writer) = tokio::io::split(stream);
    // Requests arrive back to back at high queue depth: one receive takes many headers.
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    let capacity = config.max_in_flight_requests.clamp(1, Semaphore::MAX_PERMITS);
    let (tx, rx) = mpsc::channel(capacity);
    let (read_result, write_result) = tokio::join!(
        read_requests(&mut reader, negotiated, tx, config, total, shutting_down),
        write_replies(writer, rx, stall, timed_export.is_some().then_some(&report as &(dyn Fn(&_) + Sync))),
    );
    // A writer failure is the root cause when both ended badly.
    write_result?;
    read_result
}

/// Reads and drops `len` bytes of a WRITE payload, each [`STALL_CHUNK`] within `stall`.
async fn discard<R: AsyncRead + Unpin>(reader: &mut R, len: u32, stall: Duration) -> Result<(), Error> {
    let mut left = u64::from(len);
    while left > 0 {
        let n = left.min(STALL_CHUNK as u64);
        let (mut part, mut sink) = ((&mut *reader).take(n), tokio::io::sink());
        let copied = within(stall, "receiving a WRITE payload", tokio::io::copy(&mut part, &mut sink)).await?;
        if copied != n {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        left -= n;
    }
    Ok(())
}

/// Resolves once the connection has had nothing in flight at the end of an `idle` period
/// (so between `idle` and twice it after the last request); never without a timeout.
async fn idle_expired(budget: &Budget, idle: Option<Duration>) {
    let Some(idle) = idle else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(idle).await;
        if budget.count.available_permits() == budget.count_total {
            return;
        }
    }
}

/// Why a WRITE payload was not received whole.
enum Interrupted {
    /// The writer is gone or the budget closed: stop reading.
    Gone,
    Failed(Error),
    /// The server began shutting down while the payload waited for budget; `received`
    /// bytes of it were read.
    ShuttingDown {
        received: u32,
    },
}

/// What receiving one WRITE payload needs.
struct Payload<'a, B> {
    budget: &'a Budget,
    tx: &'a mpsc::Sender<Outgoing<B>>,
    /// `None` once the connection knows of the shutdown.
    shutting_down: Option<&'a mut watch::Receiver<bool>>,
    stall: Duration,
}

impl<B> Payload<'_, B> {
    /// Reads `dst` from `reader`, each [`STALL_CHUNK`] within the stall timeout. Each
    /// chunk is charged to the connection's unmetered allowance before it is read, while
    /// the allowance has room; once it has none, everything still to come is charged to
    /// the server's budget in one piece before more is read. So a client that sends a
    /// WRITE header and little payload holds little of the server's budget, and no WRITE
    /// holds part of it while waiting for more (which deadlocked concurrent WRITEs, and
    /// a single WRITE larger than the budget).
    async fn receive<R: AsyncRead + Unpin>(
        mut self,
        reader: &mut R,
        dst: &mut [u8],
        permits: &mut Permits,
    ) -> Result<(), Interrupted> {
        let len = dst.len();
        let mut received = 0u32;
        let mut reserved = false;
        for chunk in dst.chunks_mut(STALL_CHUNK) {
            let units = chunk.len().div_ceil(BYTE_UNIT) as u32;
            if !reserved && !self.budget.try_unmetered(permits, units) {
                let rest = self.budget.reserve_total(permits, len - received as usize);
                match budget_unless_interrupted(rest, self.tx, self.shutting_down.as_deref_mut()).await {
                    Waited::Got(()) => reserved = true,
                    Waited::Gone => return Err(Interrupted::Gone),
                    Waited::ShuttingDown => return Err(Interrupted::ShuttingDown { received }),
                }
            }
            let read = within(self.stall, "receiving a WRITE payload", reader.read_exact(chunk));
            read.await.map_err(Interrupted::Failed)?;
            received += chunk.len() as u32;
        }
        Ok(())
    }
}

/// A request's run against the export, ending with its reply handed to the writer.
type Running = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one pass of [`RequestReader::next`] produced.
enum Intake {
    /// A validated request, to run concurrently with the ones in flight.
    Run(Running),
    /// Nothing to run: the request was answered without the export (rejected), or the
    /// server began shutting down.
    Next,
    /// Stop reading requests, for this reason.
    Stop(Result<(), Error>),
}

/// The reading side of one connection: everything [`RequestReader::next`] needs to
/// take one request off the stream.
struct RequestReader<'a, E: Export, R> {
    reader: &'a mut R,
    export: Arc<E>,
    params: Params,
    budget: Budget,
    tx: mpsc::Sender<Outgoing<E::ReadBuf>>,
    config: &'a ServerConfig,
    shutting_down: watch::Receiver<bool>,
    /// Set once the server shuts down: new requests get ESHUTDOWN until then.
    close_at: Option<tokio::time::Instant>,
    /// The export times requests ([`Export::times_requests`]).
    timed: bool,
}

impl<E: Export, R: AsyncRead + Unpin> RequestReader<'_, E, R> {
    /// Starts the shutdown grace period: every request from now on is answered
    /// `NBD_ESHUTDOWN`, and the connection closes when the period ends.
    fn begin_closing(&mut self) {
        // Capped at a year: `Instant + Duration` overflows on larger ones.
        let grace = self.config.shutdown_grace.min(Duration::from_secs(365 * 86_400));
        self.close_at = Some(tokio::time::Instant::now() + grace);
    }

    /// Reads one request (its header, and a WRITE's payload), validates it, and waits
    /// for its share of the connection's budget. A rejected request is answered here.
    /// (Some 115 lines: one request's way from header to run, as one sequence of early
    /// returns, each a way the connection may end; the WRITE payload is
    /// [`Self::receive_write`].)
    async fn next(&mut self) -> Intake {
        let structured = self.params.structured;
        let mut header = [0u8; REQUEST_HEADER_LEN];
        let mut shutdown_began = false;
        let got = {
            let close_at = self.close_at;
            tokio::select! {
                // In this order: a revocation wins over a request the client has
                // already sent, which then runs no more.
                biased;
                // The writer failed: nothing more can be answered.
                _ = self.tx.closed() => None,
                _ = self.shutting_down.wait_for(|s| *s), if close_at.is_none() => {
                    shutdown_began = true;
                    None
                }
                _ = sleep_until_some(close_at) => {
                    tracing::info!("closing a connection: the server is shutting down");
                    return Intake::Stop(Ok(()));
                }
                // Requests in flight are still answered (read_requests waits for them).
                () = self.export.revoked() => {
                    tracing::info!("closing a connection: its access to the export was revoked");
                    return Intake::Stop(Err(Error::Revoked));
                }
                _ = idle_expired(&self.budget, self.config.idle_timeout) => {
                    let idle = self.config.idle_timeout.unwrap_or_default();
                    tracing::info!(?idle, "closing an idle connection");
                    return Intake::Stop(Err(Error::IdleTimeout(idle)));
                }
                got = read_full_or_eof(self.reader, &mut header) => Some(got),
            }
        };
        if shutdown_began {
            if self.config.soft_disconnect == SoftDisconnect::Close {
                tracing::info!("closing a connection: the server is shutting down");
                return Intake::Stop(Ok(()));
            }
            self.begin_closing();
            return Intake::Next;
        }
        let Some(got) = got else {
            return Intake::Stop(Ok(()));
        };
        let header_at = self.timed.then(Instant::now);
        match got {
            Ok(true) => {}
            Ok(false) => {
                tracing::debug!("client closed the connection without NBD_CMD_DISC");
                return Intake::Stop(Ok(()));
            }
            Err(e) => return Intake::Stop(Err(e.into())),
        }
        let request = match Request::parse(&header) {
            Ok(r) => r,
            Err(e) => return Intake::Stop(Err(Error::protocol(format!("request header: {e}")))),
        };
        tracing::trace!(?request, "request received");
        if request.command == Command::Disc {
            return Intake::Stop(Ok(()));
        }

        let handle = request.handle;
        let mut checked = match self.close_at {
            Some(_) => Err(SHUTTING_DOWN),
            None => check(&request, &self.params, self.export.size()),
        };
        let memory = checked.as_ref().map_or(0, Op::memory_bytes);
        // A WRITE's payload is charged as it arrives, the rest's memory now.
        let is_write = matches!(checked, Ok(Op::Write { .. }));
        let budget = &self.budget;
        let waited = budget_unless_interrupted(
            async move {
                match is_write {
                    true => budget.admit(memory).await,
                    false => budget.acquire(memory).await,
                }
            },
            &self.tx,
            self.close_at.is_none().then_some(&mut self.shutting_down),
        )
        .await;
        let permits = match waited {
            Waited::Got(permits) => permits,
            Waited::Gone => return Intake::Stop(Ok(())),
            // Not run yet: the request is answered as one sent after the shutdown began.
            Waited::ShuttingDown if self.config.soft_disconnect == SoftDisconnect::Close => {
                // Read but not run, and not answered: a reconnecting client sends it again.
                tracing::info!("closing a connection: the server is shutting down");
                return Intake::Stop(Ok(()));
            }
            Waited::ShuttingDown => {
                self.begin_closing();
                checked = Err(SHUTTING_DOWN);
                match self.budget.acquire(0).await {
                    Some(permits) => permits,
                    None => return Intake::Stop(Ok(())),
                }
            }
        };
        let stall = self.config.stall_timeout;

        let op = match checked {
            Ok(op) => op,
            Err(rejection) => {
                tracing::debug!(?request, ?rejection, "request rejected");
                if request.command == Command::Write {
                    if let Err(e) = discard(self.reader, request.length, stall).await {
                        return Intake::Stop(Err(e));
                    }
                }
                let reply = error_reply(structured, handle, rejection.errno, rejection.message);
                return answer(&self.tx, Outgoing { reply, _permits: permits, stamps: None }).await;
            }
        };

        let export = Arc::clone(&self.export);
        let tx = self.tx.clone();
        // The request's command and header instant, when timed: the run stamps its
        // start and its answer.
        let timed = header_at.map(|h| (request.command, h));
        let run: Running = if let Op::Write { offset, len, fua } = op {
            match self.receive_write(handle, (offset, len, fua), permits, timed).await {
                Ok(run) => run,
                Err(intake) => return intake,
            }
        } else if let Op::Read { offset, len, df } = op {
            let started = timed.map(|_| Instant::now());
            Box::pin(async move {
                let reply = execute_read(&*export, structured, handle, offset, len, df).await;
                let stamps = stamp(timed, started);
                let _ = tx.send(Outgoing { reply, _permits: permits, stamps }).await;
            })
        } else {
            let started = timed.map(|_| Instant::now());
            Box::pin(async move {
                let reply = execute(&*export, structured, handle, op).await;
                let stamps = stamp(timed, started);
                let _ = tx.send(Outgoing { reply, _permits: permits, stamps }).await;
            })
        };
        Intake::Run(run)
    }

    /// A WRITE that passed validation: receives its payload into a buffer of the
    /// export's (charged as it arrives, see [`Payload`]) and returns the request's run,
    /// or what the reader does instead (the payload was dropped: an error answered, or
    /// the connection stops).
    async fn receive_write(
        &mut self,
        handle: u64,
        (offset, len, fua): (u64, u32, bool),
        mut permits: Permits,
        timed: Option<(Command, Instant)>,
    ) -> Result<Running, Intake> {
        let structured = self.params.structured;
        let stall = self.config.stall_timeout;
        let export = Arc::clone(&self.export);
        let tx = self.tx.clone();
        let mut buf = export.alloc_write_buf(offset, len);
        if buf.as_mut().len() != len as usize {
            tracing::warn!(
                expected = len,
                got = buf.as_mut().len(),
                "export returned a write buffer of the wrong length"
            );
            if let Err(e) = discard(self.reader, len, stall).await {
                return Err(Intake::Stop(Err(e)));
            }
            let reply = error_reply(structured, handle, Errno::Eio, "internal error: write buffer");
            return Err(answer(&self.tx, Outgoing { reply, _permits: permits, stamps: None }).await);
        }
        let watch = self.close_at.is_none().then_some(&mut self.shutting_down);
        let payload = Payload { budget: &self.budget, tx: &self.tx, shutting_down: watch, stall };
        match payload.receive(self.reader, buf.as_mut(), &mut permits).await {
            Ok(()) => {}
            Err(Interrupted::Gone) => return Err(Intake::Stop(Ok(()))),
            Err(Interrupted::Failed(e)) => return Err(Intake::Stop(Err(e))),
            // Not run and not answered: a reconnecting client sends it again.
            Err(Interrupted::ShuttingDown { .. }) if self.config.soft_disconnect == SoftDisconnect::Close => {
                tracing::info!("closing a connection: the server is shutting down");
                return Err(Intake::Stop(Ok(())));
            }
            // The rest of the payload is read and dropped, and the WRITE not run.
            Err(Interrupted::ShuttingDown { received }) => {
                self.begin_closing();
                drop(buf);
                (permits._bytes, permits.unmetered, permits.total) = (None, None, None);
                if let Err(e) = discard(self.reader, len - received, stall).await {
                    return Err(Intake::Stop(Err(e)));
                }
                let reply = error_reply(structured, handle, SHUTTING_DOWN.errno, SHUTTING_DOWN.message);
                return Err(answer(&self.tx, Outgoing { reply, _permits: permits, stamps: None }).await);
            }
        }
        let started = timed.map(|_| Instant::now());
        Ok(Box::pin(async move {
            let result = export.write(offset, buf, fua).await;
            let reply = done(structured, handle, result, "write failed");
            let stamps = stamp(timed, started);
            // A send error means the writer is gone; the reader stops on its own.
            let _ = tx.send(Outgoing { reply, _permits: permits, stamps }).await;
        }))
    }
}

/// A timed request's stamps once the export answered: `timed` its command and header
/// instant, `started` its start.
fn stamp(timed: Option<(Command, Instant)>, started: Option<Instant>) -> Option<Stamps> {
    let ((command, header), started) = (timed?, started?);
    Some(Stamps { command, header, started, served: Instant::now() })
}

/// Hands a reply made without the export to the writer.
async fn answer<B>(tx: &mpsc::Sender<Outgoing<B>>, out: Outgoing<B>) -> Intake {
    match tx.send(out).await {
        Ok(()) => Intake::Next,
        Err(_) => Intake::Stop(Ok(())),
    }
}

/// Resolves at `at`; never if `at` is `None`.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Reads requests until `NBD_CMD_DISC`, end of stream, a protocol violation or the
/// writer going away; then waits for every request in flight and drops the last
/// sender so that the writer finishes.
///
/// Requests run concurrently inside this future (a set of futures polled here), not as
/// tasks of their own: the connection's one task reads, runs and answers them, so a
/// request costs no spawn, and a completion wakes only this task. A request's future
/// is polled as soon as it is woken, before the next request is read.
async fn read_requests<E, R>(
    reader: &mut R,
    negotiated: Negotiated<E>,
    tx: mpsc::Sender<Outgoing<E::ReadBuf>>,
    config: &ServerConfig,
    total: Arc<TotalBudget>,
    shutting_down: watch::Receiver<bool>,
) -> Result<(), Error>
where
    E: Export,
    R: AsyncRead + Unpin,
{
    let Negotiated { export, params, .. } = negotiated;
    let timed = export.times_requests();
    let mut requests = RequestReader {
        reader,
        export,
        params,
        budget: Budget::new(config, total),
        tx,
        config,
        shutting_down,
        close_at: None,
        timed,
    };
    let mut running: FuturesUnordered<futures_util::future::CatchUnwind<AssertUnwindSafe<Running>>> =
        FuturesUnordered::new();

    let mut result = loop {
        let step = {
            let intake = requests.next();
            tokio::pin!(intake);
            loop {
                tokio::select! {
                    biased;
                    Some(ran) = running.next(), if !running.is_empty() => {
                        if ran.is_err() {
                            break Intake::Stop(Err(Error::HandlerPanicked));
                        }
                    }
                    step = &mut intake => break step,
                }
            }
        };
        match step {
            Intake::Run(run) => running.push(AssertUnwindSafe(run).catch_unwind()),
            Intake::Next => {}
            Intake::Stop(r) => break r,
        }
    };

    // Finish everything in flight (their replies still go out), then let the writer end.
    while let Some(ran) = running.next().await {
        if ran.is_err() {
            result = Err(Error::HandlerPanicked);
        }
    }
    drop(requests);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Extent;
    use crate::handshake::Limits;

    fn params(tflags: u16, structured: bool, meta: bool) -> Params {
        Params {
            structured,
            base_allocation: meta.then_some(1),
            transmission_flags: NBD_FLAG_HAS_FLAGS | tflags,
            limits: Limits { minimum: 1, preferred: 4096, maximum: 1 << 20 },
        }
    }

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request { flags, command, handle: 1, offset, length }
    }

    const SIZE: u64 = 1 << 24;
    const ALL: u16 = NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;

    fn errno(r: Result<Op, Rejection>) -> Option<Errno> {
        r.err().map(|r| r.errno)
    }

    #[test]
    fn accepts_valid_requests() {
        let p = params(ALL | NBD_FLAG_SEND_DF, true, true);
        assert_eq!(
            check(&req(Command::Read, NBD_CMD_FLAG_DF, 0, 4096), &p, SIZE),
            Ok(Op::Read { offset: 0, len: 4096, df: true })
        );
        assert_eq!(
            check(&req(Command::Write, NBD_CMD_FLAG_FUA, 512, 512), &p, SIZE),
            Ok(Op::Write { offset: 512, len: 512, fua: true })
        );
        assert_eq!(check(&req(Command::Flush, 0, 0, 0), &p, SIZE), Ok(Op::Flush));
        assert_eq!(
            check(&req(Command::WriteZeroes, NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO, 0, 1 << 22), &p, SIZE),
            Ok(Op::WriteZeroes { offset: 0, len: 1 << 22, may_unmap: false, fast_only: true, fua: false })
        );
        assert_eq!(
            check(&req(Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 0, 1 << 22), &p, SIZE),
            Ok(Op::BlockStatus { offset: 0, len: 1 << 22, req_one: true, context_id: 1 })
        );
        // the last bytes of the export, exactly
        assert!(check(&req(Command::Read, 0, SIZE - 1, 1), &p, SIZE).is_ok());
    }

    #[test]
    fn rejects_bad_commands_and_flags() {
        let p = params(ALL, false, false);
        assert_eq!(errno(check(&req(Command::Unsupported(99), 0, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // DF without SEND_DF
        assert_eq!(errno(check(&req(Command::Read, NBD_CMD_FLAG_DF, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // DF on write
        let p_df = params(ALL | NBD_FLAG_SEND_DF, true, false);
        assert_eq!(errno(check(&req(Command::Write, NBD_CMD_FLAG_DF, 0, 1), &p_df, SIZE)), Some(Errno::Einval));
        // FAST_ZERO on something other than WRITE_ZEROES
        assert_eq!(errno(check(&req(Command::Trim, NBD_CMD_FLAG_FAST_ZERO, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // FAST_ZERO when not offered
        let p_nofast = params(NBD_FLAG_SEND_WRITE_ZEROES, false, false);
        assert_eq!(
            errno(check(&req(Command::WriteZeroes, NBD_CMD_FLAG_FAST_ZERO, 0, 1), &p_nofast, SIZE)),
            Some(Errno::Einval)
        );
        // unknown flag bit
        assert_eq!(errno(check(&req(Command::Read, 1 << 9, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // REQ_ONE on read
        assert_eq!(errno(check(&req(Command::Read, NBD_CMD_FLAG_REQ_ONE, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // block status not negotiated
        assert_eq!(errno(check(&req(Command::BlockStatus, 0, 0, 1), &p, SIZE)), Some(Errno::Einval));
        // trim / write zeroes not offered
        let p_none = params(0, false, false);
        assert_eq!(errno(check(&req(Command::Trim, 0, 0, 1), &p_none, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::WriteZeroes, 0, 0, 1), &p_none, SIZE)), Some(Errno::Einval));
        // flush with an offset
        assert_eq!(errno(check(&req(Command::Flush, 0, 1, 0), &p, SIZE)), Some(Errno::Einval));
    }

    #[test]
    fn read_only_export() {
        let p = params(ALL | NBD_FLAG_READ_ONLY, false, false);
        for cmd in [Command::Write, Command::Trim, Command::WriteZeroes] {
            assert_eq!(errno(check(&req(cmd, 0, 0, 512), &p, SIZE)), Some(Errno::Eperm), "{cmd:?}");
        }
        assert!(check(&req(Command::Read, 0, 0, 512), &p, SIZE).is_ok());
        assert_eq!(check(&req(Command::Flush, 0, 0, 0), &p, SIZE), Ok(Op::Flush));
    }

    #[test]
    fn ranges_lengths_and_alignment() {
        let p = params(ALL, false, false);
        // past the end: EINVAL for reads/trim/cache, ENOSPC for writes
        assert_eq!(errno(check(&req(Command::Read, 0, SIZE, 1), &p, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::Trim, 0, SIZE - 1, 2), &p, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::Cache, 0, SIZE, 1), &p, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::Write, 0, SIZE - 1, 2), &p, SIZE)), Some(Errno::Enospc));
        assert_eq!(errno(check(&req(Command::WriteZeroes, 0, SIZE, 1), &p, SIZE)), Some(Errno::Enospc));
        // offset + length overflows u64
        assert_eq!(errno(check(&req(Command::Read, 0, u64::MAX, 2), &p, SIZE)), Some(Errno::Einval));
        // zero length
        assert_eq!(errno(check(&req(Command::Read, 0, 0, 0), &p, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::Write, 0, 0, 0), &p, SIZE)), Some(Errno::Einval));
        // above the maximum block size: READ, WRITE, CACHE only
        for cmd in [Command::Read, Command::Write, Command::Cache] {
            assert_eq!(errno(check(&req(cmd, 0, 0, (1 << 20) + 1), &p, SIZE)), Some(Errno::Einval));
        }
        assert!(check(&req(Command::Trim, 0, 0, 1 << 23), &p, SIZE).is_ok());
        assert!(check(&req(Command::WriteZeroes, 0, 0, 1 << 23), &p, SIZE).is_ok());
        // alignment to the minimum block size
        let mut p512 = p;
        p512.limits.minimum = 512;
        assert_eq!(errno(check(&req(Command::Read, 0, 1, 512), &p512, SIZE)), Some(Errno::Einval));
        assert_eq!(errno(check(&req(Command::Read, 0, 0, 100), &p512, SIZE)), Some(Errno::Einval));
        assert!(check(&req(Command::Read, 0, 1024, 512), &p512, SIZE).is_ok());
        // an unaligned tail is allowed when it ends exactly at the end of the export
        assert!(check(&req(Command::Read, 0, 1024, 100), &p512, 1124).is_ok());
    }

    fn ext(length: u64, hole: bool, zero: bool) -> Extent {
        Extent { length, hole, zero }
    }

    #[test]
    fn runs_from_extents() {
        let e = [
            ext(512, false, false),
            ext(512, false, false),
            ext(1024, true, true),
            ext(0, true, true),
            ext(512, true, false),
        ];
        assert_eq!(
            content_runs(&e, 2560),
            Some(vec![
                Run { start: 0, len: 1024, hole: false },
                Run { start: 1024, len: 1024, hole: true },
                Run { start: 2048, len: 512, hole: false },
            ])
        );
        // does not add up: fall back
        assert_eq!(content_runs(&e, 4096), None);
        assert_eq!(content_runs(&e, 100), None);
        assert_eq!(content_runs(&[], 100), None);
        assert_eq!(content_runs(&[ext(u64::MAX, true, true), ext(2, true, true)], 100), None);
    }

    #[test]
    fn descriptors_from_extents() {
        let e = [ext(4096, true, true), ext(4096, true, true), ext(4096, false, false)];
        assert_eq!(
            block_descriptors(&e, 10_000, false),
            vec![
                BlockDescriptor { length: 8192, status: NBD_STATE_HOLE | NBD_STATE_ZERO },
                BlockDescriptor { length: 1808, status: 0 },
            ]
        );
        assert_eq!(
            block_descriptors(&e, 10_000, true),
            vec![BlockDescriptor { length: 8192, status: NBD_STATE_HOLE | NBD_STATE_ZERO }]
        );
        assert_eq!(
            block_descriptors(&e, 100, true),
            vec![BlockDescriptor { length: 100, status: NBD_STATE_HOLE | NBD_STATE_ZERO }]
        );
        assert_eq!(block_descriptors(&[], 77, false), vec![BlockDescriptor { length: 77, status: 0 }]);
        assert_eq!(block_descriptors(&[ext(0, true, true)], 77, true), vec![BlockDescriptor { length: 77, status: 0 }]);
    }
}
