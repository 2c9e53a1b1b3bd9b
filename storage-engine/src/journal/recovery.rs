//! Loading a pool: the checkpoint the superblock names, then the log replayed on top
//! ([`load`], used by open and by `check`; docs/on-disk-format.md 7), and what it found
//! ([`Loaded`]). Reads only. Not here: what the pool does with it (open), the records'
//! codec (records.rs).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use zerocopy::{FromBytes, IntoBytes};

use super::records::{split_records, Record};
use super::state::{derive_refcounts, PageChunk, PageChunks, State, VolumeMeta};
use super::superblock::{read_superblock, Geometry, ReadAt, SlotRead};
use crate::error::{Error, Result};
use crate::format::*;
use crate::meta::{Allocator, Entry, Leaf, MapPage, MapTable, MetaCounts, PageStored, LEAF_PAGES, META};
use crate::props::Props;

/// The log's position after loading: where the next batch goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogCursor {
    /// Absolute position (bytes) where replay started and the log is kept from.
    pub head: u64,
    /// Absolute position of the next batch.
    pub pos: u64,
    /// Sequence number of the last valid batch.
    pub seq: u64,
}

/// Everything [`load`] found.
pub(crate) struct Loaded {
    pub sb: Superblock,
    pub geo: Geometry,
    pub state: State,
    pub log: LogCursor,
    /// Units of the current checkpoint: its chain of chunks, then its page chunks, each
    /// with its copy ([`INCOMPAT_DITTO`]).
    pub checkpoint_units: Vec<u32>,
    /// The current checkpoint's page chunks (also in `checkpoint_units`).
    pub page_chunks: PageChunks,
    /// Copies of checkpoint chunks found damaged, each read around from its other copy
    /// ([`INCOMPAT_DITTO`]): one line each, naming both units. The next checkpoint
    /// writes those chunks again.
    pub copy_warnings: Vec<String>,
    /// Checkpoint refcounts differing from those its mappings imply: (unit, stored, derived).
    pub refcount_mismatches: Vec<(u64, u32, u32)>,
    /// Log batches replayed.
    pub batches: u64,
    /// A damaged superblock slot the pool was opened despite ([`read_superblock`]).
    pub superblock_warning: Option<String>,
    /// Valid batches of later sequence numbers beyond the end of the replayed log, in a
    /// pool of format version 1 or 2, or kept out of the replay as asked
    /// ([`batches_beyond`]).
    pub log_warning: Option<String>,
    /// The highest sequence number of any valid batch in the log region, at least the
    /// last one replayed, and past it when a torn batch's header lies past the end: the
    /// checkpoint at open must number past it.
    pub highest_seq: u64,
}

/// Damage that [`load`] accepts, with a warning, instead of refusing the pool; each
/// accepts a loss of committed metadata. The default refuses both.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Accept {
    /// Open from the one valid superblock slot when the damaged one may have held the
    /// newer generation ([`read_superblock`]).
    pub superblock_rollback: bool,
    /// Open with the log replayed up to a damaged batch that has a later commit intact
    /// behind it, dropping the commits from the damaged batch on ([`batches_beyond`]).
    pub log_loss: bool,
    /// Read both copies of every checkpoint chunk ([`INCOMPAT_DITTO`]), as `check` and
    /// a repair do, so that a damaged second copy is found too; an open reads the
    /// second only when the first is damaged. (Not an acceptance of damage: this makes
    /// the load find more.)
    pub both_copies: bool,
}

/// Reads the superblock, the checkpoint and replays the log. Never writes.
pub(crate) fn load(read: &mut ReadAt<'_>, size: u64, accept: Accept) -> Result<Loaded> {
    let (sb, geo, superblock_warning, how) = read_superblock(read, size, accept.superblock_rollback)?;
    let rolled_back = how == SlotRead::RolledBack;
    let later_commits = if rolled_back {
        LaterCommits::RolledBack
    } else if accept.log_loss {
        LaterCommits::LossAccepted
    } else {
        LaterCommits::Refuse
    };
    let ditto = super::superblock::has_ditto(&sb);
    match load_from(read, sb, geo, later_commits, accept.both_copies) {
        Ok(loaded) => Ok(Loaded { superblock_warning, ..loaded }),
        // Read from one slot of two, the other damaged: commits of a later generation
        // behind the log mean the damaged slot held a newer checkpoint, whose write to
        // this slot the disk lost (two faults).
        // (Not when both slots are valid and differ: the newer is read, no rollback
        // can help.)
        Err(e) if e.kind() == crate::ErrorKind::Corrupt && ditto && how == SlotRead::AroundDamaged => {
            Err(Error::corrupt(format!(
                "{}. ({}.) The damaged slot may have held a newer checkpoint than the one read: if losing what \
                 was committed after it is acceptable, open the pool with a superblock rollback accepted \
                 (`ferrovol serve --accept-superblock-rollback`); otherwise restore it from a copy",
                e.message(),
                superblock_warning.unwrap()
            )))
        }
        // A checkpoint that does not load after rolling back to the older slot: say so,
        // as its units may have been reused once the newer checkpoint was durable.
        Err(e) if e.kind() == crate::ErrorKind::Corrupt && rolled_back => Err(Error::corrupt(format!(
            "{}. That checkpoint is the older one, named by the only valid superblock slot; once a newer \
                 checkpoint is durable the older one's units may be reused, so the pool cannot be rolled back to \
                 it: restore the pool from a copy. ({})",
            e.message(),
            superblock_warning.unwrap()
        ))),
        Err(e) => Err(e),
    }
}

/// What [`batches_beyond`] makes of a later commit found intact behind the end of the
/// replay: the log was damaged, unless the open rolled back to the older superblock
/// slot, whose log is followed by the commits of the newer generation it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaterCommits {
    /// Refuse the pool (`Corrupt`).
    Refuse,
    /// Open with a warning: the loss was accepted ([`Accept::log_loss`]).
    LossAccepted,
    /// Open with a warning: they belong to the generation the rollback drops.
    RolledBack,
}

