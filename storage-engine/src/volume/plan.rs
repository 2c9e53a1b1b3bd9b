//! I/O plans as values: what a read or a write of whole 4 KiB blocks does, computed by
//! pure functions from a volume's mapping table (under its map lock), then executed by
//! the caller with no lock held (mod.rs). A plan names the segments of the pool to read
//! or write, the data units to pin while it runs, and for a write the blocks written for
//! the first time and the units that must be copied on write.
//!
//! Not here: executing plans (mod.rs), copying a unit (cow.rs), locks (locks.rs).
//! Units as in mod.rs: blocks are 4 KiB, `lunit` a unit of the volume, `punit` a data
//! unit of the pool; block `b0` of a plan sits at byte 0 of its buffer.

use crate::format::BLOCK_SIZE;
use crate::io::Segment;
use crate::journal::Geometry;
use crate::meta::MapTable;

/// A read of blocks `[b0, b1)`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ReadPlan {
    /// Pool segments of the written blocks, in buffer order (adjacent ones merged).
    pub segs: Vec<Segment>,
    /// Runs of blocks in order: (count, written); unwritten blocks read as zeros.
    pub runs: Vec<(u64, bool)>,
    /// Data units the segments read (to pin until the read completes).
    pub pins: Vec<u32>,
}

/// A write of whole blocks `[b0, b1)`, all of whose logical units are mapped.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct WritePlan {
    /// Pool segments written in place (into units exclusive to the volume).
    pub segs: Vec<Segment>,
    /// Data units those segments write (to pin until their bits are set).
    pub pins: Vec<u32>,
    /// `(lunit, punit, bits)`: blocks written for the first time, whose bits are set
    /// once the data is written.
    pub new_bits: Vec<(u64, u32, u32)>,
    /// `(lunit, first block, end block)` of units that may be shared: each is written by
    /// a copy on write of its own, after the in-place segments.
    pub private: Vec<(u64, u64, u64)>,
}

/// Bits `[s, e)` of a unit bitmap.
pub(crate) fn mask(s: u64, e: u64) -> u32 {
    let width = e - s;
    if width >= 32 {
        u32::MAX
    } else {
        ((1u32 << width) - 1) << s
    }
}

/// Appends a segment, merged with the last one when they are contiguous in both the
/// pool and the buffer.
pub(crate) fn push_segment(segs: &mut Vec<Segment>, file_offset: u64, buf_offset: usize, len: usize) {
    if let Some(last) = segs.last_mut() {
        if last.file_offset + last.len as u64 == file_offset && last.buf_offset + last.len == buf_offset {
            last.len += len;
            return;
        }
    }
    segs.push(Segment { file_offset, buf_offset, len });
}

/// Merges adjacent segments (ascending offsets in both the file and the buffer).
pub(crate) fn merge(segs: impl Iterator<Item = Segment>) -> Vec<Segment> {
    let mut out = Vec::new();
    for s in segs {
        push_segment(&mut out, s.file_offset, s.buf_offset, s.len);
    }
    out
}

/// Appends a pin of `u` unless it is the last one pinned.
fn push_pin(pins: &mut Vec<u32>, u: u32) {
    if pins.last() != Some(&u) {
        pins.push(u);
    }
}

/// The plan of a read of blocks `[b0, b1)` of `map`.
pub(crate) fn plan_read(map: &MapTable, geo: &Geometry, b0: u64, b1: u64) -> ReadPlan {
    let bpu = geo.blocks_per_unit();
    let mut plan = ReadPlan::default();
    let mut b = b0;
    while b < b1 {
        let lunit = b / bpu;
        let end = ((lunit + 1) * bpu).min(b1);
        let e = map.get(lunit);
        for blk in b..end {
            let i = blk % bpu;
            let written = e.is_mapped() && e.bitmap & (1 << i) != 0;
            if written {
                push_pin(&mut plan.pins, e.punit);
                push_segment(
                    &mut plan.segs,
                    geo.unit_offset(u64::from(e.punit)) + i * BLOCK_SIZE,
                    ((blk - b0) * BLOCK_SIZE) as usize,
                    BLOCK_SIZE as usize,
                );
            }
            match plan.runs.last_mut() {
                Some((n, a)) if *a == written => *n += 1,
                _ => plan.runs.push((1, written)),
            }
        }
        b = end;
    }
    plan
}

