//! The data path of one thin volume: read, write, trim, write zeroes, block status.
//!
//! Lives here: [`Volume`], a handle whose operations each look the mapping up under
//! the volume's own lock and return an I/O *plan* (segments of mapped data, runs of
//! zeros, units to allocate), which is then executed on io_uring with no lock held.
//! Not here: durability (the pool's committer), protocol details (the server maps
//! these calls and errors to NBD).
//!
//! Units: offsets and lengths are bytes; a *block* is 4 KiB; a *unit* is the pool's
//! allocation unit (default 64 KiB), `lunit` a unit of the volume, `punit` a data unit
//! of the pool.
//!
//! Locking: reads take only the volume's map lock shared. Writes also take the range
//! locks of their logical units (`Store::stripes`) until their bits are set:
//! shared, or exclusive for a unit whose partial block they rewrite; trims take them
//! exclusively while they clear bits. First writes to a block, trims and allocations
//! take the map lock exclusively, and allocations also take the pool's allocator lock
//! briefly. In-flight I/O pins its data units so a concurrent trim or delete cannot
//! hand them to another volume before it completes.

use std::sync::atomic::Ordering;
use std::sync::Arc;

mod cow;
mod locks;
mod plan;

use crate::error::{Error, ErrorKind, Result};
use crate::format::BLOCK_SIZE;
use crate::io::{AlignedBuf, Dir};
use crate::journal::Record;
use crate::meta::{Entry, MapTable};
use crate::props::Attachment;
use crate::store::room::{self, NeedRoom, Room};
use crate::store::{worker_gone, Store, VolState};
use cow::UnitWrite;
use locks::{Exclusive, Pins, StripeGuard};
use plan::{mask, ReadPlan, WritePlan};

/// Largest request the data path accepts in one call, in bytes (32 MiB).
pub const MAX_IO_BYTES: u64 = 32 << 20;

/// Allocation state of a run of bytes, from [`Volume::block_status`] and reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes.
    pub length: u64,
    /// True if the run holds written data; false if it is unallocated and reads as zeros.
    pub allocated: bool,
}

/// The data of a read and which parts of it are unallocated.
#[derive(Debug)]
pub struct ReadResult {
    /// The bytes (the buffer's view is exactly the requested range).
    pub data: AlignedBuf,
    /// Allocation of the range, in order, covering exactly the requested length.
    pub extents: Vec<Extent>,
}

/// A handle for I/O on one volume. Cheap to clone; stays bound to the volume it was
/// made for (after that volume is deleted, operations fail with `NotFound`).
#[derive(Clone)]
pub struct Volume {
    store: Arc<Store>,
    vol: Arc<VolState>,
}

fn push_extent(ext: &mut Vec<Extent>, length: u64, allocated: bool) {
    if length == 0 {
        return;
    }
    match ext.last_mut() {
        Some(last) if last.allocated == allocated => last.length += length,
        _ => ext.push(Extent { length, allocated }),
    }
}

impl Volume {
    pub(crate) fn new(store: Arc<Store>, vol: Arc<VolState>) -> Volume {
        Volume { store, vol }
    }

    /// Volume name.
    pub fn name(&self) -> &str {
        &self.vol.name
    }

    /// The volume's id: unique in the pool and never reused, so a volume created again
    /// under a deleted one's name has another.
    pub fn id(&self) -> u64 {
        self.vol.id
    }

    /// Current virtual size in bytes (grows with online resize).
    pub fn size(&self) -> u64 {
        self.vol.size.load(Ordering::Acquire)
    }

    /// The pool's data-unit size in bytes.
    pub fn unit_size(&self) -> u64 {
        self.store.geo().unit_size
    }

    fn err(&self, e: Error, op: &'static str, offset: u64) -> Error {
        e.op(op).volume(&self.vol.name).offset(offset)
    }

