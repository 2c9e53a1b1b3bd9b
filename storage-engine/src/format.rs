//! The on-disk format: fixed-layout little-endian structs and the pool geometry.
//!
//! Lives here: the superblock, the log batch header, the checkpoint chunk header, the
//! record framing shared by the log and checkpoints, and every record body, each a
//! `#[repr(C)]` zerocopy struct with a compile-time size check. docs/on-disk-format.md
//! draws them byte by byte. Not here: the logic that writes them (`journal`, `pool`).

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Magic at byte 0 of both superblock slots.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"FERROVOL";
/// Format version written by this build. Version 2 added snapshots and clones
/// (`REC_SHARE`, `VolumeRec::flags`, shared pages); version 3 added
/// [`BatchHeader::commit_index`], which lets replay tell a torn commit from a damaged
/// acknowledged one; version 4 added volume properties ([`REC_PROPS`]: labels and
/// attachments) and [`VOLUME_FLAG_WRITTEN`]. An older pool opens and is written as the
/// current version from its first checkpoint on (its open writes one), so older
/// builds refuse it afterwards. Version 5 added the three feature sets of the
/// superblock ([`Superblock::incompat_features`], [`Superblock::compat_features`],
/// [`Superblock::ro_compat_features`], ext4's scheme): later additions to the format
/// are feature bits, so that a build opens every pool whose features it knows, or
/// that adds only compatible ones, and the version changes no more.
pub const FORMAT_VERSION: u32 = 5;
/// First format version whose superblock carries compatible and read-only-compatible
/// feature bits (before it, those bytes were reserved and zero).
pub const FEATURES_VERSION: u32 = 5;
/// Incompatible feature: the current checkpoint stores no refcounts ([`REC_REFCOUNTS`]);
/// the open derives every unit's from the mappings (docs/on-disk-format.md 7.3), which it
/// walks anyway. Set by every checkpoint this build writes; a build that does not know it
/// would take every mapped unit for free, so it must refuse the pool.
pub const INCOMPAT_DERIVED_REFCOUNTS: u64 = 1 << 0;
/// Incompatible feature: the checkpoint keeps its mapping pages in *page chunks*
/// ([`PAGE_CHUNK_MAGIC`], [`REC_PAGE_BODY`]) that later checkpoints keep while their
/// pages are unchanged, and its chain of chunks is a directory ([`REC_PAGE_CHUNK`],
/// [`REC_PAGE_LOCS`]) naming them (docs/on-disk-format.md 5). Set by every checkpoint
/// this build writes; a build that does not know it would find no pages.
pub const INCOMPAT_PAGE_CHUNKS: u64 = 1 << 1;
/// Incompatible feature (with [`INCOMPAT_PAGE_CHUNKS`]): the page chunks also hold
/// *leaves* ([`REC_LEAF_BODY`]: where up to 512 consecutive pages of a volume are),
/// which volumes, snapshots and clones share, and the directory names each volume's
/// leaves ([`REC_LEAF_LOCS`]) instead of its pages (docs/on-disk-format.md 5). Set by
/// every checkpoint this build writes; a build that does not know it would find no
/// pages.
pub const INCOMPAT_SHARED_LEAVES: u64 = 1 << 2;
/// Incompatible feature (with [`INCOMPAT_PAGE_CHUNKS`]): every chunk of the checkpoint
/// is stored twice, in two different data units (*ditto* copies, as ZFS stores its
/// metadata): the superblock names both copies of the directory's first chunk
/// ([`Superblock::checkpoint_copy_unit`]), each directory chunk both copies of the next
/// ([`ChunkHeader::next_copy_unit`]), and the directory both copies of each page chunk
/// ([`REC_PAGE_CHUNK_PAIR`]); and every superblock write goes into both slots. A chunk
/// that fails its checksum is read from its copy, so one bad block loses nothing
/// (docs/on-disk-format.md 5.5). Set by every checkpoint this build writes; a build
/// that does not know it would read no page chunk.
pub const INCOMPAT_DITTO: u64 = 1 << 3;
/// Incompatible features this build knows.
pub const INCOMPAT_FEATURES_KNOWN: u64 =
    INCOMPAT_DERIVED_REFCOUNTS | INCOMPAT_PAGE_CHUNKS | INCOMPAT_SHARED_LEAVES | INCOMPAT_DITTO;
