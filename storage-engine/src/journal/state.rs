//! The whole metadata of a pool as a plain value: [`State`] (volumes and their mapping
//! tables, the allocator), [`State::apply`] (replay of one record), the checkpoint's
//! encoding into chunk payloads ([`State::encode_checkpoint`]) and the bound on its
//! size ([`checkpoint_bytes_bound`], [`checkpoint_units_bound`]), and
//! [`derive_refcounts`]. Not here: writing chunks (the store's checkpoint), loading them
//! (recovery.rs).

use std::collections::BTreeMap;
use std::sync::Arc;

use zerocopy::IntoBytes;

use super::records::{push_record, Record};
use crate::error::{Error, Result};
use crate::format::*;
use crate::meta::{Allocator, Entry, MapPage, MapTable, MetaCounts, META};
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
                // A clone is never pristine; a snapshot is what its source was.
                let written = !snapshot || src.written;
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

    /// Serialises the state into checkpoint chunk payloads, each at most `chunk_payload`
    /// bytes, handing each finished payload to `emit` in order with whether it is the
    /// last, so that only one chunk is held in memory at a time. The caller adds chunk
    /// headers and writes them. Returns the number of chunks; stops at the first error
    /// `emit` returns.
    pub fn encode_checkpoint(&self, chunk_payload: usize, emit: &mut ChunkSink<'_>) -> Result<u64> {
        let mut w = ChunkWriter { chunk: Vec::with_capacity(chunk_payload), emitted: 0, limit: chunk_payload, emit };
        let rec = PoolRec { next_volume: self.next_volume.into(), volumes: (self.volumes.len() as u64).into() };
        w.push(REC_POOL, &[rec.as_bytes()])?;
        let mut page_ids: std::collections::HashMap<*const MapPage, u64> = Default::default();
        let mut pages = 0u64;
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
            for (index, page) in v.map.pages() {
                let key = Arc::as_ptr(page);
                if let Some(&pid) = page_ids.get(&key) {
                    let r = PageRefRec { volume: id.into(), page_index: (index as u64).into(), page_id: pid.into() };
                    w.push(REC_PAGE_REF, &[r.as_bytes()])?;
                    continue;
                }
                let pid = pages;
                pages += 1;
                page_ids.insert(key, pid);
                let mut body = Vec::with_capacity(page.mapped as usize * 16);
                for (i, e) in page.entries.iter().enumerate() {
                    if e.is_mapped() {
                        let pe = PageEntry {
                            index: (i as u32).into(),
                            bitmap: e.bitmap.into(),
                            punit: u64::from(e.punit).into(),
                        };
                        body.extend_from_slice(pe.as_bytes());
                    }
                }
                let head = PageRec {
                    volume: id.into(),
                    page_index: (index as u64).into(),
                    page_id: pid.into(),
                    entries: page.mapped.into(),
                    pad: 0.into(),
                };
                w.push(REC_PAGE, &[head.as_bytes(), &body])?;
            }
        }
        // No refcount records: the open derives refcounts from the mappings
        // (`INCOMPAT_DERIVED_REFCOUNTS`, docs/on-disk-format.md 7.3).
        // The END record must know the chunk count, so make its room first.
        w.make_room(size_of::<RecordHeader>() + size_of::<EndRec>())?;
        let chunks = w.emitted + 1;
        let end = EndRec {
            volumes: (self.volumes.len() as u64).into(),
            pages: pages.into(),
            refcounts: 0.into(),
            chunks: chunks.into(),
        };
        w.push(REC_END, &[end.as_bytes()])?;
        (w.emit)(&w.chunk, true)?;
        Ok(chunks)
    }
}

/// The largest checkpoint record: a full mapping page (a property record is no larger).
const LARGEST_RECORD: u64 =
    (size_of::<RecordHeader>() + size_of::<PageRec>() + PAGE_ENTRIES * size_of::<PageEntry>()) as u64;
const _: () = assert!(crate::props::MAX_PROPS_BYTES <= LARGEST_RECORD);

/// Bytes of records a checkpoint of metadata counted as `c` takes at most
/// ([`State::encode_checkpoint`]): one record per volume (and its property record,
/// counted in `volume_bytes`) and per distinct page (16 bytes per entry), one page
/// reference per further table holding a page, and the pool and end records. No
/// refcounts: the open derives them.
pub(crate) fn checkpoint_bytes_bound(c: &MetaCounts) -> u64 {
    let hdr = size_of::<RecordHeader>() as u64;
    (hdr + size_of::<PoolRec>() as u64)
        + c.volumes * (hdr + size_of::<VolumeRec>() as u64)
        + c.volume_bytes
        + c.pages * (hdr + size_of::<PageRec>() as u64)
        + c.entries * size_of::<PageEntry>() as u64
        + c.page_refs.saturating_sub(c.pages) * (hdr + size_of::<PageRefRec>() as u64)
        + (hdr + size_of::<EndRec>() as u64)
}

/// Chunks (data units of `unit_size` bytes) a checkpoint of `bytes` bytes of records
/// takes at most: every chunk but the last is handed on only when the next record does
/// not fit, so it holds more than its payload less the largest record.
pub(crate) fn checkpoint_units_bound(bytes: u64, unit_size: u64) -> u64 {
    let fill = unit_size - size_of::<ChunkHeader>() as u64 - LARGEST_RECORD;
    bytes.div_ceil(fill) + 1
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
    let mut seen: std::collections::HashSet<*const MapPage> = Default::default();
    for map in maps {
        for (_, p) in map.pages() {
            if seen.insert(Arc::as_ptr(p)) {
                p.units().for_each(|u| derived.incref(u));
            }
        }
    }
    derived
}
