//! Metadata records, the redo log, and checkpoints: encoding, decoding and replay.
//!
//! Lives here, by file: records.rs (a [`Record`] is one metadata change; its framing,
//! and one commit's records as log batches), state.rs (the whole metadata as a plain
//! [`State`], replay of one record, the checkpoint's encoding and the bound on its
//! size), superblock.rs (geometry, choosing the current slot), recovery.rs ([`load`]:
//! superblock, checkpoint and log replay, for open and `check`), verify.rs (checks of
//! a loaded state that checksums cannot make, and its refcounts rebuilt from its
//! mappings). Not here: when to commit or checkpoint (the store), the data path.

mod records;
mod recovery;
mod state;
mod superblock;
#[cfg(test)]
mod tests;
mod verify;

pub(crate) use records::{encode_batches, Record};
pub(crate) use recovery::{load, read_at_file, Accept, Loaded, LogCursor};
pub(crate) use state::{
    checkpoint_bytes_bound, checkpoint_units_bound, chunk_fill, derive_refcounts, directory_bytes_bound, encode_bodies,
    leaf_body_bytes, page_chunk_units, CheckpointPlan, PageChunk, PageChunks, State, VolumeMeta, CHUNK_COPIES,
};
pub(crate) use superblock::{has_ditto, unknown_ro_compat, Geometry};
pub use verify::RefcountRepair;
pub(crate) use verify::{rebuild_refcounts, volume_problems};
