//! ublk frontend: serves a block device, `/dev/ublkbN`, from a userspace [`Backend`]
//! through Linux's userspace block driver (`ublk_drv`, kernel 6.0 or later; the
//! driver's commands travel as io_uring `URING_CMD`s, Documentation/block/ublk.rst).
//!
//! Lives here: what a backend answers ([`Backend`]), how a device is set up
//! ([`Options`]), a device's life from add to removal and its queues ([`Device`],
//! device.rs), and the errors of setting one up ([`Error`]). Not here: volumes, the
//! engine, QoS and metrics (the `server` crate's adapter joins a volume to this trait,
//! as it joins one to `nbd::Export`); NBD (neither frontend depends on the other).
//!
//! Driver library: `libublk` (pinned; its API is only used in device.rs).

mod device;

use std::future::Future;

pub use device::{remove_stale, Device};

/// What a device's requests are served by: one volume (or snapshot) of the storage
/// host. Offsets and lengths are in bytes, multiples of 512 (the driver's sector);
/// errors are Linux errno values (`libc::EIO`, `libc::ENOSPC`, ...), positive, handed
/// to the kernel, which fails the block request with them.
///
/// The futures run on the tokio runtime handed to [`Device::add`], not on the queue's
/// thread; their results are sent back to it.
pub trait Backend: Send + Sync + 'static {
    /// A buffer a write's data is copied into, and a read's data comes back in.
    type Buf: AsRef<[u8]> + AsMut<[u8]> + Send + 'static;

    /// Size in bytes, a multiple of 512.
    fn size(&self) -> u64;

    /// A buffer of `len` bytes for a write at `offset`.
    fn alloc_buf(&self, offset: u64, len: usize) -> Self::Buf;

    /// Reads `len` bytes at `offset`: a buffer of at least `len` bytes, the first `len`
    /// of which are the data.
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = Result<Self::Buf, i32>> + Send;

    /// Writes `buf` at `offset`; with `fua`, durable when it completes (REQ_FUA).
    fn write(&self, offset: u64, buf: Self::Buf, fua: bool) -> impl Future<Output = Result<(), i32>> + Send;

    /// Makes every completed write durable (REQ_OP_FLUSH: the device has a volatile
    /// write cache).
    fn flush(&self) -> impl Future<Output = Result<(), i32>> + Send;

    /// Discards `len` bytes at `offset` (REQ_OP_DISCARD): they read as zeros after.
    fn discard(&self, offset: u64, len: u64) -> impl Future<Output = Result<(), i32>> + Send;

    /// Zeros `len` bytes at `offset` (REQ_OP_WRITE_ZEROES); `may_unmap` unless the
    /// kernel asked to keep the blocks allocated (REQ_NOUNMAP); with `fua`, durable
    /// when it completes.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fua: bool,
    ) -> impl Future<Output = Result<(), i32>> + Send;
}

/// How a device is set up ([`Device::add`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// Hardware queues, each served by a thread of its own (1 to 32).
    pub queues: u16,
    /// Requests in flight per queue (1 to 4096).
    pub depth: u16,
    /// Largest request in bytes (a multiple of 4096, at most 1 MiB): the block layer
    /// splits larger ones.
    pub max_io_bytes: u32,
    /// Writes, discards and write zeroes fail with `EROFS` in the kernel (a snapshot).
    pub read_only: bool,
    /// Shown as the driver's target name (`ublk list`).
    pub name: String,
}

impl Default for Options {
    fn default() -> Options {
        Options { queues: 1, depth: 64, max_io_bytes: 512 << 10, read_only: false, name: "ferrovol".to_owned() }
    }
}

/// Why a device could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel has no ublk driver (`/dev/ublk-control` is missing: `modprobe
    /// ublk_drv`, or a kernel built with CONFIG_BLK_DEV_UBLK).
    #[error("this kernel has no ublk driver (/dev/ublk-control is missing; modprobe ublk_drv)")]
    NotSupported,
    /// The process may not add ublk devices (it needs CAP_SYS_ADMIN, and access to
    /// `/dev/ublk-control`).
    #[error("not permitted to add a ublk device (needs CAP_SYS_ADMIN and /dev/ublk-control): {0}")]
    Denied(String),
    /// Bad [`Options`] or backend size.
    #[error("invalid ublk device options: {0}")]
    Invalid(String),
    /// The driver cannot change a device's size online (UBLK_F_UPDATE_SIZE, Linux
    /// 6.16): the device keeps its size until it is added again.
    #[error("this kernel's ublk driver cannot change a device's size online (needs Linux 6.16, UBLK_F_UPDATE_SIZE)")]
    NoOnlineResize,
    /// The driver refused or failed a control command.
    #[error("ublk: {0}")]
    Driver(String),
}
