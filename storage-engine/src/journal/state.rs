//! The whole metadata of a pool as a plain value: [`State`] (volumes and their mapping
//! tables, the allocator), [`State::apply`] (replay of one record), the checkpoint's
//! encoding into chunk payloads ([`State::encode_checkpoint`]) and the bound on its
//! size ([`checkpoint_bytes_bound`], [`checkpoint_units_bound`]), and
//! [`derive_refcounts`]. Not here: writing chunks (the store's checkpoint), loading them
//! (recovery.rs).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use zerocopy::IntoBytes;

use super::records::{push_record, Record};
use crate::error::{Error, Result};
use crate::format::*;
use crate::meta::{Allocator, Entry, Leaf, MapPage, MapTable, MetaCounts, PageStored, LEAF_PAGES, META};
use crate::props::Props;

/// Metadata of one volume as a plain value.
#[derive(Clone)]
pub(crate) struct VolumeMeta {
    pub name: String,
    /// A read-only snapshot.
    pub snapshot: bool,
    pub size: u64,
    pub created: u32,
    pub map: MapTable,
    /// Not pristine ([`VOLUME_FLAG_WRITTEN`]).
    pub written: bool,
    pub props: Props,
}

impl VolumeMeta {
    /// Bytes of its variable parts in a checkpoint: name and property record
    /// ([`MetaCounts::volume_bytes`]).
    pub fn own_bytes(&self) -> u64 {
        self.props.volume_bytes(&self.name)
    }
}

/// The whole metadata of a pool: what a checkpoint holds and the log updates.
pub(crate) struct State {
    pub volumes: BTreeMap<u64, VolumeMeta>,
    pub next_volume: u64,
    pub alloc: Allocator,
    pub unit_size: u64,
}

impl State {
    pub fn units_of(&self, size: u64) -> u64 {
        size.div_ceil(self.unit_size)
    }

    fn check_unit(&self, punit: u32) -> Result<()> {
        if u64::from(punit) >= self.alloc.unit_count() {
            return Err(Error::corrupt(format!(
                "mapping names data unit {punit} past the pool's {} units",
                self.alloc.unit_count()
            )));
        }
        if self.alloc.refcount(punit) == META {
            return Err(Error::corrupt(format!("mapping names data unit {punit}, which holds checkpoint metadata")));
        }
        Ok(())
    }