/// Read-only-compatible features this build knows: none.
pub const RO_COMPAT_FEATURES_KNOWN: u64 = 0;
/// Compatible features this build knows: none (unknown ones are kept, never refused).
pub const COMPAT_FEATURES_KNOWN: u64 = 0;
/// First format version whose checkpoints carry [`VOLUME_FLAG_WRITTEN`] (before it, a
/// volume counts as written when it maps a unit).
pub const WRITTEN_FLAG_VERSION: u32 = 4;
/// Largest sequence number and absolute log position a valid pool holds (2^62): both
/// only grow, by far less than that in any pool's life, and a larger one (damage under
/// a valid checksum) is refused rather than left to overflow.
pub const MAX_SEQ: u64 = 1 << 62;
/// First format version whose log batches carry [`BatchHeader::commit_index`].
pub const COMMIT_INDEX_VERSION: u32 = 3;
/// Oldest format version this build reads.
pub const MIN_READ_VERSION: u32 = 1;
/// Size of the I/O block, in bytes: the granularity of the written-block bitmap, of
/// O_DIRECT I/O and of log and checkpoint writes.
pub const BLOCK_SIZE: u64 = 4096;
/// Byte offsets of the two superblock slots; generation `g` is written to slot `g % 2`.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 4096];
/// Byte offset of the log region.
pub const LOG_OFFSET: u64 = 1 << 20;
/// Magic of a log batch header ("FVLG").
pub const LOG_MAGIC: u32 = u32::from_le_bytes(*b"FVLG");
/// Magic of a checkpoint chunk header ("FVCP").
pub const CHECKPOINT_MAGIC: u32 = u32::from_le_bytes(*b"FVCP");
/// Magic of a page chunk's header ("FVPG"): a [`ChunkHeader`] whose payload holds
/// [`REC_PAGE_BODY`] records or [`REC_LEAF_BODY`] records (a chunk holds one kind),
/// kept from one checkpoint to the next while what it holds is.
pub const PAGE_CHUNK_MAGIC: u32 = u32::from_le_bytes(*b"FVPG");
/// "No unit" in on-disk unit fields.
pub const NO_UNIT: u64 = u64::MAX;
/// Smallest and largest allowed data-unit sizes, in bytes. The written-block bitmap of
/// a unit is kept in 32 bits in memory, so a unit holds at most 32 blocks.
pub const MIN_UNIT_SIZE: u32 = 16 * 1024;
/// See [`MIN_UNIT_SIZE`].
pub const MAX_UNIT_SIZE: u32 = 128 * 1024;
/// Largest log batch, in bytes including its header.
pub const MAX_BATCH_BYTES: usize = 1 << 20;

