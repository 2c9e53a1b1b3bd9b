//! The contract between the NBD protocol layer and whatever stores the data.
//!
//! Lives here: the [`Export`] trait (one served block device), the [`ExportRegistry`]
//! trait (name lookup and listing for option haggling, given the [`Client`] asking,
//! refused with a [`Refusal`]), [`Extent`]s for block status and read holes, and the
//! [`Errno`] values that go on the wire.
//! Not here: parsing, replies, sockets (see `proto` and `server`).
//!
//! An implementation never sees NBD framing: offsets and lengths are in bytes and have
//! already been checked against [`Export::size`] and the advertised block-size limits.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// NBD error values as sent in simple and structured error replies
/// (proto.md, "Error values"). The numbers are the wire values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Errno {
    /// Operation not permitted (e.g. a write to a read-only export).
    Eperm = 1,
    /// Input/output error.
    Eio = 5,
    /// Cannot allocate memory.
    Enomem = 12,
    /// Invalid argument.
    Einval = 22,
    /// No space left on the device.
    Enospc = 28,
    /// Value too large (a request longer than the maximum payload).
    Eoverflow = 75,
    /// Operation not supported (e.g. `NBD_CMD_FLAG_FAST_ZERO` that cannot be fast).
    Enotsup = 95,
    /// Server is in the process of being shut down.
    Eshutdown = 108,
}

impl Errno {
    /// The 32-bit value sent in the error field of a simple reply or an error chunk.
    pub const fn wire_value(self) -> u32 {
        self as u32
    }
}

/// One run of bytes with the same allocation state, as in the `base:allocation`
/// metadata context (proto.md, "`base:` meta context").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes.
    pub length: u64,
    /// `NBD_STATE_HOLE`: no storage is allocated for this run.
    pub hole: bool,
    /// `NBD_STATE_ZERO`: the run reads as zeros.
    pub zero: bool,
}

/// The result of a read: the data, and which parts of it are holes.
///
/// `data.as_ref()` is exactly the requested length. `extents` either is empty (all
/// data) or covers the requested range in order; runs marked `hole && zero` may be
/// sent as `NBD_REPLY_TYPE_OFFSET_HOLE` chunks when structured replies are in use.
pub struct ReadData<B> {
    /// The bytes read, exactly the requested length.
    pub data: B,
    /// Allocation of the range, in order, summing to the requested length (or empty).
    pub extents: Vec<Extent>,
}

/// What the export supports; turned into transmission flags
/// (proto.md, "Transmission flags").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportFlags {
    /// `NBD_FLAG_READ_ONLY`.
    pub read_only: bool,
    /// `NBD_FLAG_SEND_TRIM`.
    pub can_trim: bool,
    /// `NBD_FLAG_SEND_WRITE_ZEROES`.
    pub can_write_zeroes: bool,
    /// `NBD_FLAG_SEND_FAST_ZERO`.
    pub can_fast_zero: bool,
    /// `NBD_FLAG_CAN_MULTI_CONN`: a flush on any connection covers writes completed on all.
    pub can_multi_conn: bool,
}

/// Block-size constraints sent in `NBD_INFO_BLOCK_SIZE` (proto.md, "Block size
/// constraints"), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Minimum block size (1 means any byte alignment is accepted).
    pub minimum: u32,
    /// Preferred block size.
    pub preferred: u32,
    /// Maximum payload of a READ or WRITE, and the largest request length the server
    /// accepts without error.
    pub maximum: u32,
}

