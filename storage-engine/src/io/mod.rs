//! Storage I/O on io_uring, and the aligned buffers it reads into and writes from.
//!
//! Lives here, by file: buf.rs ([`AlignedBuf`], a 4 KiB-aligned heap buffer with a byte
//! *view*, and the cache that recycles them), ring.rs ([`IoRing`], an io_uring, or one
//! per data-plane runtime, that executes reads, writes and `fdatasync` on the pool file,
//! submitted from the caller's thread and reaped on a tokio runtime or a thread of its
//! own; and [`IoObserver`], through which tests watch and steer it), file.rs (opening,
//! locking and sizing the pool file, its holes and its host's room). This is the only
//! module of the engine with `unsafe`; each block says why it is sound. Not here: what
//! the I/O means (mappings, logs, checkpoints live in the other modules), the test
//! observers themselves (`testing`).
//!
//! # Buffer ownership
//! A buffer is *moved* into [`IoRing::rw`] and stays owned by the ring's in-flight table
//! until every segment's completion has arrived from the kernel; only then is it handed
//! back through the returned channel. Dropping the future that waits for the result
//! does not free the buffer while the kernel may still write into it: the table keeps
//! it until the completion and then drops it, and dropping the `IoRing` waits for every
//! entry still in the kernel. So the kernel never sees a freed buffer.
#![allow(unsafe_code)] // the one module of the engine with unsafe: each block says why it is sound

mod buf;
mod file;
mod ring;

pub use buf::{AlignedBuf, ALIGN};
pub use file::{
    allocate, available_bytes, data_ranges, device_size, discard, lock_file, open_pool_file, punch_hole, write_zeros,
};
pub use ring::{Dir, FlushReport, IoObserver, IoOptions, IoRing, Reaper, RwResult, Segment};
