//! The superblock: the pool's geometry from a validated slot ([`Geometry`],
//! [`validate_superblock`]) and the choice of the current slot ([`read_superblock`],
//! docs/on-disk-format.md 7.1). Not here: writing superblocks (the store's checkpoint).

use zerocopy::{FromBytes, IntoBytes};

use crate::error::{Error, Result};
use crate::format::*;

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
        return Err(Error::not_a_pool("not a ferrovol pool: superblock magic is missing"));
    }
    let version = sb.version.get();
    if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
        let newer = if version > FORMAT_VERSION {
            ": it was written by a newer ferrovol, and a pool is never downgraded; open it with that version or a later one"
        } else {
            ""
        };
        return Err(Error::corrupt(format!(
            "pool format version {version} is not supported by this build (it reads versions {MIN_READ_VERSION} to {FORMAT_VERSION}){newer}"
        )));
    }
    if sb.compute_crc() != sb.crc.get() {
        return Err(Error::corrupt("superblock checksum mismatch"));
    }
    let unknown = unknown_incompat(sb);
    if unknown != 0 {
        return Err(Error::corrupt(format!(
            "pool uses incompatible features {unknown:#x} this build does not know: it was written by a newer \
             ferrovol; open it with that version or a later one"
        )));
    }
    if version < FEATURES_VERSION && (sb.compat_features.get() != 0 || sb.ro_compat_features.get() != 0) {
        return Err(Error::corrupt(format!(
            "superblock of format version {version} holds feature bits in its reserved bytes"
        )));
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
/// Both slots are always written (at create, then by every checkpoint: both, the slot
/// of the new generation first, when the pool has ditto copies, [`INCOMPAT_DITTO`];
/// alternately before), so one invalid slot means damage. With ditto copies the valid
/// slot is then the current one, or the one before a checkpoint cut between its two
/// superblock writes, whose checkpoint is still whole: it opens, with a warning (the
/// open writes both slots again). So does a valid slot one generation older than the
/// other (the same cut). Without them, a damaged slot may have held the newer
/// generation, and opening from the other would silently roll the pool back: when
/// only one slot is valid (generation `G`), the other is tolerated only if it is
/// recognisably the older one (its magic intact and its generation field reading
/// `G - 1`), or if it is all zeros with `G` 0 or 1 (a pool whose creation was cut
/// short: it names no checkpoint); otherwise the open fails unless `accept_rollback`.
///
/// Errors: [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) naming each slot's problem.
pub(crate) fn read_superblock(
    read: &mut ReadAt<'_>,
    size: u64,
    accept_rollback: bool,
) -> Result<(Superblock, Geometry, Option<String>, SlotRead)> {
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
            let (gens, same) = (
                (slots[newer].0.generation.get(), slots[1 - newer].0.generation.get()),
                slots[0].0.as_bytes() == slots[1].0.as_bytes(),
            );
            let (sb, g) = slots.swap_remove(newer);
            let warning = (has_ditto(&sb) && !same).then(|| {
                format!(
                    "superblock slot {} holds generation {}, slot {newer} generation {}: a checkpoint was cut between \
                     its two superblock writes; opened from slot {newer}, and the open writes both slots again",
                    1 - newer,
                    gens.1,
                    gens.0
                )
            });
            return Ok((sb, g.expect("valid"), warning, SlotRead::Newer));
        }
        (Err(a), Err(b)) => {
            let message = format!("slot 0: {}; slot 1: {}", a.message(), b.message());
            if a.is_not_a_pool() && b.is_not_a_pool() {
                return Err(Error::not_a_pool(message));
            }
            return Err(Error::corrupt(message));
        }
        (Ok(_), Err(_)) => (0, 1),
        (Err(_), Ok(_)) => (1, 0),
    };
    let gen = slots[v].0.generation.get();
    let damaged = &slots[d].0;
    let problem = slots[d].1.as_ref().err().map(|e| e.message().to_owned()).unwrap_or_default();
    let read_gen = damaged.generation.get();
    let note = format!("superblock slot {d} is damaged ({problem})");
    let mut how = SlotRead::AroundDamaged;
    let warning = if damaged.magic == SUPERBLOCK_MAGIC && read_gen.checked_add(1) == Some(gen) {
        format!(
            "{note}; its generation field reads {read_gen}, one older than slot {v}'s {gen}: opened from slot {v}, \
             and the next checkpoint rewrites slot {d}"
        )
    } else if written_by_newer_build(damaged) {
        // Not damage: a newer build wrote it (perhaps one slot of two so far). Rolling
        // back to the other slot would have this build write over that build's pool.
        return Err(Error::corrupt(format!(
            "{note}: it was written by a newer ferrovol, with generation {read_gen} against slot {v}'s {gen}; \
             a pool is never downgraded, nor rolled back over a newer build's slot: open it with that version or \
             a later one"
        )));
    } else if has_ditto(&slots[v].0) {
        // Both slots are written at every checkpoint, the other slot only once this
        // one is durable, and a checkpoint's units are freed only after both: the
        // damaged slot held this generation, the one before, or the next one of a
        // checkpoint cut between the two writes, whose predecessor (this one) is still
        // whole, with the log it replays. Only a second fault (the other slot's write
        // lost by the disk, or a crash in the checkpoint of the open after a cut,
        // which may write over the older checkpoint's units, beside a damaged newer
        // slot) leaves commits of a later generation behind that log, or a checkpoint
        // that no longer loads: the loader refuses either, the first unless a
        // rollback is accepted.
        if accept_rollback {
            how = SlotRead::RolledBack;
        }
        format!("{note}; its copy in slot {v} (generation {gen}) was read, and the open writes both slots again")
    } else if gen <= 1 && damaged.as_bytes().iter().all(|&b| b == 0) {
        // Creation writes generation 0 and 1 (both naming no checkpoint) with one sync
        // after both: either may be missing after a cut, and neither holds anything.
        format!("{note}: never written (the pool's creation was cut short); opened from slot {v}, generation {gen}")
    } else if accept_rollback {
        how = SlotRead::RolledBack;
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
    Ok((sb, g.expect("valid"), Some(warning), how))
}

