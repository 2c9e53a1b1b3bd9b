//! What the engine reports about a pool and its volumes: [`VolumeInfo`], [`PoolStatus`]
//! and [`Recovery`], plain values. Not here: computing them (the store, the pool).

use std::path::PathBuf;

use crate::props::{Attachment, Labels};

/// A volume as listed by the management API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    /// Name (also the NBD export name): `VOLUME` or, for a snapshot, `VOLUME@SNAPSHOT`.
    pub name: String,
    /// Id, unique for the pool's lifetime.
    pub id: u64,
    /// Whether this is a read-only snapshot.
    pub snapshot: bool,
    /// Virtual size in bytes.
    pub size: u64,
    /// Bytes of data units mapped (units × unit size).
    pub allocated: u64,
    /// Bytes of mapped units no other volume or snapshot references: what deleting
    /// this one would free.
    pub exclusive: u64,
    /// Bytes of mapped units shared with other volumes or snapshots.
    pub shared: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created: u64,
    /// Created empty and never written since: no unit was ever mapped, so every block
    /// reads as zeros and no file system can be on it. A clone or snapshot is pristine
    /// when its source was at that moment (it shares nothing mapped).
    pub pristine: bool,
    /// Its labels, sorted by key.
    pub labels: Labels,
    /// The nodes it is published to, in the order they were attached.
    pub attachments: Vec<Attachment>,
}

/// Pool-wide space accounting, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// Pool UUID, hyphenated.
    pub uuid: String,
    /// Path of the pool file or device.
    pub path: PathBuf,
    /// Bytes of the pool: its superblocks, log and data area (what it was created with,
    /// or last grown to: [`crate::Pool::grow`]).
    pub size: u64,
    /// Bytes of the data area (units × unit size).
    pub capacity: u64,
    /// Bytes in data units referenced by volumes.
    pub used: u64,
    /// Bytes in units holding checkpoint metadata.
    pub metadata: u64,
    /// Bytes in free units (including units whose free is not yet durable).
    pub free: u64,
    /// Of `free`, the bytes freed by deletes, trims and copies on write whose free is
    /// not yet durable: they become allocatable after the next commit (reclaim is
    /// no more than this wait; nothing is copied or rewritten).
    pub freeing: u64,
    /// Of `free`, the bytes data writes may not allocate: the metadata reserve, room
    /// for the next checkpoints (docs/on-disk-format.md, section 9). It grows with
    /// the metadata, so `free - reserved` is an upper bound on what writes to unmapped
    /// ranges can still take (at most a few percent high with 16 KiB units on an
    /// emptier pool, exact when full); a write that needs more gets `ENOSPC`.
    pub reserved: u64,
    /// Data-unit size.
    pub unit_size: u32,
    /// Number of volumes, snapshots included (each snapshot is a read-only volume).
    pub volumes: u64,
    /// Whether the pool file is opened with O_DIRECT.
    pub direct_io: bool,
    /// Whether the pool stopped accepting writes after an I/O error.
    pub failed: bool,
}

/// What the pool's commits and checkpoints have cost since it was opened
/// ([`Pool::commit_stats`]): for finding where writes wait (a flush waits for a commit;
/// a checkpoint's first step holds the volumes' maps and the allocator, so every write
/// that maps or allocates waits for it).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CommitStats {
    /// Commit cycles that wrote log batches (a flush with nothing new to log pays one
    /// `fdatasync` and is not counted).
    pub commits: u64,
    /// Seconds those commit cycles took in all.
    pub commit_seconds: f64,
    /// The longest commit cycle, seconds.
    pub commit_max_seconds: f64,
    /// Checkpoints written (at an open that needs one, when the log fills, on request).
    pub checkpoints: u64,
    /// Seconds the checkpoints took in all.
    pub checkpoint_seconds: f64,
    /// The longest checkpoint, seconds.
    pub checkpoint_max_seconds: f64,
    /// Bytes checkpoints wrote: the blocks of their page chunks and directory chunks.
    pub checkpoint_bytes: u64,
    /// The longest time a checkpoint's first step (a copy of all metadata) held the
    /// volumes' maps and the allocator, seconds: writes that map or allocate waited
    /// that long.
    pub checkpoint_hold_max_seconds: f64,
}

/// What the last [`Pool::open`] read to recover the pool: the checkpoint and the log
/// batches after it. Recovery reads grow with these, never with the pool's size (the
/// data area is not scanned; see docs/on-disk-format.md, section 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Log batches replayed on top of the checkpoint.
    pub batches_replayed: u64,
    /// Bytes read from the pool: superblocks, checkpoint chunks and log batches.
    pub bytes_read: u64,
}