/// CRC-32C (Castagnoli) of `bytes`.
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// The pool header, 256 bytes, stored twice (slots at byte 0 and 4096). The slot with
/// a valid checksum and the highest `generation` is current.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct Superblock {
    /// [`SUPERBLOCK_MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_VERSION`].
    pub version: U32,
    /// `size_of::<Superblock>()`, 256.
    pub header_size: U32,
    /// Random UUID chosen at pool creation; log batches and checkpoint chunks carry it.
    pub pool_uuid: [u8; 16],
    /// Bytes of the file or device the pool was created on.
    pub pool_size: U64,
    /// Data-unit (allocation-unit) size in bytes, a power of two in 16..=128 KiB.
    pub unit_size: U32,
    /// [`BLOCK_SIZE`].
    pub block_size: U32,
    /// Byte offset of the log region ([`LOG_OFFSET`]).
    pub log_offset: U64,
    /// Bytes in the log region, a multiple of [`BLOCK_SIZE`].
    pub log_size: U64,
    /// Byte offset of data unit 0, a multiple of `unit_size`.
    pub data_offset: U64,
    /// Number of data units.
    pub unit_count: U64,
    /// Incremented on every superblock write.
    pub generation: U64,
    /// First unit of the current checkpoint, or [`NO_UNIT`] for an empty pool.
    pub checkpoint_unit: U64,
    /// Number of chunks (units) in the current checkpoint.
    pub checkpoint_chunks: U64,
    /// Sequence number of the last log batch the checkpoint includes; replay starts
    /// with `checkpoint_seq + 1`.
    pub checkpoint_seq: U64,
    /// Absolute log position (bytes, not yet reduced modulo `log_size`) where replay starts.
    pub log_head: U64,
    /// Incompatible feature bits (version 5; `features` before, always zero): a build
    /// that does not know one of them refuses the pool. None are defined yet
    /// ([`INCOMPAT_FEATURES_KNOWN`]).
    pub incompat_features: U64,
    /// Compatible feature bits (version 5): a build that does not know one of them
    /// opens, checks and writes the pool as usual, and keeps the bit. None are defined
    /// yet ([`COMPAT_FEATURES_KNOWN`]).
    pub compat_features: U64,
    /// Read-only-compatible feature bits (version 5): a build that does not know one of
    /// them may read the pool (`check`) but refuses to open it, since an open writes.
    /// None are defined yet ([`RO_COMPAT_FEATURES_KNOWN`]).
    pub ro_compat_features: U64,
    /// Unit of the copy of the current checkpoint's first chunk ([`INCOMPAT_DITTO`]);
    /// zero without that feature (reserved before it).
    pub checkpoint_copy_unit: U64,
    /// Zero.
    pub reserved: [u8; 96],
    /// CRC-32C of bytes 0..248.
    pub crc: U32,
    /// Zero.
    pub pad: U32,
}
const _: () = assert!(size_of::<Superblock>() == 256);

impl Superblock {
    /// The checksum this superblock should carry.
    pub fn compute_crc(&self) -> u32 {
        crc(&self.as_bytes()[..248])
    }
}

/// Header of a log batch: one write of whole 4 KiB blocks to the log region holding a
/// run of records. 32 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct BatchHeader {
    /// [`LOG_MAGIC`].
    pub magic: U32,
    /// CRC-32C of the header (with this field zero) followed by the payload.
    pub crc: U32,
    /// Sequence number: one more than the previous batch's. Never reused: every open
    /// writes a checkpoint that moves the sequence past any batch a crash could have
    /// left behind the end of the log.
    pub seq: U64,
    /// First 8 bytes of the pool UUID.
    pub pool_tag: U64,
    /// Bytes of records after the header.
    pub payload_len: U32,
    /// Blocks occupied by the batch, header included (1 to 256).
    pub blocks: U16,
    /// Position of this batch among the batches of its commit, 0 for the first: the
    /// commit began at sequence number `seq - commit_index`. Format version 3 on;
    /// always 0 in versions 1 and 2, where this was the upper half of a 32-bit
    /// `blocks`.
    pub commit_index: U16,
}
const _: () = assert!(size_of::<BatchHeader>() == 32);

