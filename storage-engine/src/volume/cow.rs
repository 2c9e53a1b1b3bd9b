//! Copy on write of one logical unit (docs/on-disk-format.md 10.3): a write into a unit
//! that may be shared with a snapshot or clone goes into a fresh data unit, with the old
//! unit's other written blocks copied beside it, and the fresh unit then replaces the
//! shared one in this volume's mapping; a unit found exclusive meanwhile is written in
//! place. Not here: the decision (the plan's `in_place`), allocation's room (the store).

use std::sync::atomic::Ordering;

use super::{locks, mask, plan, Pins, Volume};
use crate::error::{Error, ErrorKind, Result};
use crate::format::BLOCK_SIZE;
use crate::io::{AlignedBuf, Dir, Segment};
use crate::meta::Entry;
use crate::store::room::{self, NeedRoom, Room};
use crate::store::worker_gone;

/// One logical unit's part of a write: blocks `[s, e)` (relative to the unit) of
/// logical unit `lunit`, from `data` (`(e - s)` blocks); `offset` is the request's, for
/// errors.
#[derive(Clone, Copy)]
pub(super) struct UnitWrite<'a> {
    pub lunit: u64,
    pub s: u64,
    pub e: u64,
    pub data: &'a [u8],
    pub offset: u64,
}

impl Volume {
    /// Writes blocks `[s, e)` (relative to the unit) of logical unit `lunit` from `data`
    /// when the unit may be shared: if it is, the written blocks the write does not
    /// cover are copied with the new data into a fresh data unit, which then replaces
    /// the shared one in this volume's mapping (copy on write; only written blocks are
    /// copied). Also handles the unit having been unmapped or made exclusive meanwhile.
    pub(super) async fn write_private(&self, w: &UnitWrite<'_>) -> Result<()> {
        let full = || Error::new(ErrorKind::NoSpace, "no free data unit for copy-on-write");
        let attempt = || self.write_private_once(w);
        while !self.store.with_room(attempt, full).await.map_err(|e| self.err(e, "write", w.offset))? {}
        Ok(())
    }

    /// One attempt of [`Volume::write_private`]: `Room::Need` when it found no room for
    /// a fresh unit (nothing changed); `Done(false)` asks for another (another writer
    /// mapped the unit meanwhile).
    async fn write_private_once(&self, w: &UnitWrite<'_>) -> Result<Room<bool>> {
        let UnitWrite { lunit, s, e, data, .. } = *w;
        let g = self.store.geo();
        let us = g.unit_size as usize;
        let bs = BLOCK_SIZE as usize;
        let _unit_lock =
            self.store.cow_stripes()[locks::stripe_of(self.vol.id, lunit, self.store.cow_stripes().len())].lock().await;
        let old = self.vol.map.read().get(lunit);
        let exclusive = old.is_mapped() && self.writable_in_place(&self.vol.map.read(), lunit, old.punit);
        let mut buf = AlignedBuf::zeroed(us);
        buf.full_mut()[s as usize * bs..e as usize * bs].copy_from_slice(data);
        let mut pins = Pins::new(&self.store);
        if exclusive {
            pins.add(old.punit);
            return self.write_in_place(w, old, buf, pins).await.map(Room::Done);
        }
        drop(pins);
        // A fresh unit, and room for what installing it may add (its refcount, a copy
        // of the mapping page), counted until it is installed (`finish_private`).
        if self.store.host_full() {
            self.store.refill_backed_free();
        }
        let got = {
            let mut a = self.store.alloc();
            if self.store.data_room(&a, 1) && self.store.has_room(&a, room::COW_GROWTH) {
                let p = a.alloc().expect("the free set holds one");
                a.cow_inflight.insert(p);
                a.pending_growth += room::COW_GROWTH;
                self.store.after_growth(&a);
                Some(p)
            } else {
                None
            }
        };
        let Some(target) = got else {
            return Ok(Room::Need(NeedRoom { units: 1, extra: room::COW_GROWTH }));
        };
        self.finish_private(w, old, target, buf).await.map(Room::Done)
    }

