//! The engine's one public error type.
//!
//! Lives here: [`Error`], made of a small matchable [`ErrorKind`], context (operation,
//! volume, byte offset) and an optional source. Not here: mapping to protocol codes;
//! the server maps an [`ErrorKind`] to an NBD errno or a gRPC status.

use std::fmt;

/// What went wrong, coarse enough to match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No volume (or pool) of that name.
    NotFound,
    /// A volume of that name exists already.
    AlreadyExists,
    /// An argument is malformed: a bad name, a size not a multiple of 4096, a shrink.
    InvalidArgument,
    /// An offset or length lies past the end of the volume.
    OutOfRange,
    /// The pool has no free data unit for an allocating write.
    NoSpace,
    /// The pool file or device returned an error.
    Io,
    /// On-disk metadata is inconsistent or fails its checksum; or the file is not a pool.
    Corrupt,
    /// The pool stopped accepting writes after an I/O error on a metadata commit, or
    /// was closed.
    Failed,
    /// The pool file is locked by another process (a running server).
    InUse,
    /// A write to a read-only snapshot.
    ReadOnly,
    /// The volume is published to a node (it has an attachment): it cannot be deleted,
    /// or attached exclusively to another node, until it is unpublished.
    Attached,
}

impl ErrorKind {
    fn describe(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::AlreadyExists => "already exists",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::OutOfRange => "out of range",
            ErrorKind::NoSpace => "no space left in pool",
            ErrorKind::Io => "I/O error",
            ErrorKind::Corrupt => "corrupt pool",
            ErrorKind::Failed => "pool failed or closed and refuses writes",
            ErrorKind::InUse => "pool in use",
            ErrorKind::ReadOnly => "read-only",
            ErrorKind::Attached => "published to a node",
        }
    }
}

/// An engine error: kind, a message, where it happened, and the underlying cause.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    op: Option<&'static str>,
    volume: Option<String>,
    offset: Option<u64>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    /// A [`ErrorKind::Corrupt`] error about a file or device that holds no pool at all
    /// (no superblock slot carries the magic), not a damaged one.
    not_a_pool: bool,
}

/// `Result` with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a human-readable message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into(), op: None, volume: None, offset: None, source: None, not_a_pool: false }
    }

    /// An [`ErrorKind::Io`] error wrapping `e`.
    pub fn io(message: impl Into<String>, e: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, message).with_source(e)
    }

    /// An [`ErrorKind::Corrupt`] error.
    pub fn corrupt(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Corrupt, message)
    }

    /// The [`ErrorKind::Corrupt`] error of a file or device that holds no pool at all.
    pub(crate) fn not_a_pool(message: impl Into<String>) -> Error {
        Error { not_a_pool: true, ..Error::corrupt(message) }
    }

    /// Whether the file or device holds no pool at all (no superblock slot carries the
    /// pool's magic), rather than a damaged one: what may be formatted over.
    pub fn is_not_a_pool(&self) -> bool {
        self.not_a_pool
    }

    /// Adds the cause.
    pub fn with_source(mut self, e: impl std::error::Error + Send + Sync + 'static) -> Error {
        self.source = Some(Box::new(e));
        self
    }

    /// Adds the operation (e.g. "write", "create volume").
    pub fn op(mut self, op: &'static str) -> Error {
        self.op = Some(op);
        self
    }

    /// Adds the volume name.
    pub fn volume(mut self, name: &str) -> Error {
        self.volume = Some(shown_name(name));
        self
    }

    /// Adds the byte offset.
    pub fn offset(mut self, offset: u64) -> Error {
        self.offset = Some(offset);
        self
    }

    /// The matchable kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message without context.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.op, &self.volume, self.offset) {
            (Some(op), Some(v), Some(o)) => write!(f, "{op} on '{v}' at offset {o}: ")?,
            (Some(op), Some(v), None) => write!(f, "{op} '{v}': ")?,
            (Some(op), None, _) => write!(f, "{op}: ")?,
            (None, Some(v), _) => write!(f, "'{v}': ")?,
            (None, None, _) => {}
        }
        write!(f, "{}: {}", self.kind.describe(), self.message)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

/// The cause is part of `Display` (so logs show it); `source()` is therefore `None`,
/// which keeps error reports that walk the chain from printing it twice.
impl std::error::Error for Error {}

impl Error {
    /// The underlying cause, if any (also shown by `Display`).
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }
}

/// `name` as error messages show it, control characters escaped: whole if it could be a valid name (128 bytes or
/// fewer), else its first 64 characters and its length, so that a message about a
/// 10,000-byte name stays short (a gRPC status travels in an HTTP/2 header).
pub fn shown_name(name: &str) -> String {
    // Control characters and the like are escaped, so that they can neither hide in a
    // terminal nor split a log line.
    let escape = |s: &str| s.escape_debug().to_string();
    if name.len() <= 128 {
        escape(name)
    } else {
        let head: String = name.chars().take(64).collect();
        format!("{}… ({} bytes)", escape(&head), name.len())
    }
}
