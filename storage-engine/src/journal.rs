//! Metadata records, the redo log, and checkpoints: encoding, decoding and replay.
//!
//! Lives here: [`Record`] (one metadata change), its encoding into log batches and
//! checkpoint chunks, [`State`] (the whole metadata of a pool as a plain value) with
//! [`State::apply`] (replay of one record), checkpoint serialisation, and
//! [`load`] (superblock + checkpoint + log replay, used by open and by `check`).
//! Not here: when to commit (the pool's committer), the data path.

use std::collections::BTreeMap;
use std::sync::Arc;

use zerocopy::{FromBytes, IntoBytes};

use crate::error::{Error, Result};
use crate::format::*;
use crate::meta::{Allocator, Entry, MapPage, MapTable, MetaCounts, META};

/// One metadata change, as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Map { volume: u64, lunit: u64, punit: u32, bitmap: u32 },
    Unmap { volume: u64, lunit: u64 },
    Volume { volume: u64, size: u64, created: u32, name: String },
    Share { source: u64, target: u64, size: u64, created: u32, snapshot: bool, name: String },
    VolumeDelete { volume: u64 },
    VolumeResize { volume: u64, size: u64 },
}

fn push_record(out: &mut Vec<u8>, kind: u8, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let h = RecordHeader { kind, pad: 0, len: (len as u16).into() };
    out.extend_from_slice(h.as_bytes());
    for p in parts {
        out.extend_from_slice(p);
    }
}

impl Record {
    /// Appends the framed record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Record::Map { volume, lunit, punit, bitmap } => {
                let r = MapRec {
                    volume: (*volume).into(),
                    lunit: (*lunit).into(),
                    punit: u64::from(*punit).into(),
                    bitmap: u64::from(*bitmap).into(),
                };
                push_record(out, REC_MAP, &[r.as_bytes()]);
            }
            Record::Unmap { volume, lunit } => {
                let r = UnmapRec { volume: (*volume).into(), lunit: (*lunit).into() };
                push_record(out, REC_UNMAP, &[r.as_bytes()]);
            }
            Record::Volume { volume, size, created, name } => {
                let r = VolumeRec {
                    volume: (*volume).into(),
                    size: (*size).into(),
                    created: (*created).into(),
                    name_len: (name.len() as u16).into(),
                    flags: 0.into(),
                };
                push_record(out, REC_VOLUME, &[r.as_bytes(), name.as_bytes()]);
            }
            Record::Share { source, target, size, created, snapshot, name } => {
                let r = ShareRec {
                    source: (*source).into(),
                    target: (*target).into(),
                    size: (*size).into(),
                    created: (*created).into(),
                    name_len: (name.len() as u16).into(),
                    flags: (if *snapshot { VOLUME_FLAG_SNAPSHOT } else { 0 }).into(),
                };
                push_record(out, REC_SHARE, &[r.as_bytes(), name.as_bytes()]);
            }
            Record::VolumeDelete { volume } => {
                push_record(out, REC_VOLUME_DELETE, &[VolumeDeleteRec { volume: (*volume).into() }.as_bytes()]);
            }
            Record::VolumeResize { volume, size } => {
                let r = VolumeResizeRec { volume: (*volume).into(), size: (*size).into() };
                push_record(out, REC_VOLUME_RESIZE, &[r.as_bytes()]);
            }
        }
    }

    /// Decodes a log record body of `kind`.
    pub fn decode(kind: u8, body: &[u8]) -> Result<Record> {
        let bad = || Error::corrupt(format!("malformed log record of kind {kind} ({} bytes)", body.len()));
        Ok(match kind {
            REC_MAP => {
                let r = MapRec::read_from_bytes(body).map_err(|_| bad())?;
                let punit = u32::try_from(r.punit.get()).map_err(|_| bad())?;
                let bitmap = u32::try_from(r.bitmap.get()).map_err(|_| bad())?;
                Record::Map { volume: r.volume.get(), lunit: r.lunit.get(), punit, bitmap }
            }
            REC_UNMAP => {
                let r = UnmapRec::read_from_bytes(body).map_err(|_| bad())?;
                Record::Unmap { volume: r.volume.get(), lunit: r.lunit.get() }
            }
            REC_VOLUME => {
                let (r, name) = VolumeRec::read_from_prefix(body).map_err(|_| bad())?;
                if name.len() != r.name_len.get() as usize || r.flags.get() & !VOLUME_FLAG_SNAPSHOT != 0 {
                    return Err(bad());
                }
                let name = String::from_utf8(name.to_vec()).map_err(|_| bad())?;
                Record::Volume { volume: r.volume.get(), size: r.size.get(), created: r.created.get(), name }
            }
            REC_SHARE => {
                let (r, name) = ShareRec::read_from_prefix(body).map_err(|_| bad())?;
                if name.len() != r.name_len.get() as usize || r.flags.get() & !VOLUME_FLAG_SNAPSHOT != 0 {
                    return Err(bad());
                }
                let name = String::from_utf8(name.to_vec()).map_err(|_| bad())?;
                Record::Share {
                    source: r.source.get(),
                    target: r.target.get(),
                    size: r.size.get(),
                    created: r.created.get(),
                    snapshot: r.flags.get() & VOLUME_FLAG_SNAPSHOT != 0,
                    name,
                }
            }
            REC_VOLUME_DELETE => {
                Record::VolumeDelete { volume: VolumeDeleteRec::read_from_bytes(body).map_err(|_| bad())?.volume.get() }
            }
            REC_VOLUME_RESIZE => {
                let r = VolumeResizeRec::read_from_bytes(body).map_err(|_| bad())?;
                Record::VolumeResize { volume: r.volume.get(), size: r.size.get() }
            }
            _ => return Err(Error::corrupt(format!("unknown log record kind {kind}"))),
        })
    }
}

