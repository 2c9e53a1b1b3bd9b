//! The server's tunables: [`ServerConfig`] (timeouts, connection caps, memory budgets,
//! shutdown grace), the per-connection memory allowance, and the fixed limits the
//! budgets and replies are measured in (byte unit, stall chunk, block status
//! descriptors). Not here: where they are
//! applied (server.rs, handshake.rs, transmission.rs, budget.rs).

use std::time::Duration;

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
    /// After [`Server::shut_down`], how long a connection may take to finish the
    /// requests in flight (and, with [`SoftDisconnect::Eshutdown`], keeps reading new
    /// ones) before the server closes it. Default 2 s.
    pub shutdown_grace: Duration,
    /// What a connection does with requests that arrive after [`Server::shut_down`].
    pub soft_disconnect: SoftDisconnect,
    /// TLS (proto.md, "TLS support"): `None`, the default, is the spec's NOTLS mode
    /// (`NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`); otherwise TLS is offered or
    /// required as [`crate::NbdTls::mode`] says.
    pub tls: Option<crate::NbdTls>,
}

/// How a shutting-down server treats requests it has not started (proto.md
/// "Terminating the transmission phase", soft disconnect).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SoftDisconnect {
    /// Stop reading requests, answer those in flight, close the connection. A request
    /// the client sent meanwhile is never run and never answered: a client that
    /// reconnects (the Linux kernel's with a reconnect watcher, qemu's) sends it again to
    /// the next server, and no file system sees an error. The default.
    #[default]
    Close,
    /// Keep reading, answer each new request `NBD_ESHUTDOWN`, close after the grace
    /// period: proto.md's soft disconnect. The kernel's client takes `NBD_ESHUTDOWN` for
    /// an I/O error.
    Eshutdown,
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
            soft_disconnect: SoftDisconnect::Close,
            tls: None,
        }
    }
}

/// Bytes of memory each connection's requests may hold outside
/// [`ServerConfig::max_total_in_flight_bytes`]: 2 MiB, above the 1280 KiB the
/// Linux kernel's client sends at most in one request by default (its queue's
/// `max_sectors_kb`, seen on Debian's 6.12 kernel).
pub const UNMETERED_BYTES_PER_CONNECTION: usize = 2 << 20;

/// Most descriptors sent in one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk; the spec lets a
/// server describe less than the requested length.
pub(crate) const MAX_BLOCK_STATUS_DESCRIPTORS: usize = 1 << 16;

/// Granularity of the payload-byte budget, in bytes.
pub(crate) const BYTE_UNIT: usize = 4096;

/// Bytes of a reply or WRITE payload that must move within
/// [`ServerConfig::stall_timeout`]; a WRITE payload is also charged to the
/// connection's unmetered allowance in pieces of this size as it arrives, so that a
/// header whose payload never comes holds no more than this.
pub(crate) const STALL_CHUNK: usize = 256 * 1024;