/// Header of a checkpoint chunk: one data unit holding a run of records. 64 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ChunkHeader {
    /// [`CHECKPOINT_MAGIC`].
    pub magic: U32,
    /// CRC-32C of the header (with this field zero) followed by the payload.
    pub crc: U32,
    /// The checkpoint's `checkpoint_seq` (identifies which checkpoint this chunk is of).
    pub checkpoint_seq: U64,
    /// Index of this chunk in the checkpoint, from 0.
    pub index: U64,
    /// Unit of the next chunk, or [`NO_UNIT`] for the last.
    pub next_unit: U64,
    /// Bytes of records after the header.
    pub payload_len: U32,
    /// Zero.
    pub pad: U32,
    /// The pool UUID.
    pub pool_uuid: [u8; 16],
    /// Unit of the copy of the next chunk ([`INCOMPAT_DITTO`]), or [`NO_UNIT`] for the
    /// last; in page chunks, [`NO_UNIT`]. Zero without that feature (reserved before
    /// it). Both copies of a chunk are the same bytes.
    pub next_copy_unit: U64,
}
const _: () = assert!(size_of::<ChunkHeader>() == 64);

/// Framing of one record in a log batch or checkpoint chunk: 4 bytes, then `len` bytes
/// of body. Records never span batches or chunks.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RecordHeader {
    /// One of the `REC_*` kinds.
    pub kind: u8,
    /// Zero.
    pub pad: u8,
    /// Body length in bytes.
    pub len: U16,
}
const _: () = assert!(size_of::<RecordHeader>() == 4);

/// Log: map logical unit `lunit` of a volume to data unit `punit` with the given
/// written-block bitmap (the full new state of the mapping entry).
pub const REC_MAP: u8 = 1;
/// Log: remove the mapping of `lunit` (its data unit loses one reference).
pub const REC_UNMAP: u8 = 2;
/// Log and checkpoint: a volume exists ([`VolumeRec`] followed by its name).
pub const REC_VOLUME: u8 = 3;
/// Log: delete a volume and drop its mappings' references.
pub const REC_VOLUME_DELETE: u8 = 4;
/// Log: set a volume's virtual size.
pub const REC_VOLUME_RESIZE: u8 = 5;
/// Log: a new volume or snapshot sharing every mapping page of another ([`ShareRec`]
/// followed by the new name): snapshot create and clone.
pub const REC_SHARE: u8 = 6;
/// Log and checkpoint: the whole property set of a volume, replacing the one before
/// ([`PropsRec`], then its labels, then its attachments).
pub const REC_PROPS: u8 = 7;
/// Checkpoint: pool-wide counters ([`PoolRec`]).
pub const REC_POOL: u8 = 16;
/// Checkpoint: one mapping page of a volume ([`PageRec`] then [`PageEntry`]s).
pub const REC_PAGE: u8 = 17;
/// Checkpoint: a volume's page index refers to a page already written ([`PageRefRec`]).
pub const REC_PAGE_REF: u8 = 18;
/// Checkpoint: reference counts of data units ([`RefcountEntry`]s). Read from
/// checkpoints without [`INCOMPAT_DERIVED_REFCOUNTS`] only; this build writes none.
pub const REC_REFCOUNTS: u8 = 19;
/// Checkpoint: end marker with totals ([`EndRec`]); a checkpoint without it is invalid.
pub const REC_END: u8 = 20;
/// Page chunk: the entries of one mapping page ([`PageBodyRec`] then [`PageEntry`]s),
/// found by its page chunk's unit and its byte offset in the chunk's payload
/// ([`INCOMPAT_PAGE_CHUNKS`]).
pub const REC_PAGE_BODY: u8 = 21;
/// Checkpoint: a page chunk the checkpoint's pages are read from ([`PageChunkRec`]).
pub const REC_PAGE_CHUNK: u8 = 22;
/// Checkpoint: where a volume's pages are ([`PageLocsRec`] then up to
/// [`MAX_PAGE_LOCS`] [`PageLoc`]s).
pub const REC_PAGE_LOCS: u8 = 23;
/// Most [`PageLoc`]s in one [`REC_PAGE_LOCS`] record (6,156 bytes with its framing).
pub const MAX_PAGE_LOCS: usize = 512;
/// Page chunk: one leaf, where its pages are ([`LeafBodyRec`] then up to 512
/// [`PageLoc`]s whose `page_index` is the page's index in the leaf, 0 … 511,
/// ascending), found by its page chunk's unit and its byte offset in the chunk's
/// payload ([`INCOMPAT_SHARED_LEAVES`]).
pub const REC_LEAF_BODY: u8 = 24;
/// Checkpoint: where a volume's leaves are ([`LeafLocsRec`] then up to
/// [`MAX_PAGE_LOCS`] [`LeafLoc`]s; [`INCOMPAT_SHARED_LEAVES`]).
pub const REC_LEAF_LOCS: u8 = 25;
/// Checkpoint: a page chunk the checkpoint's pages are read from, and the unit of its
/// copy ([`PageChunkPairRec`]; [`INCOMPAT_DITTO`], in place of [`REC_PAGE_CHUNK`]).
pub const REC_PAGE_CHUNK_PAIR: u8 = 26;