/// Splits a run of framed records into (kind, body) pairs.
pub(crate) fn split_records(mut payload: &[u8]) -> Result<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    while !payload.is_empty() {
        let (h, rest) =
            RecordHeader::read_from_prefix(payload).map_err(|_| Error::corrupt("truncated record header"))?;
        let len = h.len.get() as usize;
        if rest.len() < len {
            return Err(Error::corrupt("record runs past its batch or chunk"));
        }
        out.push((h.kind, &rest[..len]));
        payload = &rest[len..];
    }
    Ok(out)
}

/// Metadata of one volume as a plain value.
#[derive(Clone)]
pub(crate) struct VolumeMeta {
    pub name: String,
    /// A read-only snapshot.
    pub snapshot: bool,
    pub size: u64,
    pub created: u32,
    pub map: MapTable,
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
                self.alloc.counts.name_bytes += name.len() as u64;
                self.volumes.insert(volume, VolumeMeta { name, snapshot: false, size, created, map });
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
                let map = src.map.share(&mut self.alloc);
                self.alloc.counts.volumes += 1;
                self.alloc.counts.name_bytes += name.len() as u64;
                self.volumes.insert(target, VolumeMeta { name, snapshot, size, created, map });
                self.next_volume = self.next_volume.max(target + 1);
            }
            Record::VolumeDelete { volume } => {
                let mut vol = self
                    .volumes
                    .remove(&volume)
                    .ok_or_else(|| Error::corrupt(format!("log deletes unknown volume {volume}")))?;
                vol.map.release_all(&mut self.alloc);
                self.alloc.counts.volumes -= 1;
                self.alloc.counts.name_bytes -= vol.name.len() as u64;
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
                flags: (if v.snapshot { VOLUME_FLAG_SNAPSHOT } else { 0 }).into(),
            };
            w.push(REC_VOLUME, &[r.as_bytes(), v.name.as_bytes()])?;
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
        // Refcount records fill what room the current chunk has left (up to a record's
        // largest body), so that they waste at most one entry per chunk: the bound on a
        // checkpoint's size (`checkpoint_bytes_bound`) counts on it.
        let mut refcounts = 0u64;
        let mut body = Vec::new();
        let entry = size_of::<RefcountEntry>();
        let room = |w: &ChunkWriter<'_, '_>| {
            (w.limit - w.chunk.len()).saturating_sub(size_of::<RecordHeader>()).min(u16::MAX as usize) / entry * entry
        };
        for (u, r) in self.alloc.nonzero_refcounts() {
            if r != META && !self.alloc.cow_inflight.contains(&u) {
                if body.is_empty() && room(&w) < entry {
                    w.make_room(size_of::<RecordHeader>() + entry)?;
                }
                body.extend_from_slice(
                    RefcountEntry { unit: (u as u64).into(), refcount: r.into(), pad: 0.into() }.as_bytes(),
                );
                refcounts += 1;
                if body.len() + entry > room(&w) {
                    w.push(REC_REFCOUNTS, &[&body])?;
                    body.clear();
                }
            }
        }
        if !body.is_empty() {
            w.push(REC_REFCOUNTS, &[&body])?;
        }
        // The END record must know the chunk count, so make its room first.
        w.make_room(size_of::<RecordHeader>() + size_of::<EndRec>())?;
        let chunks = w.emitted + 1;
        let end = EndRec {
            volumes: (self.volumes.len() as u64).into(),
            pages: pages.into(),
            refcounts: refcounts.into(),
            chunks: chunks.into(),
        };
        w.push(REC_END, &[end.as_bytes()])?;
        (w.emit)(&w.chunk, true)?;
        Ok(chunks)
    }
}

/// The largest checkpoint record but refcount records: a full mapping page.
const LARGEST_RECORD: u64 =
    (size_of::<RecordHeader>() + size_of::<PageRec>() + PAGE_ENTRIES * size_of::<PageEntry>()) as u64;

/// Bytes of records a checkpoint of metadata counted as `c`, with `refcounts` refcount
/// entries, takes at most ([`State::encode_checkpoint`]): one record per volume and per
/// distinct page (16 bytes per entry), one page reference per further table holding a
/// page, 16 bytes per refcount entry with a record header per 4 KiB of them and two more
/// per chunk they may end (a refcount record fills the room its chunk has left), and
/// the pool and end records.
pub(crate) fn checkpoint_bytes_bound(c: &MetaCounts, refcounts: u64) -> u64 {
    let hdr = size_of::<RecordHeader>() as u64;
    let refcount_bytes = refcounts * size_of::<RefcountEntry>() as u64;
    (hdr + size_of::<PoolRec>() as u64)
        + c.volumes * (hdr + size_of::<VolumeRec>() as u64)
        + c.name_bytes
        + c.pages * (hdr + size_of::<PageRec>() as u64)
        + c.entries * size_of::<PageEntry>() as u64
        + c.page_refs.saturating_sub(c.pages) * (hdr + size_of::<PageRefRec>() as u64)
        + refcount_bytes
        + hdr * (2 * refcount_bytes.div_ceil(4096) + 2)
        + (hdr + size_of::<EndRec>() as u64)
}

