//! Replies: their encoding as pieces (simple and structured replies, proto.md "Simple
//! reply message", "Structured reply chunk message": `NBD_REPLY_TYPE_OFFSET_DATA`,
//! `NBD_REPLY_TYPE_OFFSET_HOLE`, `NBD_REPLY_TYPE_BLOCK_STATUS`, `NBD_REPLY_TYPE_ERROR`),
//! the error a request is answered with when it never reaches the export
//! ([`Rejection`]), the budget a request holds until its reply is written, and the
//! writer, the only owner of a connection's write half, writing replies whole in
//! completion order. Not here: what a request does (transmission.rs), byte layouts
//! (proto.rs).

use std::ops::Range;
use std::time::{Duration, Instant};

use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::config::{MAX_BLOCK_STATUS_DESCRIPTORS, STALL_CHUNK};
use crate::error::Error;
use crate::export::{Errno, Extent, ReadData, RequestTimes};
use crate::proto::*;
use crate::stream::within;

/// Why a request is answered with an error without reaching the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub errno: Errno,
    pub message: &'static str,
}

/// A piece of an encoded reply: literal bytes, or a range of the READ buffer.
pub(crate) enum Piece {
    Bytes(Vec<u8>),
    Data(Range<usize>),
}

/// One complete reply (a simple reply, or every chunk of a structured reply), written
/// as a unit by the writer.
pub(crate) struct Reply<B> {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) buf: Option<B>,
}

impl<B> Reply<B> {
    pub(crate) fn bytes(b: Vec<u8>) -> Self {
        Self { pieces: vec![Piece::Bytes(b)], buf: None }
    }
}

/// Budget held by a request until its reply has been handed to the socket.
pub(crate) struct Permits {
    pub(crate) _count: OwnedSemaphorePermit,
    pub(crate) _bytes: Option<OwnedSemaphorePermit>,
    /// The request's memory charged outside the connection's own budget, to the
    /// connection's unmetered allowance and to the server's budget: in one piece (a
    /// READ, a BLOCK_STATUS), or for a WRITE payload one per [`STALL_CHUNK`] from the
    /// allowance as it arrives and the rest from the server's budget in one piece,
    /// merged into one permit per semaphore.
    pub(crate) unmetered: Option<OwnedSemaphorePermit>,
    pub(crate) total: Option<OwnedSemaphorePermit>,
}

pub(crate) struct Outgoing<B> {
    pub(crate) reply: Reply<B>,
    pub(crate) _permits: Permits,
    /// When the connection times its requests ([`crate::Export::times_requests`]) and
    /// this reply answers one that ran: its stamps so far.
    pub(crate) stamps: Option<Stamps>,
}

/// The instants of a timed request before its reply is written: its header read, its
/// start, its answer ([`crate::RequestTimes`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stamps {
    pub(crate) command: Command,
    pub(crate) header: Instant,
    pub(crate) started: Instant,
    pub(crate) served: Instant,
}

impl Stamps {
    /// The stage times once the reply was flushed at `flushed`.
    fn times(&self, flushed: Instant) -> RequestTimes {
        RequestTimes {
            command: self.command,
            receive: self.started.saturating_duration_since(self.header),
            serve: self.served.saturating_duration_since(self.started),
            reply: flushed.saturating_duration_since(self.served),
        }
    }
}

pub(crate) fn success<B>(handle: u64) -> Reply<B> {
    Reply::bytes(SimpleReply { error: 0, handle }.encode().to_vec())
}

/// An error reply: an `NBD_REPLY_TYPE_ERROR` chunk with a message when structured replies
/// were negotiated (required for READ, preferred for the rest), a simple reply otherwise.
pub(crate) fn error_reply<B>(structured: bool, handle: u64, errno: Errno, message: &str) -> Reply<B> {
    if structured {
        Reply::bytes(encode_error_chunk(handle, errno, message, true))
    } else {
        Reply::bytes(SimpleReply { error: errno.wire_value(), handle }.encode().to_vec())
    }
}

pub(crate) fn done<B>(structured: bool, handle: u64, result: Result<(), Errno>, what: &str) -> Reply<B> {
    match result {
        Ok(()) => success(handle),
        Err(errno) => error_reply(structured, handle, errno, what),
    }
}

/// A run of a READ reply: `len` bytes at `start` (relative to the request offset), either
/// data or a hole that reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) start: u32,
    pub(crate) len: u32,
    pub(crate) hole: bool,
}

/// Splits a read of `len` bytes into data and hole runs from the export's extents.
/// Returns `None` (send everything as data) when the extents are empty or do not cover
/// exactly `len` bytes.
pub(crate) fn content_runs(extents: &[Extent], len: u32) -> Option<Vec<Run>> {
    if extents.is_empty() {
        return None;
    }
    let mut runs: Vec<Run> = Vec::new();
    let mut covered: u64 = 0;
    for e in extents.iter().filter(|e| e.length > 0) {
        let next = covered.checked_add(e.length)?;
        if next > u64::from(len) {
            return None;
        }
        // Both fit in u32: covered < next <= len.
        let (start, run_len) = (covered as u32, e.length as u32);
        let hole = e.hole && e.zero;
        match runs.last_mut() {
            Some(last) if last.hole == hole => last.len += run_len,
            _ => runs.push(Run { start, len: run_len, hole }),
        }
        covered = next;
    }
    (covered == u64::from(len)).then_some(runs)
}