/// [`load`] after the superblock: the checkpoint `sb` names, then the log.
fn load_from(
    read: &mut ReadAt<'_>,
    sb: Superblock,
    geo: Geometry,
    later_commits: LaterCommits,
    both_copies: bool,
) -> Result<Loaded> {
    let (mut state, checkpoint_units, page_chunks, copy_warnings) = load_checkpoint(read, &sb, &geo, both_copies)?;
    if sb.version.get() < WRITTEN_FLAG_VERSION {
        // Those checkpoints do not record it: a volume that maps a unit was written (one
        // written and wholly trimmed since counts as pristine, and reads as zeros).
        for v in state.volumes.values_mut() {
            v.written = v.map.pages().next().is_some();
        }
    }
    let refcount_mismatches = if sb.incompat_features.get() & INCOMPAT_DERIVED_REFCOUNTS != 0 {
        if state.alloc.used != 0 {
            return Err(Error::corrupt("checkpoint stores refcounts, but its superblock says they are derived"));
        }
        load_derived_refcounts(&mut state)?;
        Vec::new()
    } else {
        refcount_mismatches(&state, geo.unit_count)?
    };
    // Kept up to date through replay by the table changes and the records.
    state.alloc.counts = MetaCounts::of(state.volumes.values().map(|v| (&v.map, v.own_bytes())));
    let (log, batches) = replay_log(read, &mut state, &sb, &geo)?;
    state.alloc.release_all();
    let (log_warning, highest_seq) = batches_beyond(read, &geo, sb.version.get(), &log, later_commits)?;
    Ok(Loaded {
        sb,
        geo,
        state,
        log,
        checkpoint_units,
        page_chunks,
        copy_warnings,
        refcount_mismatches,
        batches,
        superblock_warning: None,
        log_warning,
        highest_seq,
    })
}

/// What the chunks of a checkpoint build up as they are read.
struct CheckpointLoad {
    /// The stored refcounts, and the checkpoint's units as META.
    alloc: Allocator,
    volumes: BTreeMap<u64, VolumeMeta>,
    next_volume: u64,
    /// Pages by `page_id`, for the page references that follow them.
    pages: Vec<Arc<MapPage>>,
    /// The checkpoint keeps its pages in page chunks ([`INCOMPAT_PAGE_CHUNKS`]).
    paged: bool,
    /// Its page chunks, by unit, with their seq.
    page_chunks: PageChunks,
    /// Its directory names leaves, not pages ([`INCOMPAT_SHARED_LEAVES`]).
    leaved: bool,
    /// Every chunk is stored twice ([`INCOMPAT_DITTO`]).
    ditto: bool,
    /// Read both copies of each chunk, not only the first sound one.
    both_copies: bool,
    /// Copies found damaged and read around ([`Loaded::copy_warnings`]).
    warnings: Vec<String>,
    /// Where each volume's pages are: `(volume, location)`, in order.
    locs: Vec<(u64, PageLoc)>,
    /// Where each volume's leaves are: `(volume, location)`, in order.
    leaf_locs: Vec<(u64, LeafLoc)>,
    /// The checkpoint's `checkpoint_seq`.
    seq: u64,
    /// Refcount entries read.
    refcounts: u64,
    /// The end record, once read.
    end: Option<EndRec>,
}

/// Loads the checkpoint `sb` names (docs/on-disk-format.md 7.2): walks its chain of
/// chunks, checking each header and checksum, applies their records, and checks the
/// totals; then reads the page chunks it names, if it keeps its pages in them
/// ([`INCOMPAT_PAGE_CHUNKS`], 5.1), and installs each volume's pages. With ditto copies
/// ([`INCOMPAT_DITTO`]) a chunk whose first copy fails is read from its second (both
/// are read with `both_copies`). Returns the state it holds (the refcounts as stored),
/// its units (the chain's, then the page chunks', copies included), its page chunks
/// and a line for each damaged copy read around.
///
/// Errors: [`crate::ErrorKind::Corrupt`] naming the chunk (both copies) and what is
/// wrong; [`crate::ErrorKind::Io`] (a chunk stored once that cannot be read).
fn load_checkpoint(
    read: &mut ReadAt<'_>,
    sb: &Superblock,
    geo: &Geometry,
    both_copies: bool,
) -> Result<(State, Vec<u32>, PageChunks, Vec<String>)> {
    let mut c = CheckpointLoad {
        alloc: Allocator::new(geo.unit_count as usize),
        volumes: BTreeMap::new(),
        next_volume: 1,
        pages: Vec::new(),
        paged: sb.incompat_features.get() & INCOMPAT_PAGE_CHUNKS != 0,
        page_chunks: PageChunks::new(),
        leaved: sb.incompat_features.get() & INCOMPAT_SHARED_LEAVES != 0,
        ditto: super::superblock::has_ditto(sb),
        both_copies,
        warnings: Vec::new(),
        locs: Vec::new(),
        leaf_locs: Vec::new(),
        seq: sb.checkpoint_seq.get(),
        refcounts: 0,
        end: None,
    };
    if c.leaved && !c.paged {
        return Err(Error::corrupt("superblock names shared leaves without page chunks"));
    }
    if c.ditto && !c.leaved {
        return Err(Error::corrupt("superblock names ditto copies without shared leaves"));
    }
    let mut checkpoint_units = Vec::new();
    let mut unit = sb.checkpoint_unit.get();
    let mut copy = c.ditto.then(|| sb.checkpoint_copy_unit.get());
    let mut index = 0u64;
    if unit != NO_UNIT {
        while unit != NO_UNIT {
            let expected_chunks = c.end.as_ref().map_or(sb.checkpoint_chunks.get(), |e| e.chunks.get());
            let units: Vec<u64> = std::iter::once(unit).chain(copy).collect();
            if units.iter().any(|&u| u >= geo.unit_count) || index >= expected_chunks || copy == Some(unit) {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index} points at unit {unit}{}, outside the checkpoint",
                    copy.map(|c| format!(" (copy at unit {c})")).unwrap_or_default()
                )));
            }
            for &u in &units {
                match c.alloc.refcount(u as u32) {
                    0 => c.alloc.set_loaded(u as u32, META),
                    META => {
                        return Err(Error::corrupt(format!(
                            "checkpoint chunk {index} names unit {u}, which holds another chunk of the checkpoint"
                        )))
                    }
                    _ => {
                        return Err(Error::corrupt(format!(
                            "data unit {u} holds checkpoint chunk {index} but has a refcount entry"
                        )))
                    }
                }
                checkpoint_units.push(u as u32);
            }
            let ditto = c.ditto;
            let fits = |h: &ChunkHeader| {
                h.index.get() == index
                    && (!ditto || (h.next_unit.get() == NO_UNIT) == (h.next_copy_unit.get() == NO_UNIT))
            };
            let what = format!("checkpoint chunk {index}");
            let (h, payload) =
                c.read_copies(read, geo, &units, CHECKPOINT_MAGIC, sb.checkpoint_seq.get(), fits, &what)?;
            c.apply_chunk(index, &payload, geo)?;
            unit = h.next_unit.get();
            copy = c.ditto.then(|| h.next_copy_unit.get());
            index += 1;
        }
        let Some(end) = &c.end else {
            return Err(Error::corrupt("checkpoint has no end record (incomplete)"));
        };
        let pages = match (c.paged, c.leaved) {
            (_, true) => c.leaf_locs.len(),
            (true, false) => c.locs.len(),
            (false, false) => c.pages.len(),
        };
        if end.chunks.get() != index
            || sb.checkpoint_chunks.get() != index
            || end.volumes.get() != c.volumes.len() as u64
            || end.pages.get() != pages as u64
            || end.refcounts.get() != c.refcounts
        {
            return Err(Error::corrupt("checkpoint totals do not match its contents"));
        }
        if c.paged {
            c.load_pages(read, geo)?;
            checkpoint_units.extend(c.page_chunks.iter().flat_map(|(&u, pc)| pc.units(u)));
        }
    }
    // Ids are never reused: one at or above the next id would be given again to a new
    // volume, whose records would then be taken for the old one's.
    if let Some((&id, v)) = c.volumes.last_key_value().filter(|(&id, _)| id >= c.next_volume) {
        return Err(Error::corrupt(format!(
            "checkpoint gives the next volume id as {}, but volume '{}' has id {id} already",
            c.next_volume,
            crate::error::shown_name(&v.name)
        )));
    }
    let state = State { volumes: c.volumes, next_volume: c.next_volume, alloc: c.alloc, unit_size: geo.unit_size };
    Ok((state, checkpoint_units, c.page_chunks, c.warnings))
}