/// Body of [`REC_MAP`]. 32 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct MapRec {
    /// Volume id.
    pub volume: U64,
    /// Logical unit: byte offset in the volume divided by the unit size.
    pub lunit: U64,
    /// Data unit in the pool.
    pub punit: U64,
    /// Bit `i` set: block `i` of the unit has been written (else it reads as zeros).
    pub bitmap: U64,
}
const _: () = assert!(size_of::<MapRec>() == 32);

/// Body of [`REC_UNMAP`]. 16 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct UnmapRec {
    /// Volume id.
    pub volume: U64,
    /// Logical unit.
    pub lunit: U64,
}
const _: () = assert!(size_of::<UnmapRec>() == 16);

/// Body of [`REC_VOLUME`]: 24 bytes, then `name_len` bytes of UTF-8 name.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct VolumeRec {
    /// Volume id, unique in the pool's lifetime.
    pub volume: U64,
    /// Virtual size in bytes.
    pub size: U64,
    /// Creation time, seconds since the Unix epoch.
    pub created: U32,
    /// Name length in bytes (1..=257: a snapshot is named `VOLUME@SNAPSHOT`).
    pub name_len: U16,
    /// [`VOLUME_FLAG_SNAPSHOT`], [`VOLUME_FLAG_WRITTEN`] (checkpoints only), or zero.
    pub flags: U16,
}
const _: () = assert!(size_of::<VolumeRec>() == 24);

/// [`VolumeRec::flags`]: a read-only snapshot rather than a writable volume.
pub const VOLUME_FLAG_SNAPSHOT: u16 = 1;
/// [`VolumeRec::flags`], in checkpoints: the volume is not *pristine*: it was made by
/// sharing a written one (a clone or snapshot of it) or has had a unit mapped since it
/// was created. In the log a [`REC_MAP`] record implies it, and a [`REC_SHARE`] record
/// gives the new volume its source's.
pub const VOLUME_FLAG_WRITTEN: u16 = 2;

/// Head of a [`REC_PROPS`] body (16 bytes), followed by `labels` labels (each a
/// [`LabelHead`] then the key's and the value's bytes) and `attachments` attachments
/// (each an [`AttachmentHead`] then the node id's bytes).
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PropsRec {
    /// Volume id.
    pub volume: U64,
    /// Number of labels.
    pub labels: U16,
    /// Number of attachments.
    pub attachments: U16,
    /// Zero.
    pub pad: U32,
}
const _: () = assert!(size_of::<PropsRec>() == 16);

/// One label in a [`REC_PROPS`] body (2 bytes), followed by the key and the value.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LabelHead {
    /// Key length in bytes (1..=63).
    pub key_len: u8,
    /// Value length in bytes (0..=255).
    pub value_len: u8,
}
const _: () = assert!(size_of::<LabelHead>() == 2);