/// Which slot [`read_superblock`] read, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotRead {
    /// Both slots valid: the one with the newer generation.
    Newer,
    /// One slot damaged (or never written): the other, which holds the current
    /// generation or, as far as one fault can tell, the one before it.
    AroundDamaged,
    /// One slot damaged that may have held a newer generation: the other, as a
    /// superblock rollback was accepted. What was committed after it may be lost.
    RolledBack,
}

/// Whether `sb` is a slot of a newer build rather than damage: the pool magic with a
/// version above this build's (whatever its checksum layout), or a valid checksum with
/// incompatible features this build does not know.
fn written_by_newer_build(sb: &Superblock) -> bool {
    sb.magic == SUPERBLOCK_MAGIC
        && (sb.version.get() > FORMAT_VERSION || (sb.compute_crc() == sb.crc.get() && unknown_incompat(sb) != 0))
}

/// Whether `sb` names a checkpoint with ditto copies, whose superblock is written into
/// both slots ([`INCOMPAT_DITTO`]).
pub(crate) fn has_ditto(sb: &Superblock) -> bool {
    sb.incompat_features.get() & INCOMPAT_DITTO != 0
}

/// The incompatible features of `sb` this build does not know: a pool with any is
/// refused.
fn unknown_incompat(sb: &Superblock) -> u64 {
    sb.incompat_features.get() & !INCOMPAT_FEATURES_KNOWN
}

/// The read-only-compatible features of `sb` this build does not know: a pool with any
/// may be read (checked) but not opened, since an open writes (commits, checkpoints).
pub(crate) fn unknown_ro_compat(sb: &Superblock) -> u64 {
    sb.ro_compat_features.get() & !RO_COMPAT_FEATURES_KNOWN
}