/// The reply to a successful READ. Simple: header then data. Structured: one
/// `NBD_REPLY_TYPE_OFFSET_DATA` chunk per data run and one `NBD_REPLY_TYPE_OFFSET_HOLE`
/// chunk per hole run (a single data chunk with `df`), the last chunk flagged DONE.
pub(crate) fn read_reply<B: AsRef<[u8]>>(
    structured: bool,
    handle: u64,
    offset: u64,
    len: u32,
    df: bool,
    data: ReadData<B>,
) -> Reply<B> {
    if data.data.as_ref().len() != len as usize {
        tracing::warn!(
            expected = len,
            got = data.data.as_ref().len(),
            "export returned a read buffer of the wrong length"
        );
        return error_reply(structured, handle, Errno::Eio, "internal error: short read buffer");
    }
    if !structured {
        return Reply {
            pieces: vec![
                Piece::Bytes(SimpleReply { error: 0, handle }.encode().to_vec()),
                Piece::Data(0..len as usize),
            ],
            buf: Some(data.data),
        };
    }
    let runs = if df { None } else { content_runs(&data.extents, len) }
        .unwrap_or_else(|| vec![Run { start: 0, len, hole: false }]);
    let mut pieces = Vec::with_capacity(runs.len() * 2);
    let last = runs.len().saturating_sub(1);
    for (i, run) in runs.iter().enumerate() {
        let at = offset + u64::from(run.start);
        if run.hole {
            pieces.push(Piece::Bytes(encode_offset_hole(handle, at, run.len, i == last).to_vec()));
        } else {
            pieces.push(Piece::Bytes(encode_offset_data_header(handle, at, run.len, i == last).to_vec()));
            let start = run.start as usize;
            pieces.push(Piece::Data(start..start + run.len as usize));
        }
    }
    Reply { pieces, buf: Some(data.data) }
}

/// Block status descriptors for a request of `len` bytes: zero-length extents dropped,
/// neighbours with equal status merged, clipped to `len`, one descriptor with `req_one`.
/// Falls back to a single descriptor of status 0 (always truthful) when the export
/// described nothing.
pub(crate) fn block_descriptors(extents: &[Extent], len: u32, req_one: bool) -> Vec<BlockDescriptor> {
    let mut out: Vec<BlockDescriptor> = Vec::new();
    let mut covered: u64 = 0;
    for e in extents.iter().filter(|e| e.length > 0) {
        let remaining = u64::from(len) - covered;
        if remaining == 0 {
            break;
        }
        let l = e.length.min(remaining) as u32;
        let status = allocation_status(e);
        match out.last_mut() {
            Some(last) if last.status == status => last.length += l,
            _ => {
                if out.len() == MAX_BLOCK_STATUS_DESCRIPTORS || (req_one && !out.is_empty()) {
                    break;
                }
                out.push(BlockDescriptor { length: l, status });
            }
        }
        covered += u64::from(l);
    }
    if out.is_empty() {
        out.push(BlockDescriptor { length: len, status: 0 });
    }
    out
}

/// The single owner of the write half: writes each reply whole, batching whatever is
/// ready before flushing; shuts the write side down when every sender is gone. Writing
/// [`STALL_CHUNK`] of a reply, or flushing a batch, that takes longer than `stall` ends
/// the connection with [`Error::Stalled`]. With `timed`, each timed reply's stage
/// times go to it once its batch is flushed.
pub(crate) async fn write_replies<W, B>(
    writer: W,
    mut rx: mpsc::Receiver<Outgoing<B>>,
    stall: Duration,
    timed: Option<&(dyn Fn(&RequestTimes) + Sync)>,
) -> Result<(), Error>
where
    W: AsyncWrite + Unpin,
    B: AsRef<[u8]>,
{
    let mut w = BufWriter::with_capacity(64 * 1024, writer);
    let mut batch: Vec<Stamps> = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.extend(first.stamps);
        write_reply(&mut w, first, stall).await?;
        while let Ok(next) = rx.try_recv() {
            batch.extend(next.stamps);
            write_reply(&mut w, next, stall).await?;
        }
        within(stall, "writing a reply", w.flush()).await?;
        if let Some(report) = timed {
            let flushed = Instant::now();
            for s in batch.drain(..) {
                report(&s.times(flushed));
            }
        }
    }
    if let Err(e) = w.shutdown().await {
        tracing::debug!(error = %e, "shutting down the write side failed");
    }
    Ok(())
}

/// Writes one reply into `w`, each [`STALL_CHUNK`] of it within `stall`.
pub(crate) async fn write_reply<W, B>(w: &mut W, out: Outgoing<B>, stall: Duration) -> Result<(), Error>
where
    W: AsyncWrite + Unpin,
    B: AsRef<[u8]>,
{
    let reply = out.reply;
    for piece in &reply.pieces {
        let bytes = match piece {
            Piece::Bytes(b) => &b[..],
            Piece::Data(range) => match reply.buf.as_ref().and_then(|b| b.as_ref().get(range.clone())) {
                Some(d) => d,
                // Ranges are built from the checked buffer length; never reached.
                None => return Err(std::io::Error::other("reply data out of range").into()),
            },
        };
        for chunk in bytes.chunks(STALL_CHUNK) {
            within(stall, "writing a reply", w.write_all(chunk)).await?;
        }
    }
    Ok(())
}