impl CheckpointLoad {
    /// Applies the records of chunk `index` (docs/on-disk-format.md 3.6): volumes
    /// before their pages, pages in `page_id` order, references to earlier pages.
    ///
    /// Errors: [`crate::ErrorKind::Corrupt`] naming the chunk and the record.
    fn apply_chunk(&mut self, index: u64, payload: &[u8], geo: &Geometry) -> Result<()> {
        for (kind, body) in split_records(payload)? {
            let bad = |what: &str| Error::corrupt(format!("checkpoint chunk {index}: malformed {what} record"));
            // Each format's own records only: pages in the chain, or page chunks and
            // page locations (INCOMPAT_PAGE_CHUNKS), or page chunks and leaf locations
            // (INCOMPAT_SHARED_LEAVES as well).
            let paged_kind = matches!(kind, REC_PAGE_CHUNK | REC_PAGE_CHUNK_PAIR | REC_PAGE_LOCS | REC_LEAF_LOCS);
            let whole_kind = matches!(kind, REC_PAGE | REC_PAGE_REF | REC_REFCOUNTS);
            if (self.paged && whole_kind) || (!self.paged && paged_kind) {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index}: record kind {kind} does not belong to a checkpoint whose superblock {} \
                     page chunks",
                    if self.paged { "names" } else { "names no" }
                )));
            }
            if (self.ditto && kind == REC_PAGE_CHUNK) || (!self.ditto && kind == REC_PAGE_CHUNK_PAIR) {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index}: record kind {kind} does not belong to a checkpoint whose superblock {} \
                     ditto copies",
                    if self.ditto { "names" } else { "names no" }
                )));
            }
            if (self.leaved && kind == REC_PAGE_LOCS) || (!self.leaved && kind == REC_LEAF_LOCS) {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index}: record kind {kind} does not belong to a checkpoint whose superblock {} \
                     shared leaves",
                    if self.leaved { "names" } else { "names no" }
                )));
            }
            match kind {
                REC_POOL => {
                    self.next_volume = PoolRec::read_from_bytes(body).map_err(|_| bad("pool"))?.next_volume.get()
                }
                REC_VOLUME => {
                    let Record::Volume { volume, size, created, name } = Record::decode(kind, body)? else {
                        unreachable!()
                    };
                    let flags = VolumeRec::read_from_prefix(body).map_err(|_| bad("volume"))?.0.flags.get();
                    let map = MapTable::new();
                    let snapshot = flags & VOLUME_FLAG_SNAPSHOT != 0;
                    let written = flags & VOLUME_FLAG_WRITTEN != 0;
                    let meta = VolumeMeta { name, snapshot, size, created, map, written, props: Props::default() };
                    if self.volumes.insert(volume, meta).is_some() {
                        return Err(bad("volume (repeated id)"));
                    }
                }
                REC_PROPS => {
                    let (volume, props) = Props::decode(body)?;
                    let vol = self.volumes.get_mut(&volume).ok_or_else(|| bad("properties (unknown volume)"))?;
                    if !vol.props.is_empty() || props.is_empty() {
                        return Err(bad("properties (repeated or empty)"));
                    }
                    vol.props = props;
                }
                REC_PAGE => {
                    let (h, entries) = PageRec::read_from_prefix(body).map_err(|_| bad("page"))?;
                    let n = h.entries.get() as usize;
                    let entries = <[PageEntry]>::ref_from_bytes(entries).map_err(|_| bad("page"))?;
                    if entries.len() != n || h.page_id.get() != self.pages.len() as u64 {
                        return Err(bad("page"));
                    }
                    let page = Arc::new(page_of(entries, geo).ok_or_else(|| bad("page entry"))?);
                    self.pages.push(page.clone());
                    let vol = self.volumes.get_mut(&h.volume.get()).ok_or_else(|| bad("page (unknown volume)"))?;
                    put_page(vol, h.page_index.get(), page, geo.unit_size).map_err(|_| bad("page (index)"))?;
                }
                REC_PAGE_REF => {
                    let r = PageRefRec::read_from_bytes(body).map_err(|_| bad("page ref"))?;
                    let page = self.pages.get(r.page_id.get() as usize).cloned().ok_or_else(|| bad("page ref"))?;
                    page.owners.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                    let vol = self.volumes.get_mut(&r.volume.get()).ok_or_else(|| bad("page ref (unknown volume)"))?;
                    put_page(vol, r.page_index.get(), page, geo.unit_size).map_err(|_| bad("page ref (index)"))?;
                }
                REC_REFCOUNTS => {
                    for e in <[RefcountEntry]>::ref_from_bytes(body).map_err(|_| bad("refcounts"))? {
                        let (u, r) = (e.unit.get(), e.refcount.get());
                        if u >= geo.unit_count || self.alloc.refcount(u as u32) != 0 || r == 0 || r == META {
                            return Err(Error::corrupt(format!(
                                "checkpoint refcount entry for unit {u} is out of range, repeated or invalid ({r})"
                            )));
                        }
                        self.alloc.set_loaded(u as u32, r);
                        self.refcounts += 1;
                    }
                }
                REC_PAGE_CHUNK => {
                    let r = PageChunkRec::read_from_bytes(body).map_err(|_| bad("page chunk"))?;
                    let (unit, seq) = (r.unit.get(), r.seq.get());
                    if unit >= geo.unit_count || seq > self.seq || self.alloc.refcount(unit as u32) != 0 {
                        return Err(Error::corrupt(format!(
                            "checkpoint chunk {index}: page chunk at unit {unit} (seq {seq}) is out of range, \
                             repeated, or later than the checkpoint"
                        )));
                    }
                    self.alloc.set_loaded(unit as u32, META);
                    self.page_chunks.insert(unit as u32, PageChunk { seq, copy: None, whole: false });
                }
                REC_PAGE_CHUNK_PAIR => {
                    let r = PageChunkPairRec::read_from_bytes(body).map_err(|_| bad("page chunk pair"))?;
                    let (unit, seq, copy) = (r.unit.get(), r.seq.get(), r.copy.get());
                    let free = |u: u64| u < geo.unit_count && self.alloc.refcount(u as u32) == 0;
                    if !free(unit) || !free(copy) || unit == copy || seq > self.seq {
                        return Err(Error::corrupt(format!(
                            "checkpoint chunk {index}: page chunk at unit {unit} (copy at unit {copy}, seq {seq}) is \
                             out of range, repeated, or later than the checkpoint"
                        )));
                    }
                    self.alloc.set_loaded(unit as u32, META);
                    self.alloc.set_loaded(copy as u32, META);
                    self.page_chunks.insert(unit as u32, PageChunk { seq, copy: Some(copy as u32), whole: true });
                }
                REC_PAGE_LOCS => {
                    let (h, locs) = PageLocsRec::read_from_prefix(body).map_err(|_| bad("page locations"))?;
                    let locs = <[PageLoc]>::ref_from_bytes(locs).map_err(|_| bad("page locations"))?;
                    if locs.is_empty() || locs.len() > MAX_PAGE_LOCS {
                        return Err(bad("page locations"));
                    }
                    let volume = h.volume.get();
                    if !self.volumes.contains_key(&volume) {
                        return Err(bad("page locations (unknown volume)"));
                    }
                    self.locs.extend(locs.iter().map(|l| (volume, l.clone())));
                }
                REC_LEAF_LOCS => {
                    let (h, locs) = LeafLocsRec::read_from_prefix(body).map_err(|_| bad("leaf locations"))?;
                    let locs = <[LeafLoc]>::ref_from_bytes(locs).map_err(|_| bad("leaf locations"))?;
                    if locs.is_empty() || locs.len() > MAX_PAGE_LOCS {
                        return Err(bad("leaf locations"));
                    }
                    let volume = h.volume.get();
                    if !self.volumes.contains_key(&volume) {
                        return Err(bad("leaf locations (unknown volume)"));
                    }
                    self.leaf_locs.extend(locs.iter().map(|l| (volume, l.clone())));
                }
                REC_END => {
                    let e = EndRec::read_from_bytes(body).map_err(|_| bad("end"))?;
                    self.end = Some(e.clone());
                }
                k => return Err(Error::corrupt(format!("checkpoint chunk {index}: unknown record kind {k}"))),
            }
        }
        Ok(())
    }
}

