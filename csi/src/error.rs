//! [`CsiError`]: the one error of the CSI services, a gRPC code and a message, mapped to
//! a `tonic::Status` in one place; and the mapping from the management API's errors.

/// A failed CSI call: the code the spec's error table asks for, and a message for people.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct CsiError {
    /// The gRPC code (spec.md "Error Scheme" and each RPC's error table).
    pub code: tonic::Code,
    /// What went wrong, naming the volume, snapshot or host.
    pub message: String,
}

impl CsiError {
    /// An error of `code` with `message`.
    pub fn new(code: tonic::Code, message: impl Into<String>) -> CsiError {
        CsiError { code, message: message.into() }
    }

    /// `INVALID_ARGUMENT`.
    pub fn invalid(message: impl Into<String>) -> CsiError {
        CsiError::new(tonic::Code::InvalidArgument, message)
    }

    /// `NOT_FOUND`.
    pub fn not_found(message: impl Into<String>) -> CsiError {
        CsiError::new(tonic::Code::NotFound, message)
    }

    /// `UNAVAILABLE`.
    pub fn unavailable(message: impl Into<String>) -> CsiError {
        CsiError::new(tonic::Code::Unavailable, message)
    }

    /// The CSI error for a failed management call on storage host `host` while doing
    /// `what`. A volume the host does not know is `NOT_FOUND`; a host that does not
    /// answer, or a call cut on its way, `UNAVAILABLE` (the sidecars retry).
    pub fn from_api(host: &str, what: &str, e: mgmt_api::ApiError) -> CsiError {
        use mgmt_api::ErrorKind as K;
        use tonic::Code;
        let code = match e.kind() {
            K::NotFound => Code::NotFound,
            K::AlreadyExists => Code::AlreadyExists,
            K::InvalidArgument => Code::InvalidArgument,
            K::NoSpace => Code::ResourceExhausted,
            K::FailedPrecondition => Code::FailedPrecondition,
            K::Aborted => Code::Aborted,
            K::Unavailable | K::Interrupted => Code::Unavailable,
            K::Internal => Code::Internal,
        };
        CsiError::new(code, format!("{what} on storage host {host}: {}", e.message()))
    }
}

impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> tonic::Status {
        tonic::Status::new(e.code, e.message)
    }
}