/// One attachment in a [`REC_PROPS`] body (24 bytes), followed by `node_len` bytes of
/// node id.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct AttachmentHead {
    /// The attachment key a client presents to open the export.
    pub key: [u8; 16],
    /// When the attachment was made, seconds since the Unix epoch.
    pub created: U32,
    /// Node id length in bytes (1..=256).
    pub node_len: U16,
    /// [`ATTACH_FLAG_READ_ONLY`], [`ATTACH_FLAG_EXCLUSIVE`], or zero.
    pub flags: U16,
}
const _: () = assert!(size_of::<AttachmentHead>() == 24);

/// [`AttachmentHead::flags`]: the node may only read.
pub const ATTACH_FLAG_READ_ONLY: u16 = 1;
/// [`AttachmentHead::flags`]: no other node may be attached while this one is.
pub const ATTACH_FLAG_EXCLUSIVE: u16 = 2;

/// Head of a [`REC_SHARE`] body (32 bytes), followed by `name_len` bytes of name.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct ShareRec {
    /// Volume or snapshot whose pages are shared.
    pub source: U64,
    /// Id of the new volume or snapshot.
    pub target: U64,
    /// Virtual size of the new one, in bytes (the source's size).
    pub size: U64,
    /// Creation time, seconds since the Unix epoch.
    pub created: U32,
    /// Name length in bytes.
    pub name_len: U16,
    /// [`VOLUME_FLAG_SNAPSHOT`] or zero (a clone).
    pub flags: U16,
}
const _: () = assert!(size_of::<ShareRec>() == 32);

/// Body of [`REC_VOLUME_DELETE`]. 8 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct VolumeDeleteRec {
    /// Volume id.
    pub volume: U64,
}

const _: () = assert!(size_of::<VolumeDeleteRec>() == 8);

/// Body of [`REC_VOLUME_RESIZE`]. 16 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct VolumeResizeRec {
    /// Volume id.
    pub volume: U64,
    /// New virtual size in bytes.
    pub size: U64,
}

const _: () = assert!(size_of::<VolumeResizeRec>() == 16);

/// Body of [`REC_POOL`]. 16 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PoolRec {
    /// The id the next created volume gets.
    pub next_volume: U64,
    /// Number of volumes in the checkpoint.
    pub volumes: U64,
}

const _: () = assert!(size_of::<PoolRec>() == 16);

/// Head of a [`REC_PAGE`] body (32 bytes), followed by `entries` [`PageEntry`]s.
/// A page covers 512 consecutive logical units; only mapped entries are stored.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageRec {
    /// Volume id.
    pub volume: U64,
    /// Page index: first logical unit / 512.
    pub page_index: U64,
    /// Id of the page within this checkpoint, so other volumes can share it ([`REC_PAGE_REF`]).
    pub page_id: U64,
    /// Number of entries that follow.
    pub entries: U32,
    /// Zero.
    pub pad: U32,
}
const _: () = assert!(size_of::<PageRec>() == 32);

/// One mapped entry of a page. 16 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageEntry {
    /// Index in the page, 0..512.
    pub index: U32,
    /// Written-block bitmap (bit `i` = block `i` of the unit).
    pub bitmap: U32,
    /// Data unit.
    pub punit: U64,
}
const _: () = assert!(size_of::<PageEntry>() == 16);

/// Body of [`REC_PAGE_REF`]. 24 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageRefRec {
    /// Volume id.
    pub volume: U64,
    /// Page index in that volume.
    pub page_index: U64,
    /// A `page_id` of an earlier [`REC_PAGE`] in the same checkpoint.
    pub page_id: U64,
}

const _: () = assert!(size_of::<PageRefRec>() == 24);

/// One entry of a [`REC_REFCOUNTS`] body. 16 bytes. Units not listed have refcount 0.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RefcountEntry {
    /// Data unit.
    pub unit: U64,
    /// Number of mapping-page entries that reference it.
    pub refcount: U32,
    /// Zero.
    pub pad: U32,
}

const _: () = assert!(size_of::<RefcountEntry>() == 16);