impl CheckpointLoad {
    /// Reads every page chunk the directory named (docs/on-disk-format.md 7.2),
    /// checking each header and checksum, and installs each volume's pages from them,
    /// through the leaves the directory names ([`INCOMPAT_SHARED_LEAVES`]) or directly
    /// (a checkpoint without it). A leaf named by several locations is one leaf with
    /// that many owners, a page named by several leaves (or, without leaves, by several
    /// locations) one page with that many owners, and each knows where it is stored,
    /// so the next checkpoint keeps it there.
    ///
    /// Errors: [`crate::ErrorKind::Corrupt`] naming the chunk or the location;
    /// [`crate::ErrorKind::Io`].
    fn load_pages(&mut self, read: &mut ReadAt<'_>, geo: &Geometry) -> Result<()> {
        let mut bodies: HashMap<PageStored, Arc<MapPage>> = Default::default();
        let mut leaf_bodies: HashMap<PageStored, Vec<PageLoc>> = Default::default();
        let chunks: Vec<(u32, PageChunk)> = self.page_chunks.iter().map(|(&u, &c)| (u, c)).collect();
        for (unit, pc) in chunks {
            let u = u64::from(unit);
            let seq = pc.seq;
            let units: Vec<u64> = pc.units(unit).map(u64::from).collect();
            let ditto = self.ditto;
            let fits = |h: &ChunkHeader| h.next_unit.get() == NO_UNIT && (!ditto || h.next_copy_unit.get() == NO_UNIT);
            let what = format!("page chunk of seq {seq}");
            let before = self.warnings.len();
            let (_, payload) = self.read_copies(read, geo, &units, PAGE_CHUNK_MAGIC, seq, fits, &what)?;
            if self.warnings.len() > before {
                // Kept by no checkpoint: the next writes what it holds again.
                self.page_chunks.get_mut(&unit).expect("listed").whole = false;
            }
            let bad = |what: &str| Error::corrupt(format!("page chunk at data unit {u}: malformed {what} record"));
            let mut offset = 0usize;
            let mut kinds = (false, false);
            for (kind, body) in split_records(&payload)? {
                let at = PageStored { unit, offset: offset as u32 };
                match kind {
                    REC_PAGE_BODY => {
                        let (h, entries) = PageBodyRec::read_from_prefix(body).map_err(|_| bad("page"))?;
                        let n = h.entries.get() as usize;
                        let entries = <[PageEntry]>::ref_from_bytes(entries).map_err(|_| bad("page"))?;
                        if entries.len() != n || n == 0 || n > PAGE_ENTRIES || h.pad.get() != 0 {
                            return Err(bad("page"));
                        }
                        let page = page_of(entries, geo).ok_or_else(|| bad("page"))?;
                        page.set_stored(at);
                        bodies.insert(at, Arc::new(page));
                        kinds.0 = true;
                    }
                    REC_LEAF_BODY if self.leaved => {
                        let (h, locs) = LeafBodyRec::read_from_prefix(body).map_err(|_| bad("leaf"))?;
                        let n = h.pages.get() as usize;
                        let locs = <[PageLoc]>::ref_from_bytes(locs).map_err(|_| bad("leaf"))?;
                        let ascending = locs.windows(2).all(|w| w[0].page_index.get() < w[1].page_index.get());
                        let in_leaf = locs.last().is_some_and(|l| (l.page_index.get() as usize) < LEAF_PAGES);
                        if locs.len() != n || n == 0 || !ascending || !in_leaf || h.pad.get() != 0 {
                            return Err(bad("leaf"));
                        }
                        leaf_bodies.insert(at, locs.to_vec());
                        kinds.1 = true;
                    }
                    _ => return Err(Error::corrupt(format!("page chunk at data unit {u}: record kind {kind}"))),
                }
                offset += size_of::<RecordHeader>() + body.len();
            }
            if kinds == (true, true) {
                return Err(Error::corrupt(format!("page chunk at data unit {u} holds both pages and leaves")));
            }
        }
        let mut used: HashSet<PageStored> = Default::default();
        // One more holder of the page at `at`: its first takes the owner it was made with.
        let mut take = |at: PageStored, what: &dyn Fn() -> String| -> Result<Arc<MapPage>> {
            let page = bodies.get(&at).cloned().ok_or_else(|| {
                Error::corrupt(format!(
                    "checkpoint: {} is at unit {} offset {}, where no page chunk holds a page",
                    what(),
                    at.unit,
                    at.offset
                ))
            })?;
            if !used.insert(at) {
                page.owners.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
            Ok(page)
        };
        for (volume, l) in std::mem::take(&mut self.locs) {
            let at = PageStored { unit: l.unit.get(), offset: l.offset.get() };
            let index = l.page_index.get();
            let page = take(at, &|| format!("page {index} of volume {volume}"))?;
            let vol = self.volumes.get_mut(&volume).expect("checked when read");
            put_page(vol, u64::from(index), page, geo.unit_size).map_err(|_| {
                Error::corrupt(format!("checkpoint: page {index} of volume {volume} is past its end or given twice"))
            })?;
        }
        let mut leaves: HashMap<PageStored, Arc<Leaf>> = Default::default();
        for (volume, l) in std::mem::take(&mut self.leaf_locs) {
            let at = PageStored { unit: l.unit.get(), offset: l.offset.get() };
            let index = l.leaf_index.get();
            let leaf = match leaves.get(&at) {
                Some(leaf) => {
                    leaf.owners.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                    leaf.clone()
                }
                None => {
                    let locs = leaf_bodies.get(&at).ok_or_else(|| {
                        Error::corrupt(format!(
                            "checkpoint: leaf {index} of volume {volume} is at unit {} offset {}, where no page \
                             chunk holds a leaf",
                            at.unit, at.offset
                        ))
                    })?;
                    let mut leaf = Leaf::new();
                    for p in locs {
                        let i = p.page_index.get();
                        let pat = PageStored { unit: p.unit.get(), offset: p.offset.get() };
                        leaf.put(i as usize, take(pat, &|| format!("page {i} of the leaf at {at:?}"))?);
                    }
                    leaf.set_stored(at);
                    let leaf = Arc::new(leaf);
                    leaves.insert(at, leaf.clone());
                    leaf
                }
            };
            let vol = self.volumes.get_mut(&volume).expect("checked when read");
            put_leaf(vol, u64::from(index), leaf, geo.unit_size).map_err(|_| {
                Error::corrupt(format!("checkpoint: leaf {index} of volume {volume} is past its end or given twice"))
            })?;
        }
        Ok(())
    }
}

impl CheckpointLoad {
    /// Reads a chunk stored at `units` (its unit, then its copy's with ditto copies):
    /// the first copy that is sound (`fits` its header, and [`read_chunk`] takes it),
    /// or every copy with `both_copies`. A damaged copy read around adds a line to the
    /// warnings naming it and the copy read. `what` names the chunk in messages.
    ///
    /// Errors: [`crate::ErrorKind::Corrupt`] when no copy is sound, naming each;
    /// [`crate::ErrorKind::Io`] when no copy can be read (each read failed), naming
    /// each.
    #[allow(clippy::too_many_arguments)]
    fn read_copies(
        &mut self,
        read: &mut ReadAt<'_>,
        geo: &Geometry,
        units: &[u64],
        magic: u32,
        seq: u64,
        fits: impl Fn(&ChunkHeader) -> bool,
        what: &str,
    ) -> Result<(ChunkHeader, Vec<u8>)> {
        let mut sound: Option<(ChunkHeader, Vec<u8>, u64)> = None;
        // Each copy not read: its unit, its problem, and whether its read failed.
        let mut damaged: Vec<(u64, String, bool)> = Vec::new();
        for &u in units {
            if sound.is_some() && !self.both_copies {
                break;
            }
            match read_chunk(read, geo, u, magic, seq) {
                Ok(Some((h, payload))) if fits(&h) => {
                    if sound.is_none() {
                        sound = Some((h, payload, u));
                    }
                }
                Ok(_) => damaged.push((u, "fails its header or checksum".to_owned(), false)),
                Err(e) if units.len() == 1 => return Err(e),
                Err(e) => damaged.push((u, format!("cannot be read ({e})"), true)),
            }
        }
        let at = |u: u64| format!("data unit {u} (byte offset {})", geo.unit_offset(u));
        let Some((h, payload, good)) = sound else {
            let each: Vec<String> = damaged.iter().map(|(u, p, _)| format!("the copy at {} {p}", at(*u))).collect();
            let message = match &damaged[..] {
                [(u, problem, _)] => format!("{what} at {} {problem}", at(*u)),
                _ => format!("{what}: no copy is sound: {}", each.join(", and ")),
            };
            // Reads that failed are the device's fault, not the pool's: say so (a
            // retry, or another path to the device, may read it).
            return Err(if damaged.iter().all(|d| d.2) {
                Error::new(crate::ErrorKind::Io, message)
            } else {
                Error::corrupt(message)
            });
        };
        for (u, problem, _) in damaged {
            self.warnings.push(format!(
                "{what}: the copy at {} {problem}; the copy at data unit {good} was read, and the next checkpoint \
                 writes the chunk again",
                at(u)
            ));
        }
        Ok((h, payload))
    }
}

/// Reads the chunk in data unit `unit` whole: its header and payload, if the header has
/// `magic`, the pool's UUID, `checkpoint_seq` equal to `seq`, a payload that fits the
/// unit and a matching CRC; `None` otherwise (the caller names the chunk).
///
/// Errors: [`crate::ErrorKind::Io`].
fn read_chunk(
    read: &mut ReadAt<'_>,
    geo: &Geometry,
    unit: u64,
    magic: u32,
    seq: u64,
) -> Result<Option<(ChunkHeader, Vec<u8>)>> {
    let bytes = read(geo.unit_offset(unit), geo.unit_size as usize).map_err(|e| Error::io("read checkpoint", e))?;
    let (h, rest) = ChunkHeader::read_from_prefix(&bytes).expect("unit holds a header");
    let plen = h.payload_len.get() as usize;
    let mut hz = h.clone();
    hz.crc = 0.into();
    let ok = h.magic.get() == magic
        && plen <= rest.len()
        && h.pool_uuid == geo.uuid
        && h.checkpoint_seq.get() == seq
        && crc32c::crc32c_append(crc(hz.as_bytes()), &rest[..plen]) == h.crc.get();
    Ok(ok.then(|| (h, rest[..plen].to_vec())))
}

/// A page of the `entries` of a page record, or `None` if an entry repeats an index,
/// lies outside the page, or names a unit past the pool's end.
fn page_of(entries: &[PageEntry], geo: &Geometry) -> Option<MapPage> {
    let mut page = MapPage::new();
    page.mapped = entries.len() as u32;
    for e in entries {
        let i = e.index.get() as usize;
        let punit = u32::try_from(e.punit.get()).ok()?;
        if i >= PAGE_ENTRIES || page.entries[i].is_mapped() || u64::from(punit) >= geo.unit_count {
            return None;
        }
        page.entries[i] = Entry { punit, bitmap: e.bitmap.get() };
    }
    Some(page)
}

/// Gives every unit of a checkpoint that stores no refcounts
/// ([`INCOMPAT_DERIVED_REFCOUNTS`]) the refcount its mappings imply: the number of
/// distinct pages that map it (docs/on-disk-format.md 7.3). Walks every page once.
///
/// Errors: [`crate::ErrorKind::Corrupt`] when a mapped unit is part of the checkpoint.
fn load_derived_refcounts(state: &mut State) -> Result<()> {
    let derived = derive_refcounts(state.volumes.values().map(|v| &v.map), state.alloc.unit_count() as usize);
    for (u, r) in derived.nonzero_refcounts() {
        if state.alloc.refcount(u) == META {
            return Err(Error::corrupt(format!("data unit {u} is both mapped and part of the checkpoint")));
        }
        state.alloc.set_loaded(u, r);
    }
    Ok(())
}

/// Checkpoint refcounts that differ from those its mappings imply (docs/on-disk-format.md
/// 7.3): `(unit, stored, derived)`, a unit's derived refcount being the number of
/// distinct pages that map it. Reads every entry of both tables; pages never written
/// stay non-resident.
///
/// Errors: [`crate::ErrorKind::Corrupt`] when a mapped unit is part of the checkpoint.
fn refcount_mismatches(state: &State, units: u64) -> Result<Vec<(u64, u32, u32)>> {
    let derived = derive_refcounts(state.volumes.values().map(|v| &v.map), units as usize);
    let mut mismatches = Vec::new();
    for u in 0..units as u32 {
        let derived = derived.refcount(u);
        let stored = match state.alloc.refcount(u) {
            META if derived > 0 => {
                return Err(Error::corrupt(format!("data unit {u} is both mapped and part of the checkpoint")));
            }
            META => 0,
            r => r,
        };
        if stored != derived {
            mismatches.push((u as u64, stored, derived));
        }
    }
    Ok(mismatches)
}

/// Replays the log from the superblock's head onto `state` (docs/on-disk-format.md 4.5,
/// 7.4), batch by batch in sequence, to the first missing or invalid one. Returns the
/// log's cursor after the last batch replayed, and how many were.
///
/// Errors: [`crate::ErrorKind::Corrupt`] for a batch out of its commit's order or a
/// record that does not apply; [`crate::ErrorKind::Io`].
fn replay_log(read: &mut ReadAt<'_>, state: &mut State, sb: &Superblock, geo: &Geometry) -> Result<(LogCursor, u64)> {
    let version = sb.version.get();
    let mut log = LogCursor { head: sb.log_head.get(), pos: sb.log_head.get(), seq: sb.checkpoint_seq.get() };
    let mut batches = 0;
    // The commit index the next batch may carry besides 0 (a new commit); the first
    // batch after a checkpoint begins a commit.
    let mut next_index = 0u16;
    loop {
        let found = read_batch(read, geo, version, log.pos, log.seq + 1)?.map(|b| (log.pos, b));
        let found = match found {
            Some(f) => Some(f),
            None if !log.pos.is_multiple_of(geo.log_size) => {
                let next_lap = log.pos + (geo.log_size - log.pos % geo.log_size);
                read_batch(read, geo, version, next_lap, log.seq + 1)?.map(|b| (next_lap, b))
            }
            None => None,
        };
        let Some((at, batch)) = found else { break };
        if at + batch.blocks * BLOCK_SIZE - log.head > geo.log_size {
            break; // would overlap the start of the live log: not a batch of this lap
        }
        if batch.commit_index != 0 && batch.commit_index != next_index {
            return Err(Error::corrupt(format!(
                "log batch {} says it is batch {} of its commit, but {}",
                log.seq + 1,
                batch.commit_index,
                if batches == 0 {
                    "it is the first batch after the checkpoint".to_string()
                } else {
                    format!("the batch before it was batch {} of its commit", next_index.wrapping_sub(1))
                }
            )));
        }
        for (kind, body) in split_records(&batch.payload)? {
            state.apply(Record::decode(kind, body)?)?;
        }
        batches += 1;
        next_index = batch.commit_index.wrapping_add(1);
        log.seq += 1;
        log.pos = at + batch.blocks * BLOCK_SIZE;
    }
    Ok((log, batches))
}

/// Looks through the whole log region for valid batches (magic, pool, checksum) whose
/// sequence number is past the last one replayed, `log.seq`: the replay stopped at a
/// damaged or missing batch (`log.seq + 1`) with such batches behind it.
///
/// A crash while a commit writes its batches (all at once) can leave a later batch of
/// that never acknowledged commit complete behind a torn one: that is the normal end
/// of a log and says nothing. But a commit's batches are written only once every batch
/// of the commit before it is durable, so a valid batch whose commit began after the
/// missing one (`seq - commit_index > log.seq + 1`) proves that the missing batch was
/// durable and has been damaged since, and every commit from it on, acknowledged
/// flushes among them, would be lost. From format version 3 on that is corruption
/// (`Err`, kind `Corrupt`, naming the sequence numbers), unless `later_commits` says
/// otherwise: then a warning saying what was dropped. In older pools, whose
/// batches do not say where their commit began, the two cannot be told apart, and any
/// valid later batch is returned as a warning instead. Also returns the highest
/// sequence number of any valid batch found (at least `log.seq`), at least `log.seq + 1`
/// when the header of a batch that is not valid lies past the end (a torn batch).
/// Reads the log once, a MiB at a time.
fn batches_beyond(
    read: &mut ReadAt<'_>,
    geo: &Geometry,
    version: u32,
    log: &LogCursor,
    later_commits: LaterCommits,
) -> Result<(Option<String>, u64)> {
    const PIECE: u64 = 1 << 20;
    let missing = log.seq + 1;
    let (mut found, mut last) = (0u64, log.seq);
    // A batch header past the end whose batch is not valid (torn): nothing to replay,
    // but the open must not give its seq to a new batch (4.3, 7.6).
    let mut torn = false;
    // The earliest commit start found past the missing batch, and its batch's sequence.
    let mut later_commit: Option<(u64, u64)> = None;
    let mut off = 0;
    while off < geo.log_size {
        let len = PIECE.min(geo.log_size - off);
        let piece = read(geo.log_offset + off, len as usize).map_err(|e| Error::io("read log", e))?;
        for (i, block) in piece.chunks_exact(BLOCK_SIZE as usize).enumerate() {
            let (h, _) = BatchHeader::read_from_prefix(block).expect("block holds a header");
            if h.magic.get() != LOG_MAGIC || h.pool_tag.get() != geo.pool_tag() || h.seq.get() <= log.seq {
                continue;
            }
            let pos = off + i as u64 * BLOCK_SIZE;
            let seq = h.seq.get();
            if let Some(batch) = read_batch(read, geo, version, pos, seq)? {
                if seq > MAX_SEQ {
                    return Err(Error::corrupt(format!(
                        "log batch at log offset {pos} has sequence number {seq}, out of range"
                    )));
                }
                found += 1;
                last = last.max(seq);
                let start = seq.saturating_sub(u64::from(batch.commit_index));
                if start > missing && later_commit.is_none_or(|(s, _)| start < s) {
                    later_commit = Some((start, seq));
                }
            } else {
                torn = true;
            }
        }
        off += len;
    }
    if version >= COMMIT_INDEX_VERSION {
        let damage = |start| {
            format!(
                "log batch {missing} is damaged or missing, but the commit that begins at batch {start} lies \
                 intact behind it (valid batches up to {last}), and a commit is written only once the one \
                 before it is durable: the log was damaged after the fact, and the commits from batch {missing} \
                 on (acknowledged flushes among them) cannot be replayed"
            )
        };
        let warning = match (later_commit, later_commits) {
            (Some((start, _)), LaterCommits::RolledBack) => Some(format!(
                "the log after the checkpoint rolled back to ends at batch {}; the valid batches behind it \
                 (up to {last}, from batch {start} a later commit) were written after it, by the generation the \
                 rollback drops (or the older log was damaged there), and are not replayed",
                log.seq
            )),
            (Some((start, _)), LaterCommits::LossAccepted) => Some(format!(
                "opened as asked (accept log loss) with the metadata as it was before log batch {missing}; the \
                 commits from that batch on (valid batches up to {last}) are dropped: blocks they mapped read as \
                 zeros again, volumes and snapshots they created, deleted or resized are as before them, and the \
                 space they allocated is free again. Data is not rolled back: overwrites of blocks mapped before \
                 them stay as written, and data units they freed may have been reused since, so ranges that \
                 mapped them before may now read data written later, by any volume. (Why: {})",
                damage(start)
            )),
            (Some((start, _)), LaterCommits::Refuse) => {
                return Err(Error::corrupt(format!(
                    "{}. The pool is not opened and is left as it is. Restore it from a copy, or, if losing those \
                 commits is acceptable, open it with the log loss accepted (`ferrovol serve --accept-log-loss`), \
                 which keeps the state before batch {missing}",
                    damage(start)
                )))
            }
            // Later batches of the commit the missing batch belongs to: a torn commit,
            // never acknowledged.
            (None, _) => None,
        };
        return Ok((warning, beyond(last, torn, log.seq)));
    }
    let warning = (found > 0).then(|| {
        format!(
            "the log replay stopped at a damaged or missing batch (sequence {missing}), and {found} valid batch(es) \
             with later sequence numbers (up to {last}) lie beyond it and were not replayed. If the server \
             was stopped while committing, they belong to that unacknowledged commit and nothing \
             acknowledged is lost; otherwise the log was damaged and the commits from sequence {missing} on \
             (acknowledged flushes among them) were lost. (This pool's format version {version} does not \
             record where a commit begins; from its next open on it is version {FORMAT_VERSION}, which does.)"
        )
    });
    Ok((warning, beyond(last, torn, log.seq)))
}

/// What [`batches_beyond`] reports as the highest sequence number: that of the last
/// valid batch (`last`, at least the last replayed, `replayed`), or, when a torn
/// batch's header lies past the end, at least one past it (so that the open jumps past
/// it).
fn beyond(last: u64, torn: bool, replayed: u64) -> u64 {
    match torn {
        true => last.max(replayed + 1),
        false => last,
    }
}

/// Installs `leaf` at leaf index `index` of `vol`; an error if a page of it lies past
/// the volume's end or the volume has that leaf already.
fn put_leaf(vol: &mut VolumeMeta, index: u64, leaf: Arc<Leaf>, unit_size: u64) -> std::result::Result<(), ()> {
    let pages = vol.size.div_ceil(unit_size).div_ceil(PAGE_ENTRIES as u64);
    let last = leaf.pages().last().map_or(0, |(i, _)| i as u64);
    if index.checked_mul(LEAF_PAGES as u64).map(|first| first + last).is_none_or(|p| p >= pages)
        || !vol.map.put_leaf(index as usize, leaf)
    {
        return Err(());
    }
    Ok(())
}

fn put_page(vol: &mut VolumeMeta, index: u64, page: Arc<MapPage>, unit_size: u64) -> std::result::Result<(), ()> {
    let pages = vol.size.div_ceil(unit_size).div_ceil(PAGE_ENTRIES as u64);
    if index >= pages || vol.map.page(index as usize).is_some() {
        return Err(());
    }
    vol.map.put_page(index as usize, page);
    Ok(())
}

/// A valid log batch read by [`read_batch`].
struct Batch {
    /// Blocks it occupies, header included.
    blocks: u64,
    /// Its [`BatchHeader::commit_index`] (0 before format version 3).
    commit_index: u16,
    /// Its records.
    payload: Vec<u8>,
}

/// Reads the batch at absolute log position `pos` if it is valid and has sequence
/// number `seq` (section 4.5 of docs/on-disk-format.md); `version` is the pool's format
/// version (before version 3 the commit index must be 0).
fn read_batch(read: &mut ReadAt<'_>, geo: &Geometry, version: u32, pos: u64, seq: u64) -> Result<Option<Batch>> {
    let rel = pos % geo.log_size;
    let first = read(geo.log_offset + rel, BLOCK_SIZE as usize).map_err(|e| Error::io("read log", e))?;
    let (h, _) = BatchHeader::read_from_prefix(&first).expect("block holds a header");
    let blocks = u64::from(h.blocks.get());
    let plen = h.payload_len.get() as usize;
    let commit_index = h.commit_index.get();
    if h.magic.get() != LOG_MAGIC
        || h.seq.get() != seq
        || h.pool_tag.get() != geo.pool_tag()
        || blocks == 0
        || blocks * BLOCK_SIZE > MAX_BATCH_BYTES as u64
        || rel + blocks * BLOCK_SIZE > geo.log_size
        || size_of::<BatchHeader>() + plen > (blocks * BLOCK_SIZE) as usize
        || (version < COMMIT_INDEX_VERSION && commit_index != 0)
    {
        return Ok(None);
    }
    let all = if blocks == 1 {
        first
    } else {
        read(geo.log_offset + rel, (blocks * BLOCK_SIZE) as usize).map_err(|e| Error::io("read log", e))?
    };
    let payload = &all[size_of::<BatchHeader>()..size_of::<BatchHeader>() + plen];
    let mut hz = h.clone();
    hz.crc = 0.into();
    if crc32c::crc32c_append(crc(hz.as_bytes()), payload) != h.crc.get() {
        return Ok(None); // torn or never completed: the end of the log
    }
    Ok(Some(Batch { blocks, commit_index, payload: payload.to_vec() }))
}

/// A reader of `len` bytes at byte `off` of `file` for [`load`]: plain reads.
pub(crate) fn read_at_file(file: &std::fs::File) -> impl FnMut(u64, usize) -> std::io::Result<Vec<u8>> + '_ {
    use std::os::unix::fs::FileExt;
    move |off, len| {
        let mut v = vec![0u8; len];
        file.read_exact_at(&mut v, off)?;
        Ok(v)
    }
}