/// The plan of a write of whole blocks `[b0, b1)` into `map`, where `in_place(map,
/// lunit, punit)` says whether a unit may be written in place
/// (`meta::writable_in_place` in the engine). `Err` with the logical units of the range
/// that are unmapped (ascending), if any is: the caller allocates exactly those, and
/// plans again under the lock it allocated them under.
pub(crate) fn plan_write(
    map: &MapTable,
    geo: &Geometry,
    b0: u64,
    b1: u64,
    in_place: impl Fn(&MapTable, u64, u32) -> bool,
) -> Result<WritePlan, Vec<u64>> {
    let bpu = geo.blocks_per_unit();
    let mut plan = WritePlan::default();
    let mut unmapped = Vec::new();
    for u in b0 / bpu..(b1 - 1) / bpu + 1 {
        let e = map.get(u);
        if !e.is_mapped() {
            unmapped.push(u);
            continue;
        }
        if !unmapped.is_empty() {
            continue; // the plan is thrown away: only the unmapped units count
        }
        let s = (u * bpu).max(b0);
        let end = ((u + 1) * bpu).min(b1);
        if !in_place(map, u, e.punit) {
            plan.private.push((u, s, end));
            continue;
        }
        let m = mask(s - u * bpu, end - u * bpu);
        push_pin(&mut plan.pins, e.punit);
        push_segment(
            &mut plan.segs,
            geo.unit_offset(u64::from(e.punit)) + (s - u * bpu) * BLOCK_SIZE,
            ((s - b0) * BLOCK_SIZE) as usize,
            ((end - s) * BLOCK_SIZE) as usize,
        );
        if e.bitmap & m != m {
            plan.new_bits.push((u, e.punit, m));
        }
    }
    if unmapped.is_empty() {
        Ok(plan)
    } else {
        Err(unmapped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::{writable_in_place, Allocator, Entry};

    /// Units of 64 KiB (16 blocks) from byte 1 MiB of the pool.
    fn geo() -> Geometry {
        Geometry {
            uuid: [0; 16],
            pool_size: 1 << 30,
            unit_size: 64 * 1024,
            log_offset: 1 << 20,
            log_size: 4 << 20,
            data_offset: 8 << 20,
            unit_count: 1000,
        }
    }

    fn unit_at(g: &Geometry, punit: u32, block: u64) -> u64 {
        g.unit_offset(u64::from(punit)) + block * BLOCK_SIZE
    }

    #[test]
    fn a_read_of_written_and_unwritten_blocks_plans_segments_and_zero_runs() {
        let g = geo();
        let mut a = Allocator::new(1000);
        let mut map = MapTable::new();
        // Unit 0 -> data unit 7 with blocks 0, 1 and 15 written; unit 1 unmapped.
        map.set(0, Entry { punit: 7, bitmap: 0b11 | 1 << 15 }, &mut a);
        let plan = plan_read(&map, &g, 0, 20);
        assert_eq!(plan.runs, vec![(2, true), (13, false), (1, true), (4, false)]);
        assert_eq!(
            plan.segs,
            vec![
                Segment { file_offset: unit_at(&g, 7, 0), buf_offset: 0, len: 8192 },
                Segment { file_offset: unit_at(&g, 7, 15), buf_offset: 15 * 4096, len: 4096 },
            ]
        );
        assert_eq!(plan.pins, vec![7], "each data unit read is pinned once");
    }

    #[test]
    fn a_write_over_a_unit_shared_with_a_snapshot_plans_a_copy_not_an_in_place_segment() {
        let g = geo();
        let mut a = Allocator::new(1000);
        let (p0, p1) = (a.alloc().unwrap(), a.alloc().unwrap());
        let mut map = MapTable::new();
        map.set(0, Entry { punit: p0, bitmap: u32::MAX }, &mut a);
        map.set(1, Entry { punit: p1, bitmap: 1 }, &mut a);
        let (rc, settling) = (a.refcount_table(), a.settling_table());
        let in_place = |m: &MapTable, l: u64, p: u32| writable_in_place(m, l, p, &rc, &settling);
        // Exclusive to the volume: both units in place; unit 1 gains blocks 1..4 (its
        // bits are set for the blocks written, 0..4).
        let plan = plan_write(&map, &g, 8, 20, in_place).unwrap();
        assert!(plan.private.is_empty());
        assert_eq!(plan.pins, vec![p0, p1]);
        assert_eq!(plan.new_bits, vec![(1, p1, 0b1111)]);
        assert_eq!(
            plan.segs,
            vec![Segment { file_offset: unit_at(&g, p0, 8), buf_offset: 0, len: 12 * 4096 }],
            "contiguous data units make one segment"
        );
        // A snapshot shares the page: nothing in place, both units copied on write.
        let _snapshot = map.share(&mut a);
        let plan = plan_write(&map, &g, 8, 20, in_place).unwrap();
        assert!(plan.segs.is_empty() && plan.pins.is_empty() && plan.new_bits.is_empty(), "{plan:?}");
        assert_eq!(plan.private, vec![(0, 8, 16), (1, 16, 20)]);
    }

    #[test]
    fn a_write_into_unmapped_units_plans_nothing_but_names_them() {
        let g = geo();
        let mut a = Allocator::new(1000);
        let mut map = MapTable::new();
        map.set(0, Entry { punit: 3, bitmap: 1 }, &mut a);
        map.set(2, Entry { punit: 4, bitmap: 1 }, &mut a);
        // Blocks 0..64: units 0 to 3 of 16 blocks; 1 and 3 unmapped.
        assert_eq!(plan_write(&map, &g, 0, 64, |_, _, _| true), Err(vec![1, 3]));
    }

    #[test]
    fn masks_cover_their_blocks() {
        assert_eq!(mask(0, 32), u32::MAX);
        assert_eq!(mask(1, 4), 0b1110);
        assert_eq!(mask(15, 16), 1 << 15);
    }
}
