//! Growing an open pool onto a larger file or device (docs/on-disk-format.md 6.4):
//! the order of its steps and their checks. Not here: the allocator's growth itself
//! ([`crate::meta::Allocator::grow`]), the management call and the CLI above the engine.

use std::os::unix::fs::FileTypeExt;
use std::sync::atomic::Ordering;

use super::Store;
use crate::error::{Error, ErrorKind, Result};
use crate::io;
use crate::meta::Allocator;

impl Store {
    /// Grows the pool to `size` bytes (`None`: the size its file or device has now), in
    /// this order: a file is lengthened (and, when the pool is preallocated, its new
    /// range allocated) and synced; then both superblock slots are written with the new
    /// size and unit count, each synced (under the log lock, so no checkpoint runs
    /// meanwhile); only then do the new units join the free set. A crash before the
    /// first slot is durable leaves the pool as it was (a longer file is allowed); after
    /// it, the pool opens grown. One grow at a time. Blocking: call it off the data
    /// plane. Returns whether the pool grew (not when `size` adds no whole unit).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] when `size` is smaller than the pool, larger
    /// than its device, or past 2^32-2 units of its unit size; [`ErrorKind::NoSpace`]
    /// when the host file system has no room to preallocate; [`ErrorKind::Io`] (the pool
    /// fails if a superblock write fails); [`ErrorKind::Failed`] after close or failure.
    pub(crate) fn grow_blocking(&self, size: Option<u64>) -> Result<bool> {
        let _one = self.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.check_writable()?;
        let file = &*self.file;
        let meta = file.metadata().map_err(|e| Error::io("stat the pool", e))?;
        let is_dev = meta.file_type().is_block_device();
        let now = io::device_size(file).map_err(|e| Error::io("size of the pool file or device", e))?;
        let current = self.pool_size.load(Ordering::SeqCst);
        let target = size.unwrap_or(now);
        let invalid = |m: String| Err(Error::new(ErrorKind::InvalidArgument, m));
        if target < current {
            return invalid(format!("the pool is {current} bytes and a pool never shrinks: {target} bytes is smaller"));
        }
        if is_dev && target > now {
            return invalid(format!("the device holds {now} bytes: a pool on it cannot grow to {target}"));
        }
        let (us, data_offset) = (self.geo.unit_size, self.geo.data_offset);
        let units = (target - data_offset) / us;
        if units > Allocator::MAX_UNITS as u64 {
            let max = data_offset + Allocator::MAX_UNITS as u64 * us;
            return invalid(format!(
                "{target} bytes is too large: with {us}-byte data units a pool holds at most 2^32-2 units ({max} bytes)"
            ));
        }
        let old_units = self.alloc.lock().unit_count();
        if units <= old_units {
            return Ok(false);
        }
        if !is_dev {
            // The file holds the whole pool (its size is what the superblock records,
            // and an open refuses a file shorter than that), not only its whole units.
            if now < target {
                file.set_len(target).map_err(|e| {
                    if e.raw_os_error() == Some(libc::EFBIG) {
                        Error::new(
                            ErrorKind::InvalidArgument,
                            format!("the host file system cannot hold a pool file of {target} bytes"),
                        )
                    } else {
                        Error::io(format!("lengthen the pool file to {target} bytes"), e)
                    }
                })?;
            }
            if self.backed_all.load(Ordering::Relaxed) {
                let (start, end) = (data_offset + old_units * us, data_offset + units * us);
                if let Err(e) = io::allocate(file, start, end - start) {
                    if now < target {
                        // Nothing of the pool lives there yet: give the host its room back.
                        let _ = file.set_len(now);
                    }
                    return Err(if e.raw_os_error() == Some(libc::ENOSPC) {
                        Error::new(ErrorKind::NoSpace, "the host file system has no room to preallocate the grown pool")
                    } else {
                        Error::io("preallocate the grown pool", e)
                    });
                }
            }
            if let Err(e) = file.sync_all() {
                // The same file as the ring's: a writeback error it reports is reported
                // once, so it fails the pool as an fdatasync error does.
                let e = Error::io("sync the lengthened pool file", e);
                self.fail(&e);
                return Err(e);
            }
        }
        let mut closed = false;
        self.with_log_locked(|log| {
            // A close that came first wrote its last commit: nothing more is written.
            if self.closed.load(Ordering::SeqCst) {
                closed = true;
                return Ok(());
            }
            let mut sb = log.sb.clone();
            sb.pool_size = target.into();
            sb.unit_count = units.into();
            // Both slots, so that no slot is left naming the smaller pool: one switch
            // writes both with ditto copies (every pool once opened by this build).
            let ditto = crate::journal::has_ditto(&sb);
            self.switch_superblock(log, sb)?;
            if !ditto {
                self.switch_superblock(log, log.sb.clone())?;
            }
            self.pool_size.store(target, Ordering::SeqCst);
            self.alloc.lock().grow(units as usize);
            Ok(())
        })?;
        if closed {
            return Err(Error::new(ErrorKind::Failed, "the pool was closed"));
        }
        tracing::info!(from = current, to = target, units, "grew the pool");
        Ok(true)
    }
}
