//! The `ferrovol` server library: what `ferrovol serve` puts between the engine and the
//! network.
//!
//! Lives here: a storage host's start-up and shutdown ([`host`]), NBD exports over engine
//! volumes ([`exports`]) and who may open them ([`access`]), the server side of the management API ([`mgmt`]), the two
//! error mappings ([`errors`]), Prometheus metrics ([`metrics`]), and the fuzz target
//! body of the management API (`fuzzing`, feature `test-utils`). Not here: the command
//! line (the `ferrovol`
//! binary, src/bin/ferrovol), the engine (`storage-engine`), the NBD protocol (`nbd`),
//! the management protocol and its client (`mgmt-api`).

pub mod access;
pub mod errors;
pub mod exports;
#[cfg(any(test, feature = "test-utils"))]
pub mod fuzzing;
pub mod host;
pub mod local;
pub mod metrics;
pub mod mgmt;
pub mod qos;
pub mod tls;
