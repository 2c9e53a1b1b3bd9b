//! The pool file's helpers outside the ring: opening it (O_DIRECT when the file system
//! allows it), its advisory lock, its size, its holes, the room its file system has
//! left, and zeros written into a range with plain writes. Not here: I/O on the data
//! path (ring.rs).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Opens `path` read-write with `O_DIRECT` when the file system allows it, else buffered.
/// Returns the file and whether O_DIRECT is in use.
pub fn open_pool_file(path: &std::path::Path, create: bool) -> io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true).create(create);
    match o.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((o.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// Takes an advisory `flock` on the pool file, exclusive for a server and shared for
/// the checker, without waiting. Held until the file is closed.
///
/// Errors: `WouldBlock` when another process holds a conflicting lock.
pub fn lock_file(file: &File, exclusive: bool) -> io::Result<()> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    // SAFETY: flock on an fd that `file` keeps open; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Size in bytes of a regular file or block device.
pub fn device_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

/// The ranges of `[start, end)` that hold data in `file` (`lseek` with `SEEK_DATA` and
/// `SEEK_HOLE`), in order, as `(offset, length)`; everything else in the range is a
/// hole: no blocks of the host file system back it, and writing there needs room on
/// it. Stops after `max_ranges` ranges. A file system that does not tell holes apart
/// reports the whole range as data. (Some report blocks allocated but never written,
/// by `fallocate`, as holes: taking them for holes only costs a needless write.)
///
/// Errors: the `lseek` calls' (other than `ENXIO`, which means no data after an offset).
pub fn data_ranges(file: &File, start: u64, end: u64, max_ranges: usize) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let seek = |off: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        // SAFETY: lseek on an fd that `file` keeps open; no memory is passed.
        let r = unsafe { libc::lseek(fd, off as libc::off_t, whence) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
        }
        Ok(Some(r as u64))
    };
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end && out.len() < max_ranges {
        let Some(data) = seek(pos, libc::SEEK_DATA)? else { break };
        if data >= end {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        out.push((data, hole - data));
        pos = hole;
    }
    Ok(out)
}

/// Bytes the host file system holding `file` still has for it (`fstatvfs`: blocks
/// available to unprivileged users times the block size).
///
/// Errors: `fstatvfs`'s.
pub fn available_bytes(file: &File) -> io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: fstatvfs fills the struct it is given on success, on an fd kept open.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail * st.f_frsize)
}

/// Returns the blocks of `len` bytes at `offset` of `file` to the host file system
/// (`fallocate` with `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`): the range reads as
/// zeros afterwards, the size does not change.
///
/// Errors: `fallocate`'s (`EOPNOTSUPP` where the file system cannot).
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on an fd that `file` keeps open; no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Discards `len` bytes at `offset` of the block device `file` (`BLKDISCARD`): the
/// device may give their space back (a thin-provisioned or flash device); what they read
/// afterwards is undefined.
///
/// Errors: the `ioctl`'s (`EOPNOTSUPP` where the device takes no discards).
pub fn discard(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // linux/fs.h: #define BLKDISCARD _IO(0x12,119)
    const BLKDISCARD: libc::c_ulong = 0x1277;
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64s (start, length) from the pointer, which points
    // at `range`, alive for the call; the fd is kept open by `file`.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, range.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Allocates blocks for `len` bytes at `offset` of `file` (`fallocate`, mode 0: the
/// size does not change, the content reads as before).
///
/// Errors: `fallocate`'s (`ENOSPC` when the host file system has no room,
/// `EOPNOTSUPP` where it cannot).
pub fn allocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on an fd that `file` keeps open; no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, offset as libc::off_t, len as libc::off_t) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Writes zeros over bytes `[start, end)` of `file` with plain writes, up to 1 MiB at a
/// time from one block-aligned buffer (the file may be open with `O_DIRECT`, so both
/// ends are multiples of 4096). For the first writes into the holes of a pool file,
/// which may wait for its file system to allocate blocks: off the data plane, where
/// the ring gains nothing.
///
/// Errors: the first write that failed, with the byte offset it was at.
pub fn write_zeros(file: &File, start: u64, end: u64) -> Result<(), (u64, io::Error)> {
    use std::os::unix::fs::FileExt;
    const PIECE: u64 = 1 << 20;
    let zeros = super::AlignedBuf::zeroed(end.saturating_sub(start).min(PIECE) as usize);
    let mut at = start;
    while at < end {
        let len = (end - at).min(PIECE);
        file.write_all_at(&zeros.full()[..len as usize], at).map_err(|e| (at, e))?;
        at += len;
    }
    Ok(())
}
