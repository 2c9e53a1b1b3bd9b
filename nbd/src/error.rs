//! Connection-level failures of the NBD server.
//!
//! Lives here: [`Error`], returned by `serve_connection` when a connection ends other
//! than by the client's choice (a soft disconnect, `NBD_OPT_ABORT`, or closing the socket
//! between messages all end in `Ok`).
//! Not here: per-request failures, which are sent to the client as [`crate::Errno`]
//! values in error replies and never end the connection.

use std::time::Duration;

/// Why a connection was ended by the server or broke.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading from or writing to the socket failed, including the peer closing it in the
    /// middle of a message.
    #[error("i/o error on NBD connection: {0}")]
    Io(#[from] std::io::Error),
    /// The client broke a mandatory rule of the protocol (bad magic, unknown client flags,
    /// oversized option data, ...); the server hard-disconnected.
    #[error("NBD protocol violation by the client: {0}")]
    Protocol(String),
    /// A client in the handshake sent and read nothing for the configured
    /// `handshake_timeout`, or took ten times it in all.
    #[error("NBD handshake made no progress for {0:?}, or took ten times that in all")]
    HandshakeTimeout(Duration),
    /// The client asked for an unknown export with `NBD_OPT_EXPORT_NAME`, which cannot be
    /// answered with an error, so the server closed the connection (proto.md,
    /// "`NBD_OPT_EXPORT_NAME`").
    #[error("client requested unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    /// A request handler panicked inside the export implementation; its reply can never
    /// be sent, so the connection was closed.
    #[error("an export operation panicked")]
    HandlerPanicked,
    /// The export already has `max_connections_per_export` clients and the client used
    /// `NBD_OPT_EXPORT_NAME`, which cannot be refused with an error reply.
    #[error("export {0:?} already has the maximum number of connections")]
    TooManyConnections(String),
    /// The client asked with `NBD_OPT_EXPORT_NAME` for an export it may not open
    /// ([`crate::Refusal::Denied`]); that option cannot be refused with an error, so the
    /// server closed the connection. Holds the shown name and the reason.
    #[error("client may not open export {0:?}: {1}")]
    Denied(String, String),
    /// The export was revoked from this client ([`crate::Export::revoked`]): requests
    /// in flight were answered, then the server closed the connection.
    #[error("access to the export was revoked; connection closed")]
    Revoked,
    /// The TLS handshake after `NBD_OPT_STARTTLS` failed (the client's certificate was
    /// refused, or the connection broke); with the ACK sent there is no going back to
    /// plain text, so the connection was closed (proto.md, "FORCEDTLS mode").
    #[error("TLS handshake failed: {0}")]
    Tls(std::io::Error),
    /// No request arrived for `idle_timeout` while none was in flight.
    #[error("connection idle for {0:?}")]
    IdleTimeout(Duration),
    /// Writing one reply, or receiving one WRITE payload (the `&str` says which), did not
    /// finish within `stall_timeout`: the client stopped reading replies or sending.
    #[error("client stalled: {0} did not finish within {1:?}")]
    Stalled(&'static str, Duration),
}

impl Error {
    pub(crate) fn protocol(msg: impl Into<String>) -> Self {
        Self::Protocol(msg.into())
    }
}
