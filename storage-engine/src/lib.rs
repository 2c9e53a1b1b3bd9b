//! ferrovol's storage engine: a *pool* (one file or block device) carved into
//! thin-provisioned *volumes*.
//!
//! Lives here: the on-disk format ([`format`](mod@format)), the pool with its volumes, allocator,
//! redo log and checkpoints ([`Pool`]), the per-volume data path ([`Volume`]), the
//! offline checker ([`check`]) and io_uring I/O ([`io`]).
//! Not here: any network protocol. The NBD server and the management API live in the
//! `ferrovol` server crate and call this crate through [`Pool`] and [`Volume`].
//!
//! Space is allocated on first write in data units (default 64 KiB); each mapping entry
//! keeps a bitmap of the unit's written 4 KiB blocks, so never-written blocks read as
//! zeros without zero-filling. Durability follows a disk with a volatile write cache:
//! writes are durable after [`Volume::flush`] (or with `fua`), and a crash at any point
//! leaves consistent metadata. docs/on-disk-format.md describes the format.

mod check;
pub mod error;
pub mod format;
mod info;
pub mod io;
mod journal;
pub mod meta;
mod names;
mod pool;
mod props;
mod store;
#[cfg(any(test, feature = "test-utils"))]
pub mod testing;
mod volume;

pub use check::{check, repair, CheckReport, RepairReport};
pub use error::{Error, ErrorKind, Result};
pub use info::{CommitStats, PoolStatus, Recovery, VolumeInfo};
pub use io::{AlignedBuf, IoOptions, Reaper};
pub use journal::RefcountRepair;
pub use names::{validate_name, MAX_NAME_LEN, MAX_VOLUME_SIZE};
pub use pool::{Pool, PoolOptions, DEFAULT_POOL_SIZE, DEFAULT_UNIT_SIZE};
pub use props::{
    validate_labels, validate_node_id, AttachKey, Attachment, Labels, MAX_ATTACHMENTS, MAX_LABELS, MAX_NODE_ID_LEN,
    MAX_PROPS_BYTES,
};
pub use volume::{Extent, ReadResult, Volume, MAX_IO_BYTES};