/// Body of [`REC_END`]. 32 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct EndRec {
    /// Volumes written.
    pub volumes: U64,
    /// Pages written ([`REC_PAGE`] count).
    pub pages: U64,
    /// Refcount entries written.
    pub refcounts: U64,
    /// Number of chunks in the checkpoint.
    pub chunks: U64,
}

const _: () = assert!(size_of::<EndRec>() == 32);

/// Mapping entries per page (in memory and in checkpoints).
pub const PAGE_ENTRIES: usize = 512;

/// Head of a [`REC_PAGE_BODY`] (8 bytes), followed by `entries` [`PageEntry`]s in
/// ascending `index`.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageBodyRec {
    /// Number of [`PageEntry`]s that follow, 1 … 512.
    pub entries: U32,
    /// Zero.
    pub pad: U32,
}
const _: () = assert!(size_of::<PageBodyRec>() == 8);

/// Body of [`REC_PAGE_CHUNK`]. 16 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageChunkRec {
    /// Data unit holding the page chunk.
    pub unit: U64,
    /// `checkpoint_seq` of the checkpoint that wrote it (its header's), at most this
    /// checkpoint's.
    pub seq: U64,
}
const _: () = assert!(size_of::<PageChunkRec>() == 16);

/// Body of [`REC_PAGE_CHUNK_PAIR`]. 24 bytes.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageChunkPairRec {
    /// Data unit holding the page chunk: the unit page and leaf locations name.
    pub unit: U64,
    /// `checkpoint_seq` of the checkpoint that wrote it (its header's), at most this
    /// checkpoint's.
    pub seq: U64,
    /// Data unit holding its copy, the same bytes.
    pub copy: U64,
}
const _: () = assert!(size_of::<PageChunkPairRec>() == 24);

/// Head of a [`REC_PAGE_LOCS`] body (8 bytes), followed by [`PageLoc`]s.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageLocsRec {
    /// Volume id (its [`REC_VOLUME`] comes earlier in the checkpoint).
    pub volume: U64,
}
const _: () = assert!(size_of::<PageLocsRec>() == 8);

/// Where one mapping page of a volume is. 12 bytes. Several volumes' locations may
/// name the same body: the page is shared.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct PageLoc {
    /// Page index in the volume (`first lunit / 512`).
    pub page_index: U32,
    /// Data unit of the page chunk (one of the checkpoint's [`REC_PAGE_CHUNK`]s).
    pub unit: U32,
    /// Byte offset of the [`REC_PAGE_BODY`] record (its framing) in that chunk's payload.
    pub offset: U32,
}
const _: () = assert!(size_of::<PageLoc>() == 12);

/// Head of a [`REC_LEAF_BODY`] body (8 bytes), followed by [`PageLoc`]s.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LeafBodyRec {
    /// Number of [`PageLoc`]s that follow, 1 … 512.
    pub pages: U32,
    /// Zero.
    pub pad: U32,
}
const _: () = assert!(size_of::<LeafBodyRec>() == 8);

/// Head of a [`REC_LEAF_LOCS`] body (8 bytes), followed by [`LeafLoc`]s.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LeafLocsRec {
    /// Volume id (its [`REC_VOLUME`] comes earlier in the checkpoint).
    pub volume: U64,
}
const _: () = assert!(size_of::<LeafLocsRec>() == 8);

/// Where one leaf of a volume is. 12 bytes. Several volumes' locations may name the
/// same leaf: the leaf, and every page it holds, is shared.
#[derive(Debug, Clone, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct LeafLoc {
    /// Leaf index in the volume (`first page index / 512`).
    pub leaf_index: U32,
    /// Data unit of the page chunk (one of the checkpoint's [`REC_PAGE_CHUNK`]s).
    pub unit: U32,
    /// Byte offset of the [`REC_LEAF_BODY`] record (its framing) in that chunk's payload.
    pub offset: U32,
}
const _: () = assert!(size_of::<LeafLoc>() == 12);