    fn check_range(&self, op: &'static str, offset: u64, len: u64) -> Result<()> {
        if self.vol.deleted.load(Ordering::Acquire) {
            return Err(self.err(Error::new(ErrorKind::NotFound, "volume was deleted"), op, offset));
        }
        let size = self.size();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(self.err(
                Error::new(ErrorKind::OutOfRange, format!("{len} bytes at {offset} exceed the volume size {size}")),
                op,
                offset,
            ));
        }
        Ok(())
    }

    /// The error of a failed data write: `NoSpace` when the host file system had no
    /// room for it (the pool goes on; what it wrote is not mapped, or is a failed write
    /// of mapped blocks, which may hold anything), else an I/O error that fails the
    /// pool (the device may have lost data).
    fn write_failed(&self, e: std::io::Error, offset: u64) -> Error {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            self.store.set_host_full();
            return self.err(room::host_full_error(), "write", offset);
        }
        let e = self.err(Error::io("pool write failed", e), "write", offset);
        self.store.fail(&e);
        e
    }

    fn deleted(&self, op: &'static str, offset: u64) -> Error {
        self.err(Error::new(ErrorKind::NotFound, "volume was deleted"), op, offset)
    }

    /// A buffer for a write of `len` bytes at `offset`: aligned, covering the whole
    /// 4 KiB blocks of the range, with its view on exactly the `len` bytes. The view's
    /// bytes are unspecified (a recycled buffer's): the caller fills all of it before
    /// [`Volume::write`]. The rest of the view's first and last blocks is zero.
    pub fn alloc_write_buf(&self, offset: u64, len: usize) -> AlignedBuf {
        let head = (offset % BLOCK_SIZE) as usize;
        let end = head + len;
        let mut b = AlignedBuf::recycled(end);
        let full = b.full_mut();
        full[..head].fill(0);
        full[end..end.div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize].fill(0);
        b.set_view(head, len);
        b
    }

    /// [`Volume::alloc_write_buf`] with the view zeroed: for writing zeros.
    fn zeroed_write_buf(&self, offset: u64, len: usize) -> AlignedBuf {
        let mut b = self.alloc_write_buf(offset, len);
        b.as_mut().fill(0);
        b
    }

    /// Reads `len` bytes at `offset`. Unwritten ranges read as zeros and are reported
    /// as unallocated extents.
    ///
    /// Errors: [`ErrorKind::OutOfRange`], [`ErrorKind::InvalidArgument`] (longer than
    /// [`MAX_IO_BYTES`]), [`ErrorKind::NotFound`] (deleted), [`ErrorKind::Io`].
    pub async fn read(&self, offset: u64, len: u64) -> Result<ReadResult> {
        self.check_range("read", offset, len)?;
        if len > MAX_IO_BYTES {
            return Err(self.err(Error::new(ErrorKind::InvalidArgument, "read longer than 32 MiB"), "read", offset));
        }
        let g = self.store.geo();
        let b0 = offset / BLOCK_SIZE;
        let b1 = (offset + len).div_ceil(BLOCK_SIZE);
        let mut buf = AlignedBuf::recycled(((b1 - b0) * BLOCK_SIZE) as usize);
        let mut pins = Pins::new(&self.store);
        let ReadPlan { segs, runs: blocks, .. } = {
            let map = self.vol.map.read();
            if self.vol.deleted.load(Ordering::Acquire) {
                return Err(self.deleted("read", offset));
            }
            let plan = plan::plan_read(&map, g, b0, b1);
            // Pinned under the map lock: no trim or delete frees them before the read.
            plan.pins.iter().for_each(|&u| pins.add(u));
            plan
        };
        // Unwritten blocks read as zeros; the written ones are all read from the pool.
        let mut at = 0;
        for &(n, allocated) in &blocks {
            let bytes = (n * BLOCK_SIZE) as usize;
            if !allocated {
                buf.full_mut()[at..at + bytes].fill(0);
            }
            at += bytes;
        }
        if !segs.is_empty() {
            let (back, r) = self
                .store
                .ring()
                .rw(Dir::Read, buf, segs)
                .await
                .map_err(|_| self.err(worker_gone(), "read", offset))?;
            buf = back;
            r.map_err(|e| self.err(Error::io("pool read failed", e), "read", offset))?;
        }
        drop(pins);
        buf.set_view((offset - b0 * BLOCK_SIZE) as usize, len as usize);
        // Block runs to byte extents clipped to [offset, offset + len).
        let mut extents = Vec::new();
        let mut pos = b0 * BLOCK_SIZE;
        for (n, allocated) in blocks {
            let s = pos.max(offset);
            let e = (pos + n * BLOCK_SIZE).min(offset + len);
            push_extent(&mut extents, e - s, allocated);
            pos += n * BLOCK_SIZE;
        }
        Ok(ReadResult { data: buf, extents })
    }

    /// Writes `buf`'s view at `offset` (the buffer must come from
    /// [`Volume::alloc_write_buf`] for that offset and length). Allocates data units on
    /// first write; with `fua` the data (and any new mapping) is durable on return.
    ///
    /// Errors: [`ErrorKind::OutOfRange`], [`ErrorKind::InvalidArgument`] (longer than
    /// [`MAX_IO_BYTES`] or a misplaced view), [`ErrorKind::NoSpace`] (only when a unit must
    /// be allocated), [`ErrorKind::Failed`], [`ErrorKind::NotFound`], [`ErrorKind::Io`].
    pub async fn write(&self, offset: u64, buf: AlignedBuf, fua: bool) -> Result<()> {
        self.check_read_only("write", offset)?;
        let _gate = self.vol.gate.read().await;
        self.write_inner(offset, buf, fua).await
    }

    fn check_read_only(&self, op: &'static str, offset: u64) -> Result<()> {
        if self.vol.snapshot {
            return Err(self.err(Error::new(ErrorKind::ReadOnly, "snapshots are read-only"), op, offset));
        }
        Ok(())
    }

    /// Whether the volume is a read-only snapshot.
    pub fn is_snapshot(&self) -> bool {
        self.vol.snapshot
    }

    /// Created empty and never written since (see [`crate::VolumeInfo::pristine`]):
    /// false from the moment a write maps a unit, before it is acknowledged.
    pub fn is_pristine(&self) -> bool {
        !self.vol.written.load(Ordering::SeqCst)
    }

    /// The nodes the volume is published to now ([`crate::Pool::attach`]).
    pub fn attachments(&self) -> Vec<Attachment> {
        self.vol.props().attachments.clone()
    }

    /// The volume's labels now ([`crate::Pool::set_label`]).
    pub fn labels(&self) -> crate::Labels {
        self.vol.props().labels.clone()
    }

    async fn write_inner(&self, offset: u64, mut buf: AlignedBuf, fua: bool) -> Result<()> {
        let len = buf.as_ref().len() as u64;
        self.check_range("write", offset, len)?;
        self.store.check_writable().map_err(|e| self.err(e, "write", offset))?;
        if len > MAX_IO_BYTES || buf.view_start() as u64 != offset % BLOCK_SIZE {
            return Err(self.err(
                Error::new(ErrorKind::InvalidArgument, "write buffer does not fit the request"),
                "write",
                offset,
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let b0 = offset / BLOCK_SIZE;
        let b1 = (offset + len).div_ceil(BLOCK_SIZE);
        let head_partial = !offset.is_multiple_of(BLOCK_SIZE);
        let tail_partial = !(offset + len).is_multiple_of(BLOCK_SIZE);
        // Range locks (`Store::stripes`), held until the bits are set: exclusive
        // for the units of partial blocks, which are read, merged and rewritten, so
        // that no concurrent write to the block is undone; shared for the rest, so a
        // trim cannot unmap a unit before this write marks its blocks.
        let bpu = self.store.geo().blocks_per_unit();
        let mut exclusive = Vec::new();
        if head_partial {
            exclusive.push(b0 / bpu);
        }
        if tail_partial {
            exclusive.push((b1 - 1) / bpu);
        }
        let _guards = self.lock_units(b0 / bpu..(b1 - 1) / bpu + 1, Exclusive::Only(&exclusive)).await;
        if head_partial {
            Box::pin(self.merge_partial_block(&mut buf, b0, 0)).await?;
        }
        if tail_partial && (b1 - 1 != b0 || !head_partial) {
            let at = ((b1 - 1 - b0) * BLOCK_SIZE) as usize;
            Box::pin(self.merge_partial_block(&mut buf, b1 - 1, at)).await?;
        }
        let view = (buf.view_start(), buf.as_ref().len());
        buf.set_view(0, ((b1 - b0) * BLOCK_SIZE) as usize);
        let r = self.write_blocks(b0, b1, buf, fua, offset).await;
        // The bits are set: a FUA write's commit needs no range lock, and holding one
        // through it would hold back every write and trim on the same stripes.
        drop(_guards);
        let (mut b, commit) = r?;
        if commit {
            Box::pin(self.store.commit()).await.map_err(|e| self.err(e, "write", offset))?;
        }
        b.set_view(view.0, view.1);
        Ok(())
    }

    /// Takes the range locks of logical units `units` of this volume (locks.rs).
    async fn lock_units(&self, units: std::ops::Range<u64>, exclusive: Exclusive<'_>) -> Vec<StripeGuard<'_>> {
        locks::lock_units(&self.store, self.vol.id, units, exclusive).await
    }

    /// Marks blocks `m` of `lunit` written, if the unit still maps `punit` (otherwise a
    /// trim or copy on write came in between and counts as the later operation), and
    /// logs the new entry. Call with the volume's map locked for writing.
    fn mark_written(&self, map: &mut MapTable, lunit: u64, punit: u32, m: u32) {
        let cur = map.get(lunit);
        if cur.punit == punit && cur.bitmap | m != cur.bitmap {
            let bitmap = cur.bitmap | m;
            map.set(lunit, Entry { punit, bitmap }, &mut self.store.alloc());
            self.log_map(lunit, punit, bitmap);
        }
    }

    /// Logs a mapping record of this volume, which from then on is not pristine. Call
    /// with the volume's map locked for writing.
    pub(super) fn log_map(&self, lunit: u64, punit: u32, bitmap: u32) {
        self.vol.written.store(true, Ordering::SeqCst);
        self.store.log_record(&Record::Map { volume: self.vol.id, lunit, punit, bitmap });
    }

    /// Fills the bytes of block `blk` outside the write's view, at `buf_at` in the
    /// buffer, with the block's current content.
    async fn merge_partial_block(&self, buf: &mut AlignedBuf, blk: u64, buf_at: usize) -> Result<()> {
        let bs = BLOCK_SIZE as usize;
        let old = self.read_block(blk).await?;
        let (vs, vl) = (buf.view_start(), buf.as_ref().len());
        let full = buf.full_mut();
        let end = buf_at + bs;
        // The bytes of the block before the view, and after it.
        let head = buf_at..vs.clamp(buf_at, end);
        let tail = (vs + vl).clamp(buf_at, end)..end;
        for r in [head, tail] {
            full[r.clone()].copy_from_slice(&old[r.start - buf_at..r.end - buf_at]);
        }
        Ok(())
    }

    async fn read_block(&self, blk: u64) -> Result<Vec<u8>> {
        let r = self.read(blk * BLOCK_SIZE, BLOCK_SIZE).await?;
        Ok(r.data.as_ref().to_vec())
    }

    /// Writes whole blocks `[b0, b1)` from `buf` (view = the whole run), allocating and
    /// copying on write as needed; call with the range locks held. Returns the buffer,
    /// and whether a FUA write still needs a commit (the caller runs it after releasing
    /// the locks).
    async fn write_blocks(
        &self,
        b0: u64,
        b1: u64,
        buf: AlignedBuf,
        fua: bool,
        offset: u64,
    ) -> Result<(AlignedBuf, bool)> {
        let bpu = self.store.geo().blocks_per_unit();
        let (WritePlan { segs, new_bits, private, .. }, allocated, pins) = self.plan_write(b0, b1, offset).await?;
        // RWF_DSYNC suffices for FUA only if this write changes no mapping and the
        // mappings it writes through are durable already; else it waits for a commit.
        let dsync = fua && new_bits.is_empty() && private.is_empty() && self.store.metadata_settled();
        let (buf, r) = self
            .store
            .ring()
            .rw(Dir::Write { dsync }, buf, segs)
            .await
            .map_err(|_| self.err(worker_gone(), "write", offset))?;
        if let Err(e) = r {
            drop(pins);
            self.undo_allocations(&allocated);
            return Err(self.write_failed(e, offset));
        }
        if !new_bits.is_empty() {
            let mut map = self.vol.map.write();
            if !self.vol.deleted.load(Ordering::Acquire) {
                for (u, p, m) in new_bits {
                    self.mark_written(&mut map, u, p, m);
                }
            }
        }
        // Only now: while pinned, a unit this write allocated or writes is not undone
        // by another write's failure (above) before its bits are set.
        drop(pins);
        for &(u, s, e) in &private {
            let at = ((s - b0) * BLOCK_SIZE) as usize;
            let data = &buf.full()[at..at + ((e - s) * BLOCK_SIZE) as usize];
            let w = UnitWrite { lunit: u, s: s - u * bpu, e: e - u * bpu, data, offset };
            Box::pin(self.write_private(&w)).await?;
        }
        self.store.note_data_write();
        Ok((buf, fua && !dsync))
    }

    /// Plans a write of whole blocks `[b0, b1)` (plan.rs) and pins the units the plan
    /// writes in place (returned: held until their bits are set): under the map's read lock when every unit of the range is
    /// mapped (an overwrite); else maps a fresh data unit at each unmapped one the plan
    /// names, if the free set has them and the metadata they add has room (the store's
    /// room.rs, making room and trying again when not), and plans under the write lock
    /// that maps them. Returns the plan and what it mapped, `(lunit, punit)`, with no
    /// written block yet (nothing is logged for them until their blocks are).
    ///
    /// Errors: [`ErrorKind::NoSpace`], [`ErrorKind::NotFound`] (deleted), and those of
    /// the commit or checkpoint that making room runs.
    async fn plan_write(&self, b0: u64, b1: u64, offset: u64) -> Result<(WritePlan, Vec<(u64, u32)>, Pins<'_>)> {
        let in_place = |m: &MapTable, l: u64, p: u32| self.writable_in_place(m, l, p);
        {
            let map = self.vol.map.read();
            if self.vol.deleted.load(Ordering::Acquire) {
                return Err(self.deleted("write", offset));
            }
            if let Ok(plan) = plan::plan_write(&map, self.store.geo(), b0, b1, in_place) {
                // Pinned under the map lock, as for a read.
                let mut pins = Pins::new(&self.store);
                plan.pins.iter().for_each(|&u| pins.add(u));
                return Ok((plan, Vec::new(), pins));
            }
        }
        let allocate = || async move {
            if self.store.host_full() {
                self.store.refill_backed_free();
            }
            let mut map = self.vol.map.write();
            if self.vol.deleted.load(Ordering::Acquire) {
                return Err(self.deleted("write", offset));
            }
            // Planned again under this lock: another write may have mapped units since.
            let (plan, allocated) = match plan::plan_write(&map, self.store.geo(), b0, b1, in_place) {
                Ok(plan) => (plan, Vec::new()),
                Err(want) => {
                    let extra = room::allocation_growth(&map, &want);
                    let mut a = self.store.alloc();
                    if !self.store.data_room(&a, want.len() as u64) || !self.store.has_room(&a, extra) {
                        return Ok(Room::Need(NeedRoom { units: want.len() as u64, extra }));
                    }
                    let mut allocated = Vec::with_capacity(want.len());
                    for u in want {
                        let p = a.alloc().expect("the free set holds them");
                        map.set(u, Entry { punit: p, bitmap: 0 }, &mut a);
                        allocated.push((u, p));
                    }
                    self.store.after_growth(&a);
                    drop(a);
                    let plan = plan::plan_write(&map, self.store.geo(), b0, b1, in_place)
                        .expect("every unit of the range is mapped under this lock");
                    (plan, allocated)
                }
            };
            // Pinned under the map lock, as for a read.
            let mut pins = Pins::new(&self.store);
            plan.pins.iter().for_each(|&u| pins.add(u));
            Ok(Room::Done((plan, allocated, pins)))
        };
        let full = || Error::new(ErrorKind::NoSpace, "no free data unit for an allocating write");
        self.store.with_room(allocate, full).await.map_err(|e| self.err(e, "write", offset))
    }

    /// Unmaps the units a failed write allocated and that received no data (nothing was
    /// logged for them), unless another write now uses one (its pin), whose completion
    /// needs the mapping.
    fn undo_allocations(&self, allocated: &[(u64, u32)]) {
        let mut map = self.vol.map.write();
        for &(u, p) in allocated {
            let cur = map.get(u);
            if cur.punit == p && cur.bitmap == 0 && !self.store.pins().is_set(p) {
                // Logged: a checkpoint may have captured the empty mapping meanwhile.
                let mut a = self.store.alloc();
                map.set(u, Entry::EMPTY, &mut a);
                self.store.log_record(&Record::Unmap { volume: self.vol.id, lunit: u });
                a.decref(p);
            }
        }
    }

    /// Discards `len` bytes at `offset`: the range reads as zeros at once; whole 4 KiB
    /// blocks are dropped from the mapping and a unit whose blocks are all dropped is
    /// freed; partial blocks at the edges are overwritten with zeros. With `fua` the
    /// result is durable on return.
    ///
    /// Errors: [`ErrorKind::OutOfRange`], [`ErrorKind::Failed`], [`ErrorKind::NotFound`], [`ErrorKind::Io`].
    pub async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_read_only("trim", offset)?;
        let _gate = self.vol.gate.read().await;
        self.trim_inner(offset, len, fua).await
    }

    async fn trim_inner(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check_range("trim", offset, len)?;
        self.store.check_writable().map_err(|e| self.err(e, "trim", offset))?;
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let fb0 = offset.div_ceil(BLOCK_SIZE);
        let fb1 = end / BLOCK_SIZE;
        // Partial edge blocks: write zeros over the bytes if the block holds data.
        let mut edges = Vec::new();
        if fb0 > fb1 {
            edges.push((offset, len)); // inside one block
        } else {
            if !offset.is_multiple_of(BLOCK_SIZE) {
                edges.push((offset, fb0 * BLOCK_SIZE - offset));
            }
            if !end.is_multiple_of(BLOCK_SIZE) {
                edges.push((fb1 * BLOCK_SIZE, end - fb1 * BLOCK_SIZE));
            }
        }
        for (o, l) in edges {
            if self.block_written(o / BLOCK_SIZE) {
                let buf = self.zeroed_write_buf(o, l as usize);
                self.write_inner(o, buf, false).await?;
            }
        }
        if fb0 < fb1 {
            self.unmap_blocks(fb0, fb1, offset).await?;
        }
        if fua {
            self.store.commit().await.map_err(|e| self.err(e, "trim", offset))?;
        }
        Ok(())
    }

    /// Whether a write may go in place into data unit `punit`, mapped at `lunit` of
    /// `map` ([`crate::meta::writable_in_place`]): otherwise another volume or snapshot
    /// shares it, or did until a change not yet durable (after a crash before that change
    /// is, it would still map the unit), and the write copies it.
    fn writable_in_place(&self, map: &MapTable, lunit: u64, punit: u32) -> bool {
        crate::meta::writable_in_place(map, lunit, punit, self.store.refcounts(), self.store.settling())
    }

    fn block_written(&self, blk: u64) -> bool {
        let bpu = self.store.geo().blocks_per_unit();
        let e = self.vol.map.read().get(blk / bpu);
        e.is_mapped() && e.bitmap & (1 << (blk % bpu)) != 0
    }

    /// Clears the written bits of blocks `[b0, b1)`; frees units left with none. Holds
    /// the range locks of each page's units exclusively while it changes them, so a
    /// write in flight into one of them sets its bits first.
    async fn unmap_blocks(&self, b0: u64, b1: u64, offset: u64) -> Result<()> {
        let bpu = self.store.geo().blocks_per_unit();
        let page_units = crate::format::PAGE_ENTRIES as u64;
        let u0 = b0 / bpu;
        let u1 = (b1 - 1) / bpu + 1;
        let full = || {
            Error::new(
                ErrorKind::NoSpace,
                "the pool is too full for the mapping page this trim copies (the page is shared with a snapshot or \
                 clone); delete snapshots or volumes to free space",
            )
        };
        let mut u = u0;
        while u < u1 {
            // One page per lock hold, so a huge trim does not stall other I/O.
            let page_end = ((u / page_units + 1) * page_units).min(u1);
            if self.vol.map.read().page((u / page_units) as usize).is_none() {
                u = page_end;
                continue;
            }
            // Under the range locks of the page's units, taken afresh by each attempt:
            // they are released while room is made (room.rs).
            let page = || async move {
                let _guards = self.lock_units(u..page_end, Exclusive::All).await;
                let mut map = self.vol.map.write();
                if self.vol.deleted.load(Ordering::Acquire) {
                    return Err(self.deleted("trim", offset));
                }
                if map.page((u / page_units) as usize).is_none() {
                    return Ok(Room::Done(()));
                }
                // A page shared with a snapshot or clone is copied by the first change,
                // and its leaf first if that is shared: the copies' records must have
                // room in the next checkpoints (room.rs).
                if map.page_shared(u) && (u..page_end).any(|x| map.get(x).is_mapped()) {
                    let mapped = map.page((u / page_units) as usize).map_or(0, |p| u64::from(p.mapped));
                    let leaf = map.leaf((u / page_units) as usize / crate::meta::LEAF_PAGES);
                    let leaf_copy =
                        leaf.filter(|l| l.is_shared()).map_or(0, |l| crate::journal::leaf_body_bytes(l.present()));
                    let extra = room::page_record_bytes(mapped) + leaf_copy;
                    if !self.store.has_room(&self.store.alloc(), extra) {
                        return Ok(Room::Need(NeedRoom { units: 0, extra }));
                    }
                }
                for x in u..page_end {
                    let e = map.get(x);
                    if e.is_mapped() {
                        let s = (x * bpu).max(b0) - x * bpu;
                        let t = ((x + 1) * bpu).min(b1) - x * bpu;
                        let bitmap = e.bitmap & !mask(s, t);
                        self.set_entry(&mut map, x, e, bitmap);
                    }
                }
                Ok(Room::Done(()))
            };
            self.store.with_room(page, full).await.map_err(|e| self.err(e, "trim", offset))?;
            u = page_end;
        }
        Ok(())
    }

    /// Sets the bitmap of a mapped entry, unmapping and freeing its unit at zero, and logs it.
    fn set_entry(&self, map: &mut MapTable, lunit: u64, e: Entry, bitmap: u32) {
        if bitmap == e.bitmap && bitmap != 0 {
            return;
        }
        let mut a = self.store.alloc();
        if bitmap == 0 {
            map.set(lunit, Entry::EMPTY, &mut a);
            // The record first: a commit that releases the unit's free or settling mark
            // carries it (rules 2 and 9).
            self.store.log_record(&Record::Unmap { volume: self.vol.id, lunit });
            a.decref(e.punit);
        } else {
            map.set(lunit, Entry { punit: e.punit, bitmap }, &mut a);
            self.log_map(lunit, e.punit, bitmap);
        }
    }

    /// Writes zeros to `len` bytes at `offset`. With `may_unmap` this is a trim (fast,
    /// frees space); without it zeros are written and the range stays allocated.
    ///
    /// Errors: as [`Volume::trim`] and [`Volume::write`] (including [`ErrorKind::NoSpace`]
    /// when `may_unmap` is false).
    pub async fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<()> {
        self.check_read_only("write zeroes", offset)?;
        let _gate = self.vol.gate.read().await;
        if may_unmap {
            return self.trim_inner(offset, len, fua).await;
        }
        self.check_range("write zeroes", offset, len)?;
        let mut o = offset;
        let end = offset + len;
        while o < end {
            let l = (end - o).min(1 << 20);
            let buf = self.zeroed_write_buf(o, l as usize);
            self.write_inner(o, buf, false).await?;
            o += l;
        }
        if fua {
            self.store.commit().await.map_err(|e| self.err(e, "write zeroes", offset))?;
        }
        Ok(())
    }

    /// Makes every write completed before the call durable (all volumes of the pool).
    /// When log records are pending, the commit runs as a task spawned on the caller's
    /// tokio runtime, which finishes even if this future is dropped; on a current-thread
    /// runtime, keep the runtime driven until it has (other commits wait for it).
    ///
    /// Errors: [`ErrorKind::NotFound`] once the volume was deleted (as every other
    /// operation on it: nothing written to it can be made durable any more),
    /// [`ErrorKind::Failed`].
    pub async fn flush(&self) -> Result<()> {
        if self.vol.deleted.load(Ordering::Acquire) {
            return Err(self.deleted("flush", 0));
        }
        self.store.commit().await.map_err(|e| e.op("flush").volume(&self.vol.name))
    }

    /// Allocation of up to `len` bytes at `offset`, at 4 KiB precision, in order from
    /// `offset`; stops after 65,536 extents or `len` bytes.
    ///
    /// Errors: [`ErrorKind::OutOfRange`], [`ErrorKind::NotFound`].
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.check_range("block status", offset, len)?;
        let bpu = self.store.geo().blocks_per_unit();
        let us = self.store.geo().unit_size;
        let page_bytes = us * crate::format::PAGE_ENTRIES as u64;
        let end = offset + len;
        let mut ext = Vec::new();
        let map = self.vol.map.read();
        let mut pos = offset;
        while pos < end && ext.len() < 65_536 {
            let lunit = pos / us;
            if map.page((pos / page_bytes) as usize).is_none() {
                let next = ((pos / page_bytes + 1) * page_bytes).min(end);
                push_extent(&mut ext, next - pos, false);
                pos = next;
                continue;
            }
            let e = map.get(lunit);
            if !e.is_mapped() || e.bitmap == 0 {
                let next = ((lunit + 1) * us).min(end);
                push_extent(&mut ext, next - pos, false);
                pos = next;
                continue;
            }
            let blk = pos / BLOCK_SIZE;
            let next = ((blk + 1) * BLOCK_SIZE).min(end);
            push_extent(&mut ext, next - pos, e.bitmap & (1 << (blk % bpu)) != 0);
            pos = next;
        }
        Ok(ext)
    }
}