/// One served block device. All methods take byte offsets and lengths that the
/// protocol layer has already checked: `offset + len <= size()`, `len >= 1` and
/// `len <= block_sizes().maximum` for READ/WRITE.
pub trait Export: Send + Sync + 'static {
    /// The buffer a READ's data comes back in.
    type ReadBuf: AsRef<[u8]> + Send + 'static;
    /// The buffer a WRITE's payload is received into; handed back with [`Export::write`].
    type WriteBuf: AsMut<[u8]> + Send + 'static;

    /// Current size in bytes (may grow while connected; the protocol layer reads it per request).
    fn size(&self) -> u64;
    /// Transmission flags.
    fn flags(&self) -> ExportFlags;
    /// Block-size constraints.
    fn block_sizes(&self) -> BlockSizes;
    /// Free-form text for `NBD_INFO_DESCRIPTION`.
    fn description(&self) -> String;

    /// A buffer of exactly `len` bytes for the payload of a WRITE to `offset`.
    fn alloc_write_buf(&self, offset: u64, len: u32) -> Self::WriteBuf;
    /// `NBD_CMD_READ` of `len` bytes at `offset`.
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = Result<ReadData<Self::ReadBuf>, Errno>> + Send;
    /// `NBD_CMD_WRITE`; `fua` is `NBD_CMD_FLAG_FUA`: durable before the reply.
    fn write(&self, offset: u64, buf: Self::WriteBuf, fua: bool) -> impl Future<Output = Result<(), Errno>> + Send;
    /// `NBD_CMD_FLUSH`: every write completed before this call is durable on return.
    fn flush(&self) -> impl Future<Output = Result<(), Errno>> + Send;
    /// `NBD_CMD_TRIM` of `len` bytes at `offset` (the range reads as zeros afterwards).
    fn trim(&self, offset: u64, len: u64, fua: bool) -> impl Future<Output = Result<(), Errno>> + Send;
    /// `NBD_CMD_WRITE_ZEROES`. `may_unmap` is the absence of `NBD_CMD_FLAG_NO_HOLE`;
    /// `fast_only` is `NBD_CMD_FLAG_FAST_ZERO` (return `Enotsup` if it would be slow).
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast_only: bool,
        fua: bool,
    ) -> impl Future<Output = Result<(), Errno>> + Send;
    /// `NBD_CMD_CACHE`: a hint to prefetch; may do nothing.
    fn cache(&self, offset: u64, len: u64) -> impl Future<Output = Result<(), Errno>> + Send;
    /// `base:allocation` extents for up to `len` bytes at `offset`, in order, starting at
    /// `offset`; may cover less than `len` but at least one byte.
    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno>;

    /// Resolves when this export may no longer be served to the connection it was
    /// looked up for (it was unpublished from that client). The connection then reads
    /// no further request, answers those in flight and closes
    /// ([`crate::Error::Revoked`]). Polled anew before each request is read, so it
    /// must be cheap to create. The default never resolves.
    fn revoked(&self) -> impl Future<Output = ()> + Send + 'static {
        std::future::pending()
    }

    /// Whether the connection should time each request's stages and hand them to
    /// [`Export::request_timed`]. Asked once per connection; the default `false`
    /// reads no clock.
    fn times_requests(&self) -> bool {
        false
    }

    /// One request's stage times, once its reply was flushed to the socket (only when
    /// [`Export::times_requests`]). Called on the connection's task: keep it cheap.
    fn request_timed(&self, _times: &RequestTimes) {}
}

/// Where one request spent its time, from its header read to its reply flushed to the
/// socket ([`Export::request_timed`]). The three stages add up to the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTimes {
    /// The request's command.
    pub command: crate::proto::Command,
    /// From the header read to the request starting: waiting for the connection's and
    /// the server's memory budgets, and receiving a WRITE's payload.
    pub receive: std::time::Duration,
    /// From the start to the export's answer ([`Export::read`], [`Export::write`], …).
    pub serve: std::time::Duration,
    /// From the answer to its reply flushed to the socket: queued behind other
    /// replies, written, flushed.
    pub reply: std::time::Duration,
}

/// Who is asking for an export: what the accept loop knows of the peer, for the
/// registry's access decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Client {
    /// A TCP client: its address and the local address it connected to.
    Tcp {
        /// The client's address.
        peer: SocketAddr,
        /// The server address the connection came in on.
        local: SocketAddr,
    },
    /// A TCP client that started TLS (`NBD_OPT_STARTTLS`): what the registry sees
    /// from then on, with the certificate the client presented.
    Tls {
        /// The client's address.
        peer: SocketAddr,
        /// The server address the connection came in on.
        local: SocketAddr,
        /// The client's certificate (DER, the leaf), verified by the server's TLS
        /// configuration; `None` if it presented none and the configuration let it.
        certificate: Option<Arc<[u8]>>,
    },
    /// A client on a Unix socket: a local process with the socket's permissions.
    Unix,
    /// A stream of unknown origin ([`crate::Server::serve_connection`]).
    Other,
}

/// Why an export is not served to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No export of that name (`NBD_REP_ERR_UNKNOWN`).
    Unknown,
    /// The export exists but this client may not open it (`NBD_REP_ERR_POLICY`); the
    /// message is sent to the client, so it names no secret.
    Denied(String),
}

/// The set of exports a server offers, looked up by name during option haggling.
pub trait ExportRegistry: Send + Sync + 'static {
    /// The export type served.
    type Export: Export;
    /// The export called `name` as served to `client` (read-only or not, revoked
    /// when its access ends), or why not.
    fn lookup(&self, name: &str, client: &Client) -> Result<Arc<Self::Export>, Refusal>;
    /// Names and descriptions for `NBD_OPT_LIST`, of the exports `client` may see.
    fn list(&self, client: &Client) -> Vec<(String, String)>;
    /// How the export name a client sent appears in logs and errors: a registry whose
    /// names carry secrets hides them here. The default shows the name as it is.
    fn shown_name(&self, name: &str) -> String {
        name.to_owned()
    }
    /// What `max_connections_per_export` counts connections by for the export name a
    /// client sent: the export behind it, when several names lead to one export. The
    /// default is the name itself.
    fn counted_as(&self, name: &str) -> String {
        name.to_owned()
    }
}