    /// Writes blocks `[s, e)` of an exclusive unit in place and records them.
    async fn write_in_place(&self, w: &UnitWrite<'_>, old: Entry, buf: AlignedBuf, pins: Pins<'_>) -> Result<bool> {
        let UnitWrite { lunit, s, e, offset, .. } = *w;
        let g = self.store.geo();
        let bs = BLOCK_SIZE as usize;
        let m = mask(s, e);
        let segs = plan::merge((s..e).map(|b| Segment {
            file_offset: g.unit_offset(u64::from(old.punit)) + b * BLOCK_SIZE,
            buf_offset: b as usize * bs,
            len: bs,
        }));
        let (_, r) = self
            .store
            .ring()
            .rw(Dir::Write { dsync: false }, buf, segs)
            .await
            .map_err(|_| self.err(worker_gone(), "write", offset))?;
        drop(pins);
        if let Err(e) = r {
            return Err(self.write_failed(e, offset));
        }
        let mut map = self.vol.map.write();
        if !self.vol.deleted.load(Ordering::Acquire) {
            self.mark_written(&mut map, lunit, old.punit, m);
        }
        Ok(true)
    }

    /// Copy on write into the fresh unit `target`: the old unit's written blocks outside
    /// `[s, e)` are copied with the new data (`buf`, a whole unit) in one write, then
    /// `target` replaces the old unit in this volume's mapping.
    async fn finish_private(&self, w: &UnitWrite<'_>, old: Entry, target: u32, mut buf: AlignedBuf) -> Result<bool> {
        let UnitWrite { lunit, s, e, offset, .. } = *w;
        let g = self.store.geo();
        let bs = BLOCK_SIZE as usize;
        let m = mask(s, e);
        let mut pins = Pins::new(&self.store);
        // Copy the old unit's written blocks that this write does not cover.
        let copy = if old.is_mapped() { old.bitmap & !m } else { 0 };
        let blocks = |bits: u32| (0..g.blocks_per_unit()).filter(move |b| bits & (1 << b) != 0);
        let result: Result<()> = async {
            if copy != 0 {
                pins.add(old.punit);
                let segs = blocks(copy).map(|b| Segment {
                    file_offset: g.unit_offset(u64::from(old.punit)) + b * BLOCK_SIZE,
                    buf_offset: b as usize * bs,
                    len: bs,
                });
                let segs = plan::merge(segs);
                let (b2, r) = self.store.ring().rw(Dir::Read, buf, segs).await.map_err(|_| worker_gone())?;
                buf = b2;
                r.map_err(|e| Error::io("copy-on-write read failed", e))?;
            }
            let segs = plan::merge(blocks(copy | m).map(|b| Segment {
                file_offset: g.unit_offset(u64::from(target)) + b * BLOCK_SIZE,
                buf_offset: b as usize * bs,
                len: bs,
            }));
            let (_, r) =
                self.store.ring().rw(Dir::Write { dsync: false }, buf, segs).await.map_err(|_| worker_gone())?;
            r.map_err(|e| self.write_failed(e, offset))
        }
        .await;
        drop(pins);
        let mut map = self.vol.map.write();
        let cur = map.get(lunit);
        let mut a = self.store.alloc();
        a.cow_inflight.remove(&target);
        a.pending_growth -= room::COW_GROWTH;
        let still = if old.is_mapped() { cur.punit == old.punit } else { !cur.is_mapped() };
        // If the old unit became this volume's alone meanwhile (its snapshot was
        // deleted), another write may have gone into it in place after our copy:
        // install nothing and write in place instead. Units never become shared again
        // while a write runs (the gate), so a unit still shared now was shared all along.
        let became_exclusive = old.is_mapped() && still && self.writable_in_place(&map, lunit, old.punit);
        if result.is_err() || !still || became_exclusive || self.vol.deleted.load(Ordering::Acquire) {
            a.decref(target);
            let deleted = self.vol.deleted.load(Ordering::Acquire);
            // A write that mapped the unit meanwhile must not be overwritten, and a unit
            // now exclusive takes the write in place: try again.
            if result.is_ok() && !deleted && (became_exclusive || (!old.is_mapped() && cur.is_mapped())) {
                return Ok(false);
            }
            // Failed, or a delete came in between (it is then the later one).
            return result.map(|()| true);
        }
        let bitmap = if old.is_mapped() { cur.bitmap | m } else { m };
        if cur.punit != target || bitmap != cur.bitmap {
            map.set(lunit, Entry { punit: target, bitmap }, &mut a);
            // Logged before the old unit loses this reference: a commit that releases a
            // settling mark the decref makes also carries this record (rule 9). The
            // allocator lock, held across both, keeps a commit's start (C1) from falling
            // between them.
            self.log_map(lunit, target, bitmap);
            if cur.is_mapped() && cur.punit != target {
                a.decref(cur.punit);
            }
        }
        Ok(true)
    }
}
