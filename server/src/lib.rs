//! The `ferrovol` server library: what `ferrovol serve` puts between the engine and the
//! network.
//!
//! Lives here: NBD exports over engine volumes ([`exports`]), the gRPC management API
//! ([`mgmt`]), the two error mappings ([`errors`]), Prometheus metrics ([`metrics`]),
//! and the fuzz target body of the management API ([`fuzzing`]). Not here: the command line and start-up (main.rs), the
//! engine (`storage-engine`), the NBD protocol (`nbd`).

pub mod errors;
pub mod exports;
pub mod fuzzing;
pub mod metrics;
pub mod mgmt;