/// Chunks (data units of `unit_size` bytes) a checkpoint of `bytes` bytes of records
/// takes at most: every chunk but the last is handed on only when the next record does
/// not fit, so it holds more than its payload less the largest record (refcount
/// records, which fill what is left, waste less).
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

/// Reads `len` bytes at byte `offset` of the pool.
pub(crate) type ReadAt<'a> = dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>> + 'a;

/// Pool geometry from a validated superblock.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    pub uuid: [u8; 16],
    pub pool_size: u64,
    pub unit_size: u64,
    pub log_offset: u64,
    pub log_size: u64,
    pub data_offset: u64,
    pub unit_count: u64,
}

impl Geometry {
    pub fn pool_tag(&self) -> u64 {
        u64::from_le_bytes(self.uuid[..8].try_into().expect("8 bytes"))
    }
    pub fn unit_offset(&self, unit: u64) -> u64 {
        self.data_offset + unit * self.unit_size
    }
    pub fn blocks_per_unit(&self) -> u64 {
        self.unit_size / BLOCK_SIZE
    }
}

/// Validates a superblock's fields. `size` is the device size in bytes.
pub(crate) fn validate_superblock(sb: &Superblock, size: u64) -> Result<Geometry> {
    if sb.magic != SUPERBLOCK_MAGIC {
        return Err(Error::corrupt("not a ferrovol pool: superblock magic is missing"));
    }
    if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&sb.version.get()) {
        return Err(Error::corrupt(format!(
            "pool format version {} is not supported by this build (it reads versions {MIN_READ_VERSION} to {FORMAT_VERSION})",
            sb.version.get()
        )));
    }
    if sb.compute_crc() != sb.crc.get() {
        return Err(Error::corrupt("superblock checksum mismatch"));
    }
    if sb.features.get() != 0 {
        return Err(Error::corrupt(format!("pool uses unknown feature bits {:#x}", sb.features.get())));
    }
    let unit_size = sb.unit_size.get();
    let g = Geometry {
        uuid: sb.pool_uuid,
        pool_size: sb.pool_size.get(),
        unit_size: u64::from(unit_size),
        log_offset: sb.log_offset.get(),
        log_size: sb.log_size.get(),
        data_offset: sb.data_offset.get(),
        unit_count: sb.unit_count.get(),
    };
    let sane = sb.header_size.get() as usize == size_of::<Superblock>()
        && sb.block_size.get() as u64 == BLOCK_SIZE
        && unit_size.is_power_of_two()
        && (MIN_UNIT_SIZE..=MAX_UNIT_SIZE).contains(&unit_size)
        && g.log_offset == LOG_OFFSET
        && g.log_size >= 4 * MAX_BATCH_BYTES as u64
        && g.log_size.is_multiple_of(BLOCK_SIZE)
        && g.data_offset >= g.log_offset + g.log_size
        && g.data_offset.is_multiple_of(g.unit_size)
        && g.unit_count > 0
        && g.unit_count < u64::from(u32::MAX)
        && g.unit_count
            .checked_mul(g.unit_size)
            .and_then(|b| b.checked_add(g.data_offset))
            .is_some_and(|end| end <= g.pool_size);
    if !sane {
        return Err(Error::corrupt("superblock geometry is inconsistent"));
    }
    if sb.checkpoint_seq.get() > MAX_SEQ || sb.log_head.get() > MAX_SEQ {
        return Err(Error::corrupt("superblock log head or sequence number is out of range"));
    }
    if g.pool_size > size {
        return Err(Error::corrupt(format!(
            "pool was created with {} bytes but the file or device has only {size}",
            g.pool_size
        )));
    }
    Ok(g)
}

