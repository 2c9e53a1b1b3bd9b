//! Shared fixtures of the integration tests: an in-memory export and a raw client.
pub mod client;
pub mod mem_export;