    /// Applies one replayed log record, keeping refcounts in step with mappings.
    pub fn apply(&mut self, rec: Record) -> Result<()> {
        match rec {
            Record::Map { volume, lunit, punit, bitmap } => {
                self.check_unit(punit)?;
                let vol = self
                    .volumes
                    .get_mut(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log maps unit of unknown volume {volume}")))?;
                if lunit >= vol.size.div_ceil(self.unit_size) {
                    return Err(Error::corrupt(format!(
                        "log maps logical unit {lunit} past the end of volume {volume}"
                    )));
                }
                vol.written = true;
                let old = vol.map.set(lunit, Entry { punit, bitmap }, &mut self.alloc);
                if old.punit != punit {
                    self.alloc.incref(punit);
                    if old.is_mapped() {
                        self.alloc.decref(old.punit);
                    }
                }
            }
            Record::Unmap { volume, lunit } => {
                let vol = self
                    .volumes
                    .get_mut(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log unmaps unit of unknown volume {volume}")))?;
                if lunit < vol.size.div_ceil(self.unit_size) {
                    let old = vol.map.set(lunit, Entry::EMPTY, &mut self.alloc);
                    if old.is_mapped() {
                        self.alloc.decref(old.punit);
                    }
                }
            }
            Record::Volume { volume, size, created, name } => {
                if self.volumes.contains_key(&volume) {
                    return Err(Error::corrupt(format!("volume id {volume} created twice")));
                }
                let map = MapTable::new();
                self.alloc.counts.volumes += 1;
                self.alloc.counts.volume_bytes += name.len() as u64;
                let meta =
                    VolumeMeta { name, snapshot: false, size, created, map, written: false, props: Props::default() };
                self.volumes.insert(volume, meta);
                self.next_volume = self.next_volume.max(volume + 1);
            }
            Record::Share { source, target, size, created, snapshot, name } => {
                if self.volumes.contains_key(&target) {
                    return Err(Error::corrupt(format!("volume id {target} created twice")));
                }
                let src = self
                    .volumes
                    .get(&source)
                    .ok_or_else(|| Error::corrupt(format!("log shares unknown volume {source}")))?;
                if size != src.size || (snapshot && src.snapshot) {
                    return Err(Error::corrupt(format!(
                        "log shares volume {source} with a different size or as a snapshot of a snapshot"
                    )));
                }
                // A snapshot or clone is pristine when its source was (catalogue.rs).
                let written = src.written;
                let map = src.map.share(&mut self.alloc);
                self.alloc.counts.volumes += 1;
                self.alloc.counts.volume_bytes += name.len() as u64;
                let meta = VolumeMeta { name, snapshot, size, created, map, written, props: Props::default() };
                self.volumes.insert(target, meta);
                self.next_volume = self.next_volume.max(target + 1);
            }
            Record::VolumeDelete { volume } => {
                let mut vol = self
                    .volumes
                    .remove(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log deletes unknown volume {volume}")))?;
                vol.map.release_all(&mut self.alloc);
                self.alloc.counts.volumes -= 1;
                self.alloc.counts.volume_bytes -= vol.own_bytes();
            }
            Record::VolumeResize { volume, size } => {
                let vol = self
                    .volumes
                    .get_mut(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log resizes unknown volume {volume}")))?;
                if size < vol.size {
                    return Err(Error::corrupt(format!("log shrinks volume {volume}")));
                }
                vol.size = size;
            }
            Record::Props { volume, props } => {
                let vol = self
                    .volumes
                    .get_mut(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log sets properties of unknown volume {volume}")))?;
                self.alloc.counts.volume_bytes -= vol.props.record_bytes();
                self.alloc.counts.volume_bytes += props.record_bytes();
                vol.props = props;
            }
        }
        Ok(())
    }

    /// Decides what a checkpoint of this state writes, given the page chunks of the
    /// current checkpoint (`chunks`) and the bytes a chunk holds at least when full
    /// (`fill`, [`chunk_fill`]). A page chunk holds pages or leaves, never both. Every
    /// distinct page stored in one of `chunks` counts as live there; a chunk holding
    /// less than `fill / 2` live bytes is cleaned (its live pages are written again)
    /// or, holding none, dropped; the others are kept, with the pages they hold. Pages
    /// stored nowhere (new or changed since) are written. Then the same for leaves,
    /// where a leaf counts as live only if it is stored and none of its pages is
    /// written again (a page that moves changes the leaf that names it). When there is
    /// nothing of a kind to write and the chunks holding live ones of that kind are no
    /// more than the half-live rule allows for them, nothing of that kind is cleaned
    /// (only chunks left empty are dropped), so a checkpoint with nothing changed
    /// writes its directory alone. So every chunk kept by a checkpoint that writes
    /// records of its kind is at least half live, and the bytes written are at most
    /// the changed pages and leaves plus as many again moved out of cleaned chunks,
    /// whose dead half earlier changes made (docs/on-disk-format.md 5.4).
    pub fn plan_checkpoint(&self, chunks: &PageChunks, fill: u64) -> CheckpointPlan {
        let mut seen_leaves: HashSet<*const Leaf> = Default::default();
        let mut seen: HashSet<*const MapPage> = Default::default();
        let mut leaves: Vec<Arc<Leaf>> = Vec::new();
        let mut dirty = Vec::new();
        let mut live: BTreeMap<u32, (u64, Vec<Arc<MapPage>>)> = BTreeMap::new();
        for v in self.volumes.values() {
            for (_, leaf) in v.map.leaves() {
                if !seen_leaves.insert(Arc::as_ptr(leaf)) {
                    continue;
                }
                leaves.push(leaf.clone());
                for (_, page) in leaf.pages() {
                    if !seen.insert(Arc::as_ptr(page)) {
                        continue;
                    }
                    match page.stored().filter(|at| chunks.contains_key(&at.unit)) {
                        Some(at) => {
                            let l = live.entry(at.unit).or_default();
                            l.0 += page_body_bytes(page.mapped);
                            l.1.push(page.clone());
                        }
                        None => dirty.push(page.clone()),
                    }
                }
            }
        }
        let mut kept = PageChunks::new();
        let mut dropped = Vec::new();
        let cleaned = keep_or_clean(live, &mut dirty, chunks, fill, &mut kept);
        // Leaves: written again when stored nowhere, or when a page they name is.
        let moved: HashSet<*const MapPage> = dirty.iter().map(Arc::as_ptr).collect();
        let mut dirty_leaves = Vec::new();
        let mut live: BTreeMap<u32, (u64, Vec<Arc<Leaf>>)> = BTreeMap::new();
        for leaf in leaves {
            // In a chunk of the current checkpoint that holds no live page.
            let stored = leaf.stored().filter(|at| {
                chunks.contains_key(&at.unit) && !kept.contains_key(&at.unit) && !cleaned.contains(&at.unit)
            });
            match stored {
                Some(at) if !leaf.pages().any(|(_, p)| moved.contains(&Arc::as_ptr(p))) => {
                    let l = live.entry(at.unit).or_default();
                    l.0 += leaf_body_bytes(leaf.present());
                    l.1.push(leaf);
                }
                _ => dirty_leaves.push(leaf),
            }
        }
        keep_or_clean(live, &mut dirty_leaves, chunks, fill, &mut kept);
        for (&unit, c) in chunks {
            if !kept.contains_key(&unit) {
                dropped.extend(c.units(unit));
            }
        }
        CheckpointPlan { dirty, dirty_leaves, kept, dropped }
    }

    /// Serialises the checkpoint's directory (docs/on-disk-format.md 5.2) into chunk
    /// payloads of at most `chunk_payload` bytes, handing each to `emit` in order with
    /// whether it is the last: the pool record, the page chunks `chunks` (unit and
    /// seq), and each volume with its properties and where its leaves are, which every
    /// leaf must know by now ([`Leaf::stored`], set by [`encode_bodies`]).
    /// Returns the number of chunks; stops at the first error `emit` returns.
    pub fn encode_directory(&self, chunks: &PageChunks, chunk_payload: usize, emit: &mut ChunkSink<'_>) -> Result<u64> {
        let mut w = ChunkWriter { chunk: Vec::with_capacity(chunk_payload), emitted: 0, limit: chunk_payload, emit };
        let rec = PoolRec { next_volume: self.next_volume.into(), volumes: (self.volumes.len() as u64).into() };
        w.push(REC_POOL, &[rec.as_bytes()])?;
        for (&unit, c) in chunks {
            let Some(copy) = c.copy else {
                return Err(Error::new(
                    crate::ErrorKind::Io,
                    format!("checkpoint: page chunk at unit {unit} has no copy (an engine bug)"),
                ));
            };
            let r = PageChunkPairRec { unit: u64::from(unit).into(), seq: c.seq.into(), copy: u64::from(copy).into() };
            w.push(REC_PAGE_CHUNK_PAIR, &[r.as_bytes()])?;
        }
        let mut locs = 0u64;
        for (&id, v) in &self.volumes {
            let r = VolumeRec {
                volume: id.into(),
                size: v.size.into(),
                created: v.created.into(),
                name_len: (v.name.len() as u16).into(),
                flags: ((if v.snapshot { VOLUME_FLAG_SNAPSHOT } else { 0 })
                    | (if v.written { VOLUME_FLAG_WRITTEN } else { 0 }))
                .into(),
            };
            w.push(REC_VOLUME, &[r.as_bytes(), v.name.as_bytes()])?;
            if !v.props.is_empty() {
                w.push(REC_PROPS, &[&v.props.encode(id)])?;
            }
            let mut body: Vec<u8> = Vec::with_capacity(MAX_PAGE_LOCS * size_of::<LeafLoc>());
            let head = LeafLocsRec { volume: id.into() };
            for (index, leaf) in v.map.leaves() {
                let Some(at) = leaf.stored().filter(|at| chunks.contains_key(&at.unit)) else {
                    return Err(Error::new(
                        crate::ErrorKind::Io,
                        format!("checkpoint: leaf {index} of volume {id} is in no page chunk (an engine bug)"),
                    ));
                };
                let l = LeafLoc { leaf_index: (index as u32).into(), unit: at.unit.into(), offset: at.offset.into() };
                body.extend_from_slice(l.as_bytes());
                locs += 1;
                if body.len() == MAX_PAGE_LOCS * size_of::<LeafLoc>() {
                    w.push(REC_LEAF_LOCS, &[head.as_bytes(), &body])?;
                    body.clear();
                }
            }
            if !body.is_empty() {
                w.push(REC_LEAF_LOCS, &[head.as_bytes(), &body])?;
            }
        }
        // No refcount records: the open derives refcounts from the mappings
        // (`INCOMPAT_DERIVED_REFCOUNTS`, docs/on-disk-format.md 7.3).
        // The END record must know the chunk count, so make its room first.
        w.make_room(size_of::<RecordHeader>() + size_of::<EndRec>())?;
        let chunks = w.emitted + 1;
        let end = EndRec {
            volumes: (self.volumes.len() as u64).into(),
            pages: locs.into(),
            refcounts: 0.into(),
            chunks: chunks.into(),
        };
        w.push(REC_END, &[end.as_bytes()])?;
        (w.emit)(&w.chunk, true)?;
        Ok(chunks)
    }
}

/// The page chunks of a checkpoint, by the data unit page and leaf locations name.
pub(crate) type PageChunks = BTreeMap<u32, PageChunk>;

/// One page chunk of a checkpoint ([`PageChunks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageChunk {
    /// `checkpoint_seq` of the checkpoint that wrote it.
    pub seq: u64,
    /// The unit of its copy ([`INCOMPAT_DITTO`]), or `None` (a checkpoint of an older
    /// build).
    pub copy: Option<u32>,
    /// Both copies are sound as far as is known: written by this run, or read back
    /// sound (the open reads the second copy only when the first is damaged). A chunk
    /// that is not whole (one copy, or a copy found damaged) is never kept: the next
    /// checkpoint writes what it holds again.
    pub whole: bool,
}

impl PageChunk {
    /// A chunk just written, in two copies.
    pub fn written(seq: u64, copy: u32) -> Self {
        PageChunk { seq, copy: Some(copy), whole: true }
    }

    /// The units this chunk, stored at `unit`, takes: `unit`, then its copy's.
    pub fn units(&self, unit: u32) -> impl Iterator<Item = u32> {
        std::iter::once(unit).chain(self.copy)
    }
}

/// Data units the page chunks `chunks` take, their copies included.
pub(crate) fn page_chunk_units(chunks: &PageChunks) -> u64 {
    chunks.iter().map(|(&u, c)| c.units(u).count() as u64).sum()
}

/// What a checkpoint writes ([`State::plan_checkpoint`]).
pub(crate) struct CheckpointPlan {
    /// The distinct pages to write into new page chunks: those stored nowhere, and the
    /// live ones of cleaned chunks.
    pub dirty: Vec<Arc<MapPage>>,
    /// The distinct leaves to write into new page chunks, after the pages: those stored
    /// nowhere, those naming a page written again, and the live ones of cleaned chunks.
    pub dirty_leaves: Vec<Arc<Leaf>>,
    /// The page chunks kept, with the pages and leaves stored in them.
    pub kept: PageChunks,
    /// The units of the page chunks of the current checkpoint the next one drops, their
    /// copies included: they go back to the spare once it is durable.
    pub dropped: Vec<u32>,
}

impl CheckpointPlan {
    /// Bytes of page records the plan writes.
    pub fn page_bytes(&self) -> u64 {
        self.dirty.iter().map(|p| page_body_bytes(p.mapped)).sum()
    }

    /// Bytes of leaf records the plan writes.
    pub fn leaf_bytes(&self) -> u64 {
        self.dirty_leaves.iter().map(|l| leaf_body_bytes(l.present())).sum()
    }

    /// Forgets where the plan's pages and leaves were noted as written: its checkpoint
    /// failed.
    pub fn forget_stored(&self) {
        self.dirty.iter().for_each(|p| p.clear_stored());
        self.dirty_leaves.iter().for_each(|l| l.clear_stored());
    }
}

/// Decides, for the chunks of one kind holding live records (`live`: unit → live bytes
/// and the records), which of `chunks` are kept (into `kept`) and which are cleaned
/// (their records go to `dirty`, the records of that kind to write); returns the
/// cleaned units. A chunk at least half live (of `fill`) is kept. When `dirty` is
/// empty, every chunk is kept as long as the chunks are no more than the half-live
/// rule allows for the live bytes (after deletes they may be more: then it cleans as
/// usual, and gives them back), so a checkpoint with nothing of the kind to write
/// moves none of it.
fn keep_or_clean<T>(
    live: BTreeMap<u32, (u64, Vec<T>)>,
    dirty: &mut Vec<T>,
    chunks: &PageChunks,
    fill: u64,
    kept: &mut PageChunks,
) -> HashSet<u32> {
    let live_bytes: u64 = live.values().map(|(b, _)| b).sum();
    let idle = dirty.is_empty() && live.len() as u64 <= 2 * live_bytes.div_ceil(fill) + 1;
    let mut cleaned = HashSet::new();
    for (unit, (bytes, held)) in live {
        if (2 * bytes >= fill || idle) && chunks[&unit].whole {
            kept.insert(unit, chunks[&unit]);
        } else {
            dirty.extend(held);
            cleaned.insert(unit);
        }
    }
    cleaned
}

/// Bytes of a [`REC_LEAF_BODY`] record of a leaf with `present` pages, framing included.
pub(crate) const fn leaf_body_bytes(present: u32) -> u64 {
    (size_of::<RecordHeader>() + size_of::<LeafBodyRec>()) as u64 + present as u64 * size_of::<PageLoc>() as u64
}

/// Bytes of a [`REC_PAGE_BODY`] record of a page with `mapped` entries, framing included.
pub(crate) const fn page_body_bytes(mapped: u32) -> u64 {
    (size_of::<RecordHeader>() + size_of::<PageBodyRec>()) as u64 + mapped as u64 * size_of::<PageEntry>() as u64
}

/// What a page chunk holds: pages ([`REC_PAGE_BODY`]) or leaves ([`REC_LEAF_BODY`]).
pub(crate) trait ChunkBody {
    /// Bytes of its record, framing included.
    fn body_bytes(&self) -> usize;
    /// Appends its record to `chunk`; an error if it cannot be encoded (a leaf naming
    /// a page stored nowhere: an engine bug).
    fn push_body(&self, chunk: &mut Vec<u8>) -> Result<()>;
    /// Notes where it now is.
    fn set_stored(&self, at: PageStored);
}

impl ChunkBody for Arc<MapPage> {
    fn body_bytes(&self) -> usize {
        page_body_bytes(self.mapped) as usize
    }

    fn push_body(&self, chunk: &mut Vec<u8>) -> Result<()> {
        let head = PageBodyRec { entries: self.mapped.into(), pad: 0.into() };
        push_record(chunk, REC_PAGE_BODY, &[head.as_bytes(), &page_entries(self)]);
        Ok(())
    }

    fn set_stored(&self, at: PageStored) {
        MapPage::set_stored(self, at)
    }
}

impl ChunkBody for Arc<Leaf> {
    fn body_bytes(&self) -> usize {
        leaf_body_bytes(self.present()) as usize
    }

    fn push_body(&self, chunk: &mut Vec<u8>) -> Result<()> {
        let mut body = Vec::with_capacity(self.present() as usize * size_of::<PageLoc>());
        for (i, page) in self.pages() {
            let at = page.stored().ok_or_else(|| {
                Error::new(
                    crate::ErrorKind::Io,
                    format!("checkpoint: page {i} of a leaf is stored nowhere (an engine bug)"),
                )
            })?;
            let l = PageLoc { page_index: (i as u32).into(), unit: at.unit.into(), offset: at.offset.into() };
            body.extend_from_slice(l.as_bytes());
        }
        let head = LeafBodyRec { pages: self.present().into(), pad: 0.into() };
        push_record(chunk, REC_LEAF_BODY, &[head.as_bytes(), &body]);
        Ok(())
    }

    fn set_stored(&self, at: PageStored) {
        Leaf::set_stored(self, at)
    }
}

/// Packs `items` (pages, or leaves whose pages are all stored by now) as records into
/// page chunk payloads of at most `chunk_payload` bytes, handing each finished payload
/// to `emit`, which writes it and returns the data unit it went to; then notes in
/// each item where it now is ([`MapPage::set_stored`], [`Leaf::set_stored`]). Returns
/// the units, in order; stops at the first error.
pub(crate) fn encode_bodies<T: ChunkBody>(
    items: &[T],
    chunk_payload: usize,
    emit: &mut dyn FnMut(&[u8]) -> Result<u32>,
) -> Result<Vec<u32>> {
    let mut units = Vec::new();
    let mut chunk: Vec<u8> = Vec::with_capacity(chunk_payload);
    let mut held: Vec<(&T, u32)> = Vec::new();
    let mut flush = |chunk: &mut Vec<u8>, held: &mut Vec<(&T, u32)>| -> Result<()> {
        let unit = emit(chunk)?;
        for (item, offset) in held.drain(..) {
            item.set_stored(PageStored { unit, offset });
        }
        units.push(unit);
        chunk.clear();
        Ok(())
    };
    for item in items {
        if chunk.len() + item.body_bytes() > chunk_payload {
            flush(&mut chunk, &mut held)?;
        }
        held.push((item, chunk.len() as u32));
        item.push_body(&mut chunk)?;
    }
    if !chunk.is_empty() {
        flush(&mut chunk, &mut held)?;
    }
    Ok(units)
}

/// The mapped entries of `page` as [`PageEntry`]s, in ascending index.
fn page_entries(page: &MapPage) -> Vec<u8> {
    let mut body = Vec::with_capacity(page.mapped as usize * size_of::<PageEntry>());
    for (i, e) in page.entries.iter().enumerate() {
        if e.is_mapped() {
            let pe = PageEntry { index: (i as u32).into(), bitmap: e.bitmap.into(), punit: u64::from(e.punit).into() };
            body.extend_from_slice(pe.as_bytes());
        }
    }
    body
}

/// The largest checkpoint record: a full mapping page of the older format, larger than
/// a page body, a run of page locations or a property record.
const LARGEST_RECORD: u64 =
    (size_of::<RecordHeader>() + size_of::<PageRec>() + PAGE_ENTRIES * size_of::<PageEntry>()) as u64;
const _: () = assert!(crate::props::MAX_PROPS_BYTES <= LARGEST_RECORD);
const _: () = assert!(page_body_bytes(PAGE_ENTRIES as u32) <= LARGEST_RECORD);
const _: () = assert!(leaf_body_bytes(LEAF_PAGES as u32) <= LARGEST_RECORD);
const _: () = assert!(
    (size_of::<RecordHeader>() + size_of::<PageLocsRec>() + MAX_PAGE_LOCS * size_of::<PageLoc>()) as u64
        <= LARGEST_RECORD
);

/// Bytes every chunk of `unit_size` but the last of its kind holds at least: a chunk is
/// handed on only when the next record does not fit in its payload.
pub(crate) fn chunk_fill(unit_size: u64) -> u64 {
    unit_size - size_of::<ChunkHeader>() as u64 - LARGEST_RECORD
}

/// Bytes of page and leaf records a checkpoint of metadata counted as `c` writes at
/// most: every distinct page (16 bytes per entry and a 12-byte record head) and every
/// distinct leaf (12 bytes per page it holds and a 12-byte record head).
pub(crate) fn page_bytes_bound(c: &MetaCounts) -> u64 {
    c.pages * page_body_bytes(0)
        + c.entries * size_of::<PageEntry>() as u64
        + c.leaves * leaf_body_bytes(0)
        + c.page_refs * size_of::<PageLoc>() as u64
}

/// Bytes of a checkpoint's directory for metadata counted as `c` with `page_chunks`
/// page chunks, at most: the pool and end records, a record per page chunk, per volume
/// (and its property record, counted in `volume_bytes`) and per 512 leaf locations,
/// and a location per table holding a leaf.
pub(crate) fn directory_bytes_bound(c: &MetaCounts, page_chunks: u64) -> u64 {
    let hdr = size_of::<RecordHeader>() as u64;
    let loc_records = c.leaf_refs / MAX_PAGE_LOCS as u64 + c.volumes;
    (hdr + size_of::<PoolRec>() as u64)
        + page_chunks * (hdr + size_of::<PageChunkPairRec>() as u64)
        + c.volumes * (hdr + size_of::<VolumeRec>() as u64)
        + c.volume_bytes
        + c.leaf_refs * size_of::<LeafLoc>() as u64
        + loc_records * (hdr + size_of::<LeafLocsRec>() as u64)
        + (hdr + size_of::<EndRec>() as u64)
}

/// Bytes of records a checkpoint of metadata counted as `c` writes at most, when it
/// writes every page and leaf ([`State::plan_checkpoint`] keeping nothing):
/// [`page_bytes_bound`] and the directory with at most twice the page chunks those
/// fill, plus two (the chunks a checkpoint keeps are at least half live, and each of
/// the two kinds may end with one less full). No refcounts: the open derives them.
/// `unit_size` gives the chunks' fill.
pub(crate) fn checkpoint_bytes_bound(c: &MetaCounts, unit_size: u64) -> u64 {
    let pages = page_bytes_bound(c);
    pages + directory_bytes_bound(c, 2 * pages.div_ceil(chunk_fill(unit_size)) + 2)
}

/// Copies of every checkpoint chunk ([`INCOMPAT_DITTO`]).
pub(crate) const CHUNK_COPIES: u64 = 2;

/// Data units of `unit_size` bytes a checkpoint writes at most for `bytes` bytes of
/// records: page chunks, leaf chunks and directory chunks, each kind with one chunk
/// that may be less than full ([`chunk_fill`]), each chunk in [`CHUNK_COPIES`] units.
pub(crate) fn checkpoint_units_bound(bytes: u64, unit_size: u64) -> u64 {
    CHUNK_COPIES * (bytes.div_ceil(chunk_fill(unit_size)) + 4)
}

/// Receives checkpoint chunk payloads in order: `(payload, last)`.
pub(crate) type ChunkSink<'a> = dyn FnMut(&[u8], bool) -> Result<()> + 'a;

/// Packs records into chunk payloads; a record never spans chunks.
struct ChunkWriter<'a, 'b> {
    /// The chunk being filled.
    chunk: Vec<u8>,
    /// Chunks handed to `emit` so far.
    emitted: u64,
    limit: usize,
    emit: &'a mut ChunkSink<'b>,
}

impl ChunkWriter<'_, '_> {
    /// Hands the current chunk on (as not the last) if `len` more bytes do not fit.
    fn make_room(&mut self, len: usize) -> Result<()> {
        if self.chunk.len() + len > self.limit {
            (self.emit)(&self.chunk, false)?;
            self.emitted += 1;
            self.chunk.clear();
        }
        Ok(())
    }

    fn push(&mut self, kind: u8, parts: &[&[u8]]) -> Result<()> {
        let len: usize = size_of::<RecordHeader>() + parts.iter().map(|p| p.len()).sum::<usize>();
        assert!(len <= self.limit, "checkpoint record of {len} bytes exceeds the chunk payload {}", self.limit);
        self.make_room(len)?;
        push_record(&mut self.chunk, kind, parts);
        Ok(())
    }
}

/// The refcount each of `units` data units should have by the mappings `maps`: the
/// number of distinct pages that map it (a page several tables share counts once),
/// counted in an allocator of its own (a byte per unit, exact past that).
pub(crate) fn derive_refcounts<'a>(maps: impl IntoIterator<Item = &'a MapTable>, units: usize) -> Allocator {
    let mut derived = Allocator::new(units);
    let mut seen: HashSet<*const MapPage> = Default::default();
    let mut seen_leaves: HashSet<*const Leaf> = Default::default();
    for map in maps {
        for (_, leaf) in map.leaves() {
            if !seen_leaves.insert(Arc::as_ptr(leaf)) {
                continue;
            }
            for (_, p) in leaf.pages() {
                if seen.insert(Arc::as_ptr(p)) {
                    p.units().for_each(|u| derived.incref(u));
                }
            }
        }
    }
    derived
}