/// Picks the current superblock from the two slots (on-disk-format.md 7.1); returns it,
/// its geometry, when one slot was damaged but the pool opens anyway a warning naming
/// it, and whether that is a rollback (the damaged slot may have held a newer
/// generation and `accept_rollback` let the open go on).
///
/// Both slots are always written (at create, then alternately by every checkpoint), so
/// one invalid slot means damage, and a damaged slot may have held the newer
/// generation: opening from the other would silently roll the pool back. So when only
/// one slot is valid (generation `G`), the other is tolerated only if it is
/// recognisably the older one (its magic intact and its generation field reading
/// `G - 1`), or if it is all zeros with `G` 0 or 1 (a pool whose creation was cut
/// short: it names no checkpoint); otherwise the open fails unless `accept_rollback`.
///
/// Errors: [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) naming each slot's problem.
pub(crate) fn read_superblock(
    read: &mut ReadAt<'_>,
    size: u64,
    accept_rollback: bool,
) -> Result<(Superblock, Geometry, Option<String>, bool)> {
    if size < 2 * BLOCK_SIZE {
        return Err(Error::corrupt(format!("file is {size} bytes: too small to be a pool")));
    }
    let mut slots = Vec::with_capacity(2);
    for &off in SUPERBLOCK_OFFSETS.iter() {
        let bytes = read(off, size_of::<Superblock>()).map_err(|e| Error::io("read superblock", e))?;
        let sb = Superblock::read_from_bytes(&bytes).expect("256 bytes");
        let checked = validate_superblock(&sb, size);
        slots.push((sb, checked));
    }
    let (v, d) = match (&slots[0].1, &slots[1].1) {
        (Ok(_), Ok(_)) => {
            let newer = usize::from(slots[1].0.generation.get() > slots[0].0.generation.get());
            let (sb, g) = slots.swap_remove(newer);
            return Ok((sb, g.expect("valid"), None, false));
        }
        (Err(a), Err(b)) => {
            return Err(Error::corrupt(format!("slot 0: {}; slot 1: {}", a.message(), b.message())));
        }
        (Ok(_), Err(_)) => (0, 1),
        (Err(_), Ok(_)) => (1, 0),
    };
    let gen = slots[v].0.generation.get();
    let damaged = &slots[d].0;
    let problem = slots[d].1.as_ref().err().map(|e| e.message().to_owned()).unwrap_or_default();
    let read_gen = damaged.generation.get();
    let note = format!("superblock slot {d} is damaged ({problem})");
    let mut rolled_back = false;
    let warning = if damaged.magic == SUPERBLOCK_MAGIC && read_gen.checked_add(1) == Some(gen) {
        format!(
            "{note}; its generation field reads {read_gen}, one older than slot {v}'s {gen}: opened from slot {v}, \
             and the next checkpoint rewrites slot {d}"
        )
    } else if gen <= 1 && damaged.as_bytes().iter().all(|&b| b == 0) {
        // Creation writes generation 0 and 1 (both naming no checkpoint) with one sync
        // after both: either may be missing after a cut, and neither holds anything.
        format!("{note}: never written (the pool's creation was cut short); opened from slot {v}, generation {gen}")
    } else if accept_rollback {
        rolled_back = true;
        format!(
            "{note} and may have held a newer generation than slot {v} ({gen}); opened from slot {v} as asked \
             (accept a superblock rollback): the metadata committed after generation {gen} is lost. Data is not \
             rolled back: blocks overwritten in place since keep their new contents, and data units freed since \
             may have been reused, so ranges that mapped them may read data written later, by any volume"
        )
    } else {
        return Err(Error::corrupt(format!(
            "{note} and may hold a newer generation than slot {v}, which is valid (generation {gen}; the damaged \
             slot's generation field reads {read_gen}). Opening from slot {v} could silently lose what was committed \
             after generation {gen}, so the pool is not opened. If that loss is acceptable, open it with a superblock \
             rollback accepted (`ferrovol serve --accept-superblock-rollback`); otherwise restore the pool from a copy"
        )));
    };
    let (sb, g) = slots.swap_remove(v);
    Ok((sb, g.expect("valid"), Some(warning), rolled_back))
}

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
    /// Units of the current checkpoint.
    pub checkpoint_units: Vec<u32>,
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
    /// last one replayed: the checkpoint at open must number past it.
    pub highest_seq: u64,
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
}

