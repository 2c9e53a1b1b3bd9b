//! The log's records and batches: [`Record`] (one metadata change) and its framing,
//! [`split_records`], and [`encode_batches`] (one commit's records as log batches).
//! Not here: reading batches back (recovery.rs), checkpoint records (state.rs).

use zerocopy::{FromBytes, IntoBytes};

use crate::error::{Error, Result};
use crate::format::*;
use crate::props::Props;

/// One metadata change, as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Map {
        volume: u64,
        lunit: u64,
        punit: u32,
        bitmap: u32,
    },
    Unmap {
        volume: u64,
        lunit: u64,
    },
    Volume {
        volume: u64,
        size: u64,
        created: u32,
        name: String,
    },
    Share {
        source: u64,
        target: u64,
        size: u64,
        created: u32,
        snapshot: bool,
        name: String,
    },
    VolumeDelete {
        volume: u64,
    },
    VolumeResize {
        volume: u64,
        size: u64,
    },
    /// A volume's whole property set, replacing the one before.
    Props {
        volume: u64,
        props: Props,
    },
}

pub(super) fn push_record(out: &mut Vec<u8>, kind: u8, parts: &[&[u8]]) {
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
            Record::Props { volume, props } => push_record(out, REC_PROPS, &[&props.encode(*volume)]),
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
                // The written flag appears in checkpoints only (their loader reads it).
                if name.len() != r.name_len.get() as usize
                    || r.flags.get() & !(VOLUME_FLAG_SNAPSHOT | VOLUME_FLAG_WRITTEN) != 0
                {
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
            REC_PROPS => {
                let (volume, props) = Props::decode(body)?;
                Record::Props { volume, props }
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

/// Encodes one commit's records into log batches (header + payload padded to whole
/// blocks), with sequence numbers from `first_seq` and commit indexes from 0. Each
/// batch is at most [`MAX_BATCH_BYTES`]. No batch begins at an offset of `glued`
/// (sorted record boundaries inside runs of records that recovery must replay all or
/// none of, since it replays whole batches), unless a run alone overflows a batch.
/// Errors: a malformed record, or more than 65,536 batches (64 GiB of records).
pub(crate) fn encode_batches(records: &[u8], glued: &[usize], first_seq: u64, pool_tag: u64) -> Result<Vec<Vec<u8>>> {
    let max_payload = MAX_BATCH_BYTES - size_of::<BatchHeader>();
    let mut out = Vec::new();
    let mut rest = records;
    let mut seq = first_seq;
    while !rest.is_empty() {
        let done = records.len() - rest.len();
        // Cut at a record boundary, the last one that fits and is not glued.
        let (mut cut, mut free_cut) = (0, 0);
        while cut < rest.len() {
            let (h, _) =
                RecordHeader::read_from_prefix(&rest[cut..]).map_err(|_| Error::corrupt("bad pending record"))?;
            let next = cut + size_of::<RecordHeader>() + h.len.get() as usize;
            if next > max_payload {
                break;
            }
            cut = next;
            if glued.binary_search(&(done + cut)).is_err() {
                free_cut = cut;
            }
        }
        if cut < rest.len() && free_cut > 0 {
            cut = free_cut;
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
