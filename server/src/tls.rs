//! The management API over TCP with mutual TLS: who called ([`Caller`], the client
//! certificate's subject, put in each request's extensions).
//! Not here: the service (mgmt.rs), the unix socket (host.rs).

/// The caller of a management request that came over mutual TLS: its certificate's
/// subject (RFC 4514 form).
#[derive(Debug, Clone)]
pub struct Caller(pub String);
