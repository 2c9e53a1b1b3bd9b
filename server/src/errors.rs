//! Mapping engine errors to protocol errors: one function to an NBD errno, one to a
//! gRPC status. Lives here so that neither the engine nor the NBD crate knows the other.

use storage_engine::{Error, ErrorKind};

/// The NBD error value for an engine error (proto.md, "Error values").
pub fn nbd_errno(e: &Error) -> nbd::Errno {
    match e.kind() {
        ErrorKind::NoSpace => nbd::Errno::Enospc,
        ErrorKind::ReadOnly => nbd::Errno::Eperm,
        ErrorKind::OutOfRange | ErrorKind::InvalidArgument => nbd::Errno::Einval,
        // The volume was deleted under a connected client.
        ErrorKind::NotFound => nbd::Errno::Eio,
        ErrorKind::AlreadyExists | ErrorKind::Attached => nbd::Errno::Einval,
        ErrorKind::Io | ErrorKind::Corrupt | ErrorKind::Failed | ErrorKind::InUse => nbd::Errno::Eio,
    }
}

/// The gRPC status for an engine error (the management API's error contract).
pub fn grpc_status(e: &Error) -> tonic::Status {
    let msg = e.to_string();
    match e.kind() {
        ErrorKind::NotFound => tonic::Status::not_found(msg),
        ErrorKind::AlreadyExists => tonic::Status::already_exists(msg),
        ErrorKind::InvalidArgument => tonic::Status::invalid_argument(msg),
        ErrorKind::OutOfRange => tonic::Status::out_of_range(msg),
        ErrorKind::NoSpace => tonic::Status::resource_exhausted(msg),
        ErrorKind::Failed => tonic::Status::failed_precondition(msg),
        ErrorKind::InUse => tonic::Status::unavailable(msg),
        ErrorKind::ReadOnly | ErrorKind::Attached => tonic::Status::failed_precondition(msg),
        ErrorKind::Io | ErrorKind::Corrupt => tonic::Status::internal(msg),
    }
}