/// Reads the superblock, the checkpoint and replays the log. Never writes.
pub(crate) fn load(read: &mut ReadAt<'_>, size: u64, accept: Accept) -> Result<Loaded> {
    let (sb, geo, superblock_warning, rolled_back) = read_superblock(read, size, accept.superblock_rollback)?;
    let later_commits = if rolled_back {
        LaterCommits::RolledBack
    } else if accept.log_loss {
        LaterCommits::LossAccepted
    } else {
        LaterCommits::Refuse
    };
    match load_from(read, sb, geo, later_commits) {
        Ok(loaded) => Ok(Loaded { superblock_warning, ..loaded }),
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
fn load_from(read: &mut ReadAt<'_>, sb: Superblock, geo: Geometry, later_commits: LaterCommits) -> Result<Loaded> {
    // Holds the stored refcounts and the checkpoint's units as they are read.
    let mut alloc = Allocator::new(geo.unit_count as usize);
    let mut volumes = BTreeMap::new();
    let mut next_volume = 1;
    let mut checkpoint_units = Vec::new();
    let mut stored_refcounts = 0u64;
    let mut unit = sb.checkpoint_unit.get();
    if unit != NO_UNIT {
        let mut pages: Vec<Arc<MapPage>> = Vec::new();
        let mut index = 0u64;
        let mut ended = None;
        let mut expected_chunks = sb.checkpoint_chunks.get();
        while unit != NO_UNIT {
            if unit >= geo.unit_count || index >= expected_chunks {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index} points at unit {unit}, outside the checkpoint"
                )));
            }
            match alloc.refcount(unit as u32) {
                0 => alloc.set_loaded(unit as u32, META),
                META => return Err(Error::corrupt(format!("checkpoint chunk list loops at unit {unit}"))),
                _ => {
                    return Err(Error::corrupt(format!(
                        "data unit {unit} holds checkpoint chunk {index} but has a refcount entry"
                    )))
                }
            }
            checkpoint_units.push(unit as u32);
            let bytes =
                read(geo.unit_offset(unit), geo.unit_size as usize).map_err(|e| Error::io("read checkpoint", e))?;
            let (h, rest) = ChunkHeader::read_from_prefix(&bytes).expect("unit holds a header");
            let plen = h.payload_len.get() as usize;
            let mut hz = h.clone();
            hz.crc = 0.into();
            let ok = h.magic.get() == CHECKPOINT_MAGIC
                && plen <= rest.len()
                && h.pool_uuid == geo.uuid
                && h.checkpoint_seq.get() == sb.checkpoint_seq.get()
                && h.index.get() == index
                && crc32c::crc32c_append(crc(hz.as_bytes()), &rest[..plen]) == h.crc.get();
            if !ok {
                return Err(Error::corrupt(format!(
                    "checkpoint chunk {index} at data unit {unit} (byte offset {}) fails its header or checksum",
                    geo.unit_offset(unit)
                )));
            }
            for (kind, body) in split_records(&rest[..plen])? {
                let bad = |what: &str| Error::corrupt(format!("checkpoint chunk {index}: malformed {what} record"));
                match kind {
                    REC_POOL => {
                        next_volume = PoolRec::read_from_bytes(body).map_err(|_| bad("pool"))?.next_volume.get()
                    }
                    REC_VOLUME => {
                        let Record::Volume { volume, size, created, name } = Record::decode(kind, body)? else {
                            unreachable!()
                        };
                        let flags = VolumeRec::read_from_prefix(body).map_err(|_| bad("volume"))?.0.flags.get();
                        if flags & !VOLUME_FLAG_SNAPSHOT != 0 {
                            return Err(bad("volume (unknown flags)"));
                        }
                        let map = MapTable::new();
                        let snapshot = flags & VOLUME_FLAG_SNAPSHOT != 0;
                        volumes.insert(volume, VolumeMeta { name, snapshot, size, created, map });
                    }
                    REC_PAGE => {
                        let (h, entries) = PageRec::read_from_prefix(body).map_err(|_| bad("page"))?;
                        let n = h.entries.get() as usize;
                        let entries = <[PageEntry]>::ref_from_bytes(entries).map_err(|_| bad("page"))?;
                        if entries.len() != n || h.page_id.get() != pages.len() as u64 {
                            return Err(bad("page"));
                        }
                        let mut page = MapPage::new();
                        page.mapped = n as u32;
                        for e in entries {
                            let i = e.index.get() as usize;
                            let punit = u32::try_from(e.punit.get()).map_err(|_| bad("page"))?;
                            if i >= PAGE_ENTRIES || page.entries[i].is_mapped() || u64::from(punit) >= geo.unit_count {
                                return Err(bad("page entry"));
                            }
                            page.entries[i] = Entry { punit, bitmap: e.bitmap.get() };
                        }
                        let page = Arc::new(page);
                        pages.push(page.clone());
                        let vol = volumes.get_mut(&h.volume.get()).ok_or_else(|| bad("page (unknown volume)"))?;
                        put_page(vol, h.page_index.get(), page, geo.unit_size).map_err(|_| bad("page (index)"))?;
                    }
                    REC_PAGE_REF => {
                        let r = PageRefRec::read_from_bytes(body).map_err(|_| bad("page ref"))?;
                        let page = pages.get(r.page_id.get() as usize).cloned().ok_or_else(|| bad("page ref"))?;
                        page.owners.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                        let vol = volumes.get_mut(&r.volume.get()).ok_or_else(|| bad("page ref (unknown volume)"))?;
                        put_page(vol, r.page_index.get(), page, geo.unit_size).map_err(|_| bad("page ref (index)"))?;
                    }
                    REC_REFCOUNTS => {
                        for e in <[RefcountEntry]>::ref_from_bytes(body).map_err(|_| bad("refcounts"))? {
                            let (u, r) = (e.unit.get(), e.refcount.get());
                            if u >= geo.unit_count || alloc.refcount(u as u32) != 0 || r == 0 || r == META {
                                return Err(Error::corrupt(format!(
                                    "checkpoint refcount entry for unit {u} is out of range, repeated or invalid ({r})"
                                )));
                            }
                            alloc.set_loaded(u as u32, r);
                            stored_refcounts += 1;
                        }
                    }
                    REC_END => {
                        let e = EndRec::read_from_bytes(body).map_err(|_| bad("end"))?;
                        ended = Some(e.clone());
                        expected_chunks = e.chunks.get();
                    }
                    k => return Err(Error::corrupt(format!("checkpoint chunk {index}: unknown record kind {k}"))),
                }
            }
            unit = h.next_unit.get();
            index += 1;
        }
        let Some(end) = ended else {
            return Err(Error::corrupt("checkpoint has no end record (incomplete)"));
        };
        if end.chunks.get() != index
            || sb.checkpoint_chunks.get() != index
            || end.volumes.get() != volumes.len() as u64
            || end.pages.get() != pages.len() as u64
            || end.refcounts.get() != stored_refcounts
        {
            return Err(Error::corrupt("checkpoint totals do not match its contents"));
        }
    }
    let derived = derive_refcounts(volumes.values().map(|v| &v.map), geo.unit_count as usize);
    // Reads every entry of both tables; pages never written stay non-resident.
    let mut refcount_mismatches = Vec::new();
    for u in 0..geo.unit_count as u32 {
        let derived = derived.refcount(u);
        let stored = match alloc.refcount(u) {
            META if derived > 0 => {
                return Err(Error::corrupt(format!("data unit {u} is both mapped and part of the checkpoint")));
            }
            META => 0,
            r => r,
        };
        if stored != derived {
            refcount_mismatches.push((u as u64, stored, derived));
        }
    }
    drop(derived);
    // Kept up to date through replay by the table changes and the records below.
    alloc.counts = MetaCounts::of(volumes.values().map(|v| (&v.map, v.name.len())));
    let mut state = State { volumes, next_volume, alloc, unit_size: geo.unit_size };
    // Replay the log.
    let version = sb.version.get();
    let mut log = LogCursor { head: sb.log_head.get(), pos: sb.log_head.get(), seq: sb.checkpoint_seq.get() };
    let mut batches = 0;
    // The commit index the next batch may carry besides 0 (a new commit); the first
    // batch after a checkpoint begins a commit.
    let mut next_index = 0u16;
    loop {
        let found = read_batch(read, &geo, version, log.pos, log.seq + 1)?.map(|b| (log.pos, b));
        let found = match found {
            Some(f) => Some(f),
            None if !log.pos.is_multiple_of(geo.log_size) => {
                let next_lap = log.pos + (geo.log_size - log.pos % geo.log_size);
                read_batch(read, &geo, version, next_lap, log.seq + 1)?.map(|b| (next_lap, b))
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
    state.alloc.release_all();
    let (log_warning, highest_seq) = batches_beyond(read, &geo, version, &log, later_commits)?;
    Ok(Loaded {
        sb,
        geo,
        state,
        log,
        checkpoint_units,
        refcount_mismatches,
        batches,
        superblock_warning: None,
        log_warning,
        highest_seq,
    })
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
/// sequence number of any valid batch found (at least `log.seq`). Reads the log once, a
/// MiB at a time.
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
        return Ok((warning, last));
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
    Ok((warning, last))
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

/// Encodes one commit's records into log batches (header + payload padded to whole
/// blocks), with sequence numbers from `first_seq` and commit indexes from 0. Each
/// batch is at most [`MAX_BATCH_BYTES`]. Errors: a malformed record, or more than
/// 65,536 batches (64 GiB of records).
pub(crate) fn encode_batches(records: &[u8], first_seq: u64, pool_tag: u64) -> Result<Vec<Vec<u8>>> {
    let max_payload = MAX_BATCH_BYTES - size_of::<BatchHeader>();
    let mut out = Vec::new();
    let mut rest = records;
    let mut seq = first_seq;
    while !rest.is_empty() {
        // Cut at a record boundary.
        let mut cut = 0;
        while cut < rest.len() {
            let (h, _) =
                RecordHeader::read_from_prefix(&rest[cut..]).map_err(|_| Error::corrupt("bad pending record"))?;
            let next = cut + size_of::<RecordHeader>() + h.len.get() as usize;
            if next > max_payload {
                break;
            }
            cut = next;
        }
        let payload = &rest[..cut];
        let total = size_of::<BatchHeader>() + payload.len();
        let blocks = total.div_ceil(BLOCK_SIZE as usize);
        let mut h = BatchHeader {
            magic: LOG_MAGIC.into(),
            crc: 0.into(),
            seq: seq.into(),
            pool_tag: pool_tag.into(),
            payload_len: (payload.len() as u32).into(),
            blocks: (blocks as u16).into(),
            commit_index: u16::try_from(out.len())
                .map_err(|_| Error::corrupt("a commit of more than 65,536 log batches"))?
                .into(),
        };
        h.crc = crc32c::crc32c_append(crc(h.as_bytes()), payload).into();
        let mut b = Vec::with_capacity(blocks * BLOCK_SIZE as usize);
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(payload);
        b.resize(blocks * BLOCK_SIZE as usize, 0);
        out.push(b);
        rest = &rest[cut..];
        seq += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random states, each of volumes, snapshots and clones of them with mapping pages
    /// from empty to full and names up to the longest: the checkpoint never takes more
    /// chunks than the bound the room for metadata is sized by, for every unit size.
    #[test]
    fn a_checkpoint_never_takes_more_chunks_than_its_bound() {
        let mut rng = crate::testing::Rng::new(0x5eed_c0de);
        for round in 0..300 {
            let unit_size = [16u64 << 10, 32 << 10, 64 << 10, 128 << 10][round % 4];
            let units = 1 << 16;
            let mut st = State { volumes: BTreeMap::new(), next_volume: 1, alloc: Allocator::new(units), unit_size };
            // Every fourth round the worst case: full pages only, each record a little
            // more than half a 16 KiB chunk, so that every chunk holds one.
            let dense = round % 8 < 2;
            let tables = if dense { 1 } else { 1 + rng.below(6) as usize };
            for t in 0..tables {
                let name_len = 1 + rng.below(257) as usize;
                let map = if t > 0 && rng.chance(50) {
                    let src = st.volumes.values().next().expect("a volume").map.share(&mut st.alloc);
                    src
                } else {
                    let mut map = MapTable::new();
                    for k in 0..if dense { 40 } else { rng.below(12) } {
                        let page = if dense { k } else { rng.below(40) };
                        let fill = if dense { 512 } else { [1, 8, 100, 512][rng.index(4)] };
                        for i in 0..fill {
                            let lunit = page * PAGE_ENTRIES as u64 + (i * 7919 + rng.below(3)) % PAGE_ENTRIES as u64;
                            if map.get(lunit).is_mapped() {
                                continue;
                            }
                            let Some(p) = st.alloc.alloc() else { break };
                            map.set(lunit, Entry { punit: p, bitmap: 1 }, &mut st.alloc);
                        }
                    }
                    map
                };
                st.alloc.counts.volumes += 1;
                st.alloc.counts.name_bytes += name_len as u64;
                let name = "n".repeat(name_len);
                st.volumes.insert(t as u64 + 1, VolumeMeta { name, snapshot: false, size: 1 << 40, created: 0, map });
            }
            // A shared table changed after the share copies pages.
            if let Some(v) = st.volumes.values_mut().last().filter(|_| !dense) {
                for lunit in (0..40 * PAGE_ENTRIES as u64).step_by(997) {
                    if v.map.get(lunit).is_mapped() {
                        v.map.set(lunit, Entry::EMPTY, &mut st.alloc);
                    }
                }
            }
            assert_eq!(
                st.alloc.counts,
                MetaCounts::of(st.volumes.values().map(|v| (&v.map, v.name.len()))),
                "counts kept by the table changes"
            );
            let payload = unit_size as usize - size_of::<ChunkHeader>();
            let (mut chunks, mut bytes) = (0u64, 0u64);
            st.encode_checkpoint(payload, &mut |body, _| {
                chunks += 1;
                bytes += body.len() as u64;
                Ok(())
            })
            .unwrap();
            let bound_bytes = checkpoint_bytes_bound(&st.alloc.counts, st.alloc.used);
            let bound = checkpoint_units_bound(bound_bytes, unit_size);
            assert!(bytes <= bound_bytes, "round {round}: {bytes} bytes of records, bound {bound_bytes}");
            assert!(chunks <= bound, "round {round}: {chunks} chunks of {unit_size} bytes, bound {bound}");
        }
    }

    #[test]
    fn records_round_trip() {
        let recs = vec![
            Record::Volume { volume: 3, size: 1 << 30, created: 5, name: "vol-a".into() },
            Record::Map { volume: 3, lunit: 9, punit: 77, bitmap: 0b1011 },
            Record::Unmap { volume: 3, lunit: 9 },
            Record::VolumeResize { volume: 3, size: 2 << 30 },
            Record::VolumeDelete { volume: 3 },
        ];
        let mut buf = Vec::new();
        for r in &recs {
            r.encode(&mut buf);
        }
        let back: Vec<Record> =
            split_records(&buf).unwrap().into_iter().map(|(k, b)| Record::decode(k, b).unwrap()).collect();
        assert_eq!(back, recs);
    }

    /// The superblock slots of a 64 MiB pool image, with generations 0 and 1.
    fn created_slots() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.img");
        let opts = crate::PoolOptions { size: 64 << 20, ..Default::default() };
        crate::Pool::create(&path, &opts).unwrap().close().unwrap();
        let mut img = std::fs::read(&path).unwrap();
        img.truncate(2 * BLOCK_SIZE as usize);
        // As creation leaves them (the open and close since moved them on).
        set_generation(&mut img, 0, 0);
        set_generation(&mut img, BLOCK_SIZE as usize, 1);
        img
    }

    /// `read_superblock` over `slots` (the first 8 KiB of a 64 MiB pool).
    fn pick(slots: &[u8], accept_rollback: bool) -> Result<(u64, Option<String>)> {
        let mut read = |off: u64, len: usize| Ok(slots[off as usize..off as usize + len].to_vec());
        read_superblock(&mut read, 64 << 20, accept_rollback).map(|(sb, _, w, _)| (sb.generation.get(), w))
    }

    /// Rewrites the slot at `off` of `slots` with generation `gen` (checksum updated).
    fn set_generation(slots: &mut [u8], off: usize, gen: u64) {
        let mut sb = Superblock::read_from_bytes(&slots[off..off + size_of::<Superblock>()]).unwrap();
        sb.generation = gen.into();
        sb.crc = sb.compute_crc().into();
        slots[off..off + size_of::<Superblock>()].copy_from_slice(sb.as_bytes());
    }

    #[test]
    fn a_damaged_superblock_slot_opens_only_when_it_cannot_have_been_newer() {
        let base = created_slots();
        let (s0, s1) = (0usize, BLOCK_SIZE as usize);
        // Both valid: the higher generation.
        let mut img = base.clone();
        set_generation(&mut img, s0, 6);
        set_generation(&mut img, s1, 7);
        assert_eq!(pick(&img, false).unwrap(), (7, None));
        // The older slot (6) damaged, its generation field intact: opens with a warning.
        let mut older = img.clone();
        older[s0 + 40] ^= 0x10;
        let (gen, warning) = pick(&older, false).unwrap();
        assert_eq!(gen, 7);
        assert!(warning.unwrap().contains("slot 0 is damaged (superblock checksum mismatch)"));
        // The newer slot (7) damaged: refused, unless a rollback to 6 is accepted.
        let mut newer = img.clone();
        newer[s1 + 40] ^= 0x10;
        let e = pick(&newer, false).unwrap_err();
        assert!(e.message().contains("slot 1 is damaged") && e.message().contains("may hold a newer generation"));
        let (gen, warning) = pick(&newer, true).unwrap();
        assert_eq!(gen, 6);
        assert!(warning.unwrap().contains("the metadata committed after generation 6 is lost"));
        // A damaged slot whose generation field does not read one below: refused.
        let mut unknown = img.clone();
        unknown[s0..s0 + 8].copy_from_slice(b"XXXXXXXX");
        assert!(pick(&unknown, false).is_err());
        // A create cut short: one slot never written, the other generation 0 or 1.
        for (zeroed, gen) in [(s1, 0), (s0, 1)] {
            let mut cut = base.clone();
            cut[zeroed..zeroed + BLOCK_SIZE as usize].fill(0);
            let (g, warning) = pick(&cut, false).unwrap();
            assert_eq!(g, gen);
            assert!(warning.unwrap().contains("creation was cut short"));
        }
        // The same zeroed slot beside a later generation is damage, not a cut create.
        let mut late = img.clone();
        late[s0..s0 + BLOCK_SIZE as usize].fill(0);
        assert!(pick(&late, false).is_err());
    }

    /// A crash while a commit writes its batches can leave an early batch torn and a
    /// later one of the same commit complete behind it: the normal end of a log, loaded
    /// without a warning, with the batches before the torn one replayed. A batch of a
    /// commit that began after the torn one proves damage and is refused, and so is a
    /// batch whose commit index does not follow the batch before it.
    #[test]
    fn torn_commits_of_several_batches_load_and_later_commits_are_refused() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.img");
        let opts = crate::PoolOptions { size: 512 << 20, ..Default::default() };
        crate::Pool::create(&path, &opts).unwrap().close().unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let size = file.metadata().unwrap().len();
        let loaded = load(&mut crate::pool::read_at_file(&file), size, Accept::default()).unwrap();
        let (geo, log) = (loaded.geo.clone(), loaded.log);
        let mut clean_log = vec![0u8; geo.log_size as usize];
        file.read_exact_at(&mut clean_log, geo.log_offset).unwrap();

        // Commit A: a volume created and then grown 131,072 times (about 2.5 MiB of
        // records, three batches); commit B after it: one more growth.
        let id = 1000;
        let mut a = Vec::new();
        Record::Volume { volume: id, size: 4096, created: 0, name: "torn".into() }.encode(&mut a);
        let growths = 1u64 << 17;
        for k in 0..growths {
            Record::VolumeResize { volume: id, size: 4096 * (k + 2) }.encode(&mut a);
        }
        let mut b = Vec::new();
        Record::VolumeResize { volume: id, size: 4096 * (growths + 2) }.encode(&mut b);
        let batches_a = encode_batches(&a, log.seq + 1, geo.pool_tag()).unwrap();
        assert_eq!(batches_a.len(), 3);
        let batches_b = encode_batches(&b, log.seq + 4, geo.pool_tag()).unwrap();
        // Writes `batches` one after another from the log's end; `damaged` gets a payload
        // byte flipped (a torn write).
        let put = |batches: &[&Vec<u8>], damaged: Option<usize>| {
            file.write_all_at(&clean_log, geo.log_offset).unwrap();
            let mut pos = log.pos;
            for (i, batch) in batches.iter().enumerate() {
                let mut batch = batch.to_vec();
                if damaged == Some(i) {
                    batch[100] ^= 1;
                }
                assert!(pos % geo.log_size + batch.len() as u64 <= geo.log_size);
                file.write_all_at(&batch, geo.log_offset + pos % geo.log_size).unwrap();
                pos += batch.len() as u64;
            }
        };
        let load_now = || load(&mut crate::pool::read_at_file(&file), size, Accept::default());
        // The size of volume `id` after replay, or None.
        let size_of_torn = |l: &Loaded| l.state.volumes.get(&id).map(|v| v.size);
        let all: Vec<&Vec<u8>> = batches_a.iter().chain(&batches_b).collect();

        // Intact: everything replays.
        put(&all, None);
        let l = load_now().unwrap();
        assert_eq!((l.batches, size_of_torn(&l)), (4, Some(4096 * (growths + 2))));
        assert!(l.log_warning.is_none());
        // A torn at its first batch, its later batches complete: nothing of A, no warning.
        put(&all[..3], Some(0));
        let l = load_now().unwrap();
        assert_eq!((l.batches, size_of_torn(&l)), (0, None));
        assert!(l.log_warning.is_none(), "{:?}", l.log_warning);
        // A torn at its second batch: the first one replays.
        put(&all[..3], Some(1));
        let l = load_now().unwrap();
        assert_eq!(l.batches, 1);
        assert!(size_of_torn(&l).is_some_and(|s| s > 4096 && s < 4096 * (growths + 1)));
        assert!(l.log_warning.is_none(), "{:?}", l.log_warning);
        // The same with commit B behind it: A was complete before B began, so its
        // second batch was damaged afterwards.
        put(&all, Some(1));
        let e = load_now().err().expect("a commit behind a damaged batch was accepted");
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        let named = format!(
            "log batch {} is damaged or missing, but the commit that begins at batch {}",
            log.seq + 2,
            log.seq + 4
        );
        assert!(e.message().contains(&named), "{e}");
        // A's second batch alone, renumbered to follow the checkpoint: it says it is
        // batch 1 of a commit whose batch 0 is not there.
        let shifted = encode_batches(&a, log.seq, geo.pool_tag()).unwrap();
        put(&[&shifted[1]], None);
        let e = load_now().err().expect("a batch out of its commit's order was accepted");
        assert!(
            e.message().contains("says it is batch 1 of its commit, but it is the first batch after the checkpoint"),
            "{e}"
        );
        // A valid batch numbered past the range (damage under a recomputed checksum) is
        // refused, not left to overflow the checkpoint's jump past it.
        let far = encode_batches(&b, 1 << 63, geo.pool_tag()).unwrap();
        put(&[&far[0]], None);
        let e = load_now().err().expect("a batch numbered 2^63 was accepted");
        assert!(e.message().contains("out of range"), "{e}");
    }

    #[test]
    fn truncated_records_are_corrupt() {
        let mut buf = Vec::new();
        Record::Unmap { volume: 1, lunit: 2 }.encode(&mut buf);
        buf.pop();
        assert!(split_records(&buf).is_err());
    }
}
