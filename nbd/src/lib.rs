//! NBD (Network Block Device) protocol server for ferrovol.
//!
//! Lives here: the fixed newstyle handshake with option haggling, the transmission
//! phase with many requests in flight and out-of-order replies, simple and structured
//! replies, block status for the `base:allocation` metadata context, and accept loops for
//! TCP and Unix sockets. The protocol follows the NetworkBlockDevice `doc/proto.md`; doc
//! comments name the section they implement.
//! Not here: storage. Data lives behind the [`Export`] trait, exports are found through
//! [`ExportRegistry`]; this crate does not depend on any storage implementation. TLS
//! (`NBD_OPT_STARTTLS`, rustls) when [`ServerConfig::tls`] says so; extended headers
//! are not implemented (`NBD_OPT_EXTENDED_HEADERS` is answered with
//! `NBD_REP_ERR_UNSUP`).
//!
//! Entry points: a [`Server`] (exports, [`ServerConfig`] limits, live connection counts)
//! with its accept loops for TCP and Unix sockets and `serve_connection` for one
//! already-accepted stream; the free functions [`serve_connection`], [`serve_tcp`] and
//! [`serve_unix`] run a server of their own. The wire format is in [`proto`], public so
//! that clients and tests can speak it too; `testing` (feature `test-utils`) holds an
//! in-memory export and the fuzz targets' entry points.

pub mod attach;
mod budget;
pub mod client;
mod config;
pub mod error;
pub mod export;
mod handshake;
pub mod kernel;
mod ktls;
pub mod proto;
mod reply;
pub mod server;
mod slots;
mod stream;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
mod tls;
mod transmission;

pub use config::SoftDisconnect;
pub use error::Error;
pub use export::{
    BlockSizes, Client, Errno, Export, ExportFlags, ExportRegistry, Extent, ReadData, Refusal, RequestTimes,
};
pub use server::{serve_connection, serve_tcp, serve_unix, Server, ServerConfig};
pub use tls::{NbdTls, TlsMode, TlsSource};
