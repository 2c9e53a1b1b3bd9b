//! In-memory metadata: mapping tables of thin volumes, and the data-unit allocator.
//!
//! Lives here, by file: map.rs ([`MapTable`]: logical unit -> data unit + written-block
//! bitmap, in 512-entry pages under 512-page leaves, both of which snapshots and clones
//! share and copy on write; and [`writable_in_place`], the copy-on-write decision of the
//! data path), alloc.rs ([`Allocator`]: per-unit refcounts, the free set and the spare,
//! frees and settling marks waiting to become durable, the counts a checkpoint's size
//! is bounded by).
//!
//! Refcounting is lazy, as in qcow2, btrfs and Rodeh's copy-on-write B-trees: a data
//! unit's refcount counts the *pages* that reference it, a page's `owners` counts the
//! *leaves* that hold it, and a leaf's `owners` the *tables* (volumes, snapshots) that
//! hold it. Sharing a table bumps only its leaves' `owners`; when an owner changes a
//! leaf held by others, it copies the leaf and gives every page of the copy an owner;
//! when it changes a page held by other leaves, it copies the page and increments the
//! refcount of every unit the page maps. A unit is exclusive to a table when its leaf
//! and its page have one owner each and the unit a refcount of one; otherwise a write
//! must copy the unit first.
//!
//! # The sharing signals and their order
//! The data path decides "may this write go in place?" without the allocator's lock,
//! from four signals read in this order: the leaf's `owners`, the page's `owners`, the
//! unit's refcount, the unit's settling count ([`writable_in_place`]). Every change of
//! them keeps one rule: **a signal that says "shared" is raised before any signal that
//! said "shared" is lowered**, so that a reader that sees one lowered sees the other
//! raised:
//! - copying a shared leaf ([`MapTable::set`]) gives each page of the copy its owner
//!   *before* the original leaf loses this table as an owner;
//! - copying a shared page ([`MapTable::set`]) gives each unit of the copy its
//!   reference *before* the original page loses this leaf as an owner;
//! - a unit whose refcount falls to one is marked settling *before* the refcount is
//!   stored ([`Allocator::decref`]);
//! - a page left to a single leaf, or a leaf left to a single table, by a delete has
//!   the units it alone reaches marked settling *before* its owner count falls
//!   ([`MapTable::release_all`]).
//!
//! A settling mark is released only once the change that made the unit exclusive is
//! durable (on-disk-format.md 6.1 rule 9), so a unit never looks exclusive while another
//! table can still reach it, in memory or after a crash. Every change of a page's owner
//! count happens with the allocator locked (the `&mut Allocator` these calls take), so
//! "is the leaf or page shared?" and the change that follows are one step: two holders
//! copying a leaf or page at once, or one copying while the other is deleted, see each
//! other, and whoever takes a page's owner count to zero drops its units' references.
//! `tests/sharing_model.rs` checks these interleavings with a deterministic scheduler.
//!
//! Not here: I/O, logging, locking (the pool wraps these in its locks). Public so that
//! benchmarks, tools and the concurrency checks can exercise them; the pool is their
//! only writer.

mod alloc;
mod map;
#[cfg(test)]
mod tests;

pub use alloc::{Allocator, MetaCounts, PendingMark, RefcountTable, StripedCounts, META};
pub use map::{writable_in_place, Entry, Leaf, MapPage, MapTable, PageStored, LEAF_PAGES, UNMAPPED};

/// The atomics of the sharing state machine: std's, or shuttle's when the engine is
/// built for the deterministic concurrency checks (feature `shuttle`), so that its
/// schedulers can interleave threads at every load and store of owners, refcounts and
/// settling counts.
pub(crate) mod sync {
    #[cfg(feature = "shuttle")]
    pub use shuttle::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};
    pub use std::sync::atomic::Ordering;
    #[cfg(not(feature = "shuttle"))]
    pub use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};

    /// `n` atomics of value 0. With std's, one zeroed allocation (`calloc`: pages the
    /// kernel hands out zeroed, resident only once touched).
    #[cfg(not(feature = "shuttle"))]
    pub fn zeroed<T: zerocopy::FromZeros>(n: usize) -> Box<[T]> {
        use zerocopy::FromZeros;
        <[T]>::new_box_zeroed_with_elems(n).expect("allocating a zeroed table")
    }

    /// `n` atomics of value 0.
    #[cfg(feature = "shuttle")]
    pub fn zeroed<T: Default>(n: usize) -> Box<[T]> {
        (0..n).map(|_| T::default()).collect()
    }
}
