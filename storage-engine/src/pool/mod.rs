//! The public handle of a pool: [`Pool`] and [`PoolOptions`]. Lives here: the handle,
//! what it reports (volumes, status) and closing; by file, open.rs (creating, opening,
//! formatting a device), catalogue.rs (volumes, snapshots and clones: create,
//! delete, resize, share, diff) and attach.rs (publishing volumes to nodes). Not here: the shared state and commits (`store`), the
//! data path (`volume`), checking (`check`).

mod attach;
mod catalogue;
mod open;

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::info::{PoolStatus, Recovery, VolumeInfo};
use crate::io::IoOptions;
use crate::journal;
use crate::store::Store;
use crate::volume::Volume;

pub(crate) use open::lock;

/// Default pool size for a newly created pool file: 64 GiB (sparse).
pub const DEFAULT_POOL_SIZE: u64 = 64 << 30;
/// Default data-unit size: 64 KiB.
pub const DEFAULT_UNIT_SIZE: u32 = 64 * 1024;
/// How to create and open a pool.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Size in bytes for a new pool file (ignored for block devices, whose size is used).
    pub size: u64,
    /// Data-unit (allocation-unit) size in bytes: a power of two from 16 KiB to 128 KiB.
    pub unit_size: u32,
    /// How the pool's io_uring is set up (not stored in the pool).
    pub io: IoOptions,
    /// Open the pool from its one valid superblock slot even when the other slot is
    /// damaged and may have held the newer generation, accepting the loss of whatever
    /// was committed after the valid one (on-disk-format.md 7.1). Off by default: such
    /// a pool is refused with [`ErrorKind::Corrupt`].
    pub accept_superblock_rollback: bool,
    /// Open the pool even if a log batch is damaged with a later commit intact behind
    /// it, replaying the log up to the damaged batch and dropping the commits from it
    /// on (on-disk-format.md 4.5). Off by default: such a pool is refused with
    /// [`ErrorKind::Corrupt`].
    pub accept_log_loss: bool,
    /// Allocate every block of a pool file on the host file system (`fallocate`) at
    /// create and at open, so that no write to the pool ever needs room from the host:
    /// a thin pool on a thick file. Ignored for block devices, which need none.
    pub preallocate: bool,
    /// On a block device, pass the data units the pool frees down to it as discards
    /// (`BLKDISCARD`, once their free is durable, as a pool file's freed units are
    /// punched), so that a thin-provisioned or flash device gets the space back. Off by
    /// default; ignored for pool files, which always give freed units back to their
    /// host file system unless preallocated.
    pub discard: bool,
}

impl PoolOptions {
    fn accept(&self) -> journal::Accept {
        journal::Accept {
            superblock_rollback: self.accept_superblock_rollback,
            log_loss: self.accept_log_loss,
            both_copies: false,
        }
    }
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            size: DEFAULT_POOL_SIZE,
            unit_size: DEFAULT_UNIT_SIZE,
            io: IoOptions::default(),
            accept_superblock_rollback: false,
            accept_log_loss: false,
            preallocate: false,
            discard: false,
        }
    }
}

/// A pool of thin volumes on one file or block device. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    store: Arc<Store>,
}

impl Pool {
    /// A handle for I/O on the volume `name`.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn volume(&self, name: &str) -> Result<Volume> {
        let vols = self.store.volumes().read();
        let vs = vols.get(name).ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume").volume(name))?;
        Ok(Volume::new(self.store.clone(), vs.clone()))
    }

    /// Information on one volume.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn volume_info(&self, name: &str) -> Result<VolumeInfo> {
        let vols = self.store.volumes().read();
        let vs = vols
            .get(name)
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume").op("volume info").volume(name))?;
        Ok(self.store.info(vs))
    }

    /// Names of every volume and snapshot (`VOL@SNAP`), sorted. Cheap: unlike
    /// [`Pool::list_volumes`] it computes no space accounting.
    pub fn names(&self) -> Vec<String> {
        self.store.volumes().read().keys().cloned().collect()
    }

    /// All volumes (not snapshots), sorted by name.
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        self.store.volumes().read().values().filter(|v| !v.snapshot).map(|v| self.store.info(v)).collect()
    }

    /// What commits and checkpoints have cost since the pool was opened.
    pub fn commit_stats(&self) -> crate::CommitStats {
        self.store.costs.stats()
    }

    /// Space accounting of the pool.
    pub fn status(&self) -> PoolStatus {
        // The registry before the allocator, never while holding it: deletes and
        // snapshots take the allocator while holding the registry.
        let volumes = self.store.volumes().read().len() as u64;
        let a = self.store.alloc();
        let us = self.store.geo().unit_size;
        let unit_count = a.unit_count();
        PoolStatus {
            uuid: uuid::Uuid::from_bytes(self.store.geo().uuid).to_string(),
            path: self.store.path().to_owned(),
            size: self.store.pool_size(),
            capacity: unit_count * us,
            used: a.used * us,
            metadata: a.meta * us,
            free: (unit_count - a.used - a.meta) * us,
            freeing: (a.pending_free.len() as u64 + a.punch_queue.len() as u64 + a.punching) * us,
            reserved: self.store.data_reserve(&a).min(unit_count - a.used - a.meta) * us,
            unit_size: us as u32,
            volumes,
            direct_io: self.store.direct(),
            failed: self.store.is_failed(),
        }
    }

    /// Grows the pool onto a larger file or device, online: to `size` bytes, or with
    /// `None` to the size its file or device has now (a device grown underneath, or a
    /// file lengthened by hand). A pool file is lengthened to `size`; a preallocated one
    /// (`PoolOptions::preallocate`) also gets the new range allocated. The new data
    /// units are free once both superblock slots name them (durable on return). A size
    /// that adds no whole unit changes nothing. Returns the status after.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] when `size` is smaller than the pool (a
    /// pool never shrinks), larger than its block device, or more than 2^32-2 units of
    /// its unit size; [`ErrorKind::NoSpace`] when the host file system has no room to
    /// preallocate; [`ErrorKind::Io`]; [`ErrorKind::Failed`] after close or failure.
    pub async fn grow(&self, size: Option<u64>) -> Result<PoolStatus> {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || store.grow_blocking(size))
            .await
            .map_err(|e| Error::new(ErrorKind::Failed, format!("the pool grow stopped: {e}")))?
            .map_err(|e| e.op("grow pool"))?;
        Ok(self.status())
    }

    /// Makes every write completed before the call durable (group commit across volumes).
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool failed (now or earlier).
    pub async fn flush(&self) -> Result<()> {
        self.store.commit().await
    }

    /// What the open of this pool read: log batches replayed and bytes read.
    pub fn recovery(&self) -> Recovery {
        self.store.recovery()
    }

    /// Stops the committer and commits what is left: every change and completed write
    /// is durable on return. Writes no checkpoint: the next open replays the log since
    /// the last one (at most half the log) and writes nothing. Writes, trims and
    /// flushes through outstanding [`Volume`] handles fail afterwards (reads still
    /// work); the pool file stays open until the last handle is dropped.
    ///
    /// Errors: [`ErrorKind::Failed`] if the pool had failed (nothing is written);
    /// [`ErrorKind::Io`] if the final commit cannot be written (the pool is then
    /// marked failed; the log still holds every change committed before).
    pub fn close(self) -> Result<()> {
        self.store.close()
    }
}
