//! The catalogue: volumes, snapshots and clones of a pool (create, delete, resize,
//! share, list, diff). Each change is logged and committed before it returns. Not here:
//! the data path (`volume`), the room for the metadata a change adds (the store's
//! room.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::Pool;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{BLOCK_SIZE, PAGE_ENTRIES};
use crate::info::VolumeInfo;
use crate::journal::{Record, VolumeMeta};
use crate::meta::{MapTable, LEAF_PAGES};
use crate::names::{check_no_orphan_snapshots, validate_name, validate_size};
use crate::props::{validate_labels, Labels, Props};
use crate::store::room::{self, NeedRoom, Room};
use crate::store::VolState;

pub(super) fn now() -> u32 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as u32).unwrap_or(0)
}

/// The error of a change whose metadata finds no room: the pool (or the host file
/// system under it) is full.
pub(super) fn metadata_full() -> Error {
    Error::new(
        ErrorKind::NoSpace,
        "the pool is too full for the metadata this change adds (its next checkpoints must fit); \
         delete snapshots or volumes to free space",
    )
}

impl Pool {
    /// Creates a thin volume of `size` bytes (a multiple of 4096). Durable on return.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (name, size), [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::Failed`]/[`ErrorKind::Io`] if the commit fails.
    pub async fn create_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.create_volume_with(name, size, &Labels::new()).await
    }

    /// [`Pool::create_volume`] with `labels` ([`validate_labels`]), in the same commit:
    /// no crash leaves the volume without them.
    ///
    /// Errors: as [`Pool::create_volume`]; [`ErrorKind::InvalidArgument`] for labels.
    pub async fn create_volume_with(&self, name: &str, size: u64, labels: &Labels) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("create volume").volume(name);
        validate_name(name).map_err(err)?;
        validate_size(size).map_err(err)?;
        validate_labels(labels).map_err(err)?;
        let props = Props::with_labels(labels);
        self.store.check_writable().map_err(err)?;
        let props = &props;
        let made = || async move {
            let mut vols = self.store.volumes().write();
            if vols.contains_key(name) {
                return Err(Error::new(ErrorKind::AlreadyExists, "a volume of that name exists"));
            }
            check_no_orphan_snapshots(&vols, name)?;
            let extra = room::volume_record_bytes(name.len()) + props.record_bytes();
            let mut a = self.store.alloc();
            if !self.store.has_room(&a, extra) {
                return Ok(Room::Need(NeedRoom { units: 0, extra }));
            }
            let id = self.store.next_volume_id();
            let created = now();
            let meta = VolumeMeta {
                name: name.to_owned(),
                snapshot: false,
                size,
                created,
                map: MapTable::new(),
                written: false,
                props: props.clone(),
            };
            // Together: recovery replays the volume with its labels or neither.
            let mut records = vec![Record::Volume { volume: id, size, created, name: name.to_owned() }];
            if !props.is_empty() {
                records.push(Record::Props { volume: id, props: props.clone() });
            }
            self.store.log_records(&records);
            a.counts.volumes += 1;
            a.counts.volume_bytes += meta.own_bytes();
            self.store.after_growth(&a);
            drop(a);
            vols.insert(name.to_owned(), Arc::new(VolState::new(id, meta)));
            Ok(Room::Done(()))
        };
        self.store.with_room(made, metadata_full).await.map_err(err)?;
        self.store.commit().await.map_err(err)?;
        tracing::info!(volume = name, size, "created volume");
        self.volume_info(name)
    }

    /// Deletes a volume and frees the data units only it referenced (after the delete
    /// is durable); its snapshots and clones stay intact. Open handles fail with
    /// [`ErrorKind::NotFound`] from then on. Costs in-memory metadata work proportional
    /// to the volume's mapped pages and one log record; no data is read or rewritten.
    /// In a pool too full to allocate, also asks for a checkpoint in the background,
    /// which gives back the room the deleted metadata held (a snapshot, clone or write
    /// that needs the room before then takes a checkpoint itself).
    ///
    /// Errors: [`ErrorKind::NotFound`] (also for a snapshot name: use
    /// [`Pool::delete_snapshot`]), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn delete_volume(&self, name: &str) -> Result<()> {
        if name.contains('@') {
            return Err(Error::new(ErrorKind::NotFound, "no such volume (a snapshot is deleted with snapshot delete)")
                .op("delete volume")
                .volume(name));
        }
        self.delete_any(name, "delete volume").await
    }

    /// Deletes snapshot `snapshot` of `volume`; space only it held is freed at once
    /// (its metadata's share by a checkpoint in a pool too full to allocate, as
    /// [`Pool::delete_volume`]).
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        self.delete_any(&format!("{volume}@{snapshot}"), "delete snapshot").await
    }

    async fn delete_any(&self, name: &str, op: &'static str) -> Result<()> {
        let err = |e: Error| e.op(op).volume(name);
        self.store.check_writable().map_err(err)?;
        {
            let mut vols = self.store.volumes().write();
            let vs =
                vols.get(name).ok_or_else(|| err(Error::new(ErrorKind::NotFound, "no such volume or snapshot")))?;
            if let Some(a) = vs.props().attachments.first() {
                return Err(err(Error::new(
                    ErrorKind::Attached,
                    format!("it is published to node '{}'; unpublish it first", crate::error::shown_name(&a.node_id)),
                )));
            }
            let vs = vols.remove(name).expect("looked up under the same lock");
            let mut map = vs.map.write();
            vs.deleted.store(true, Ordering::SeqCst);
            // The record first: a commit that releases the settling marks and frees the
            // release causes also carries it (on-disk-format.md 6.1 rules 2, 9, 12).
            self.store.log_record(&Record::VolumeDelete { volume: vs.id });
            let mut alloc = self.store.alloc();
            map.release_all(&mut alloc);
            alloc.counts.volumes -= 1;
            alloc.counts.volume_bytes -= vs.props().volume_bytes(&vs.name);
            self.store.trim_spare(&mut alloc);
        }
        self.store.commit().await.map_err(err)?;
        tracing::info!(name, op, "deleted");
        // In a pool too full to allocate, the units the current checkpoint holds beyond
        // what the next needs come back only with a checkpoint (room.rs). A change that
        // needs them checkpoints by itself; this asks for one in the background as well,
        // so that the room shows as free soon. Deletes made while it is pending share
        // it: a burst of deletes costs one or two checkpoints, not one each.
        let tight = {
            let a = self.store.alloc();
            !self.store.data_room(&a, 1) && self.store.checkpoint_lowers_need(&a)
        };
        if tight {
            self.store.request_checkpoint();
        }
        Ok(())
    }

    /// Takes snapshot `snapshot` of `volume`: a read-only volume named
    /// `VOLUME@SNAPSHOT` that shares every mapping page (no data copied; the cost
    /// grows with the number of mapped pages, not with the size). It holds every write
    /// acknowledged before the call and none issued after the reply; writes in flight
    /// on this volume are waited for. Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`] (name), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn create_snapshot(&self, volume: &str, snapshot: &str) -> Result<VolumeInfo> {
        self.create_snapshot_with(volume, snapshot, &Labels::new()).await
    }

    /// [`Pool::create_snapshot`] with `labels` ([`validate_labels`]), in the same commit.
    ///
    /// Errors: as [`Pool::create_snapshot`]; [`ErrorKind::InvalidArgument`] for labels.
    pub async fn create_snapshot_with(&self, volume: &str, snapshot: &str, labels: &Labels) -> Result<VolumeInfo> {
        let full = format!("{volume}@{snapshot}");
        let err = |e: Error| e.op("create snapshot").volume(&full);
        validate_name(snapshot).map_err(err)?;
        validate_labels(labels).map_err(err)?;
        self.share_with_room(volume, &full, true, labels).await.map_err(err)
    }

    /// Writes a checkpoint now (docs/on-disk-format.md 6.3): the log is emptied, and the
    /// room held back for metadata is computed afresh from what the metadata takes.
    /// The engine checkpoints by itself when the log fills, when an allocation or a
    /// snapshot finds the room held back inflated by metadata changes since the last
    /// checkpoint, and (in the background) after a delete in a pool too full to
    /// allocate; this is for tools and tests.
    ///
    /// Errors: [`ErrorKind::Failed`] or [`ErrorKind::NoSpace`]: the pool failed
    /// earlier, is closing, or failed in this checkpoint (see `Store::checkpoint_async`).
    pub async fn checkpoint(&self) -> Result<()> {
        self.store.checkpoint_async().await.map_err(|e| e.op("checkpoint"))
    }

    /// [`Self::share`], making room for the metadata it adds when it finds none
    /// ([`Store::with_room`]).
    async fn share_with_room(&self, source: &str, target: &str, snapshot: bool, labels: &Labels) -> Result<VolumeInfo> {
        self.store.with_room(|| self.share(source, target, snapshot, labels), metadata_full).await
    }

    /// Creates writable volume `name` from `source` (`VOLUME@SNAPSHOT` or `VOLUME`),
    /// sharing its pages; the clone has its own lifetime (deleting the source leaves it
    /// intact). Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`] (name), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn clone_volume(&self, source: &str, name: &str) -> Result<VolumeInfo> {
        self.clone_volume_with(source, name, &Labels::new()).await
    }

    /// [`Pool::clone_volume`] with `labels` ([`validate_labels`]), in the same commit.
    ///
    /// Errors: as [`Pool::clone_volume`]; [`ErrorKind::InvalidArgument`] for labels.
    pub async fn clone_volume_with(&self, source: &str, name: &str, labels: &Labels) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("clone volume").volume(name);
        validate_name(name).map_err(err)?;
        validate_labels(labels).map_err(err)?;
        self.share_with_room(source, name, false, labels).await.map_err(err)
    }

    /// Shares `source` as `target`; `Room::Need` when the metadata it adds finds no
    /// room (nothing changed).
    async fn share(&self, source: &str, target: &str, snapshot: bool, labels: &Labels) -> Result<Room<VolumeInfo>> {
        Ok(match self.share_many(&[(source, target.to_owned())], snapshot, labels).await? {
            Room::Done(mut infos) => Room::Done(infos.pop().expect("one shared")),
            Room::Need(n) => Room::Need(n),
        })
    }

    /// Takes snapshot `snapshot` of every volume of `volumes` at one instant (a group
    /// snapshot: a database's data and log volumes): each `VOLUME@SNAPSHOT` holds every
    /// write acknowledged on any of them before the call and none issued after the
    /// reply, since writes to all of them are held back together while the snapshots
    /// are made, and all are logged together (never split across log batches, unless
    /// their records alone overflow one, about 10,000 members) and made durable by one
    /// commit: after a crash, the whole group or none of it. `labels` go on every
    /// member.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (no volume, one named twice, a snapshot
    /// among them, a bad name or labels); [`ErrorKind::NotFound`];
    /// [`ErrorKind::AlreadyExists`] (a member exists already: nothing is made);
    /// [`ErrorKind::NoSpace`], [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn create_group_snapshot(
        &self,
        volumes: &[&str],
        snapshot: &str,
        labels: &Labels,
    ) -> Result<Vec<VolumeInfo>> {
        let err = |e: Error| e.op("create group snapshot").volume(&format!("@{snapshot}"));
        validate_name(snapshot).map_err(err)?;
        validate_labels(labels).map_err(err)?;
        // Name order: the lock order of volume gates when several are held.
        let mut sources = volumes.to_vec();
        sources.sort_unstable();
        sources.dedup();
        if sources.is_empty() || sources.len() != volumes.len() {
            return Err(err(Error::new(
                ErrorKind::InvalidArgument,
                "a group snapshot needs distinct volumes, one at least",
            )));
        }
        let pairs: Vec<(&str, String)> = sources.iter().map(|v| (*v, format!("{v}@{snapshot}"))).collect();
        self.store.with_room(|| self.share_many(&pairs, true, labels), metadata_full).await.map_err(err)
    }

    /// Shares each `(source, target)` of `pairs` (sources distinct and in name order),
    /// all at one instant and in one commit; `Room::Need` when the metadata they add
    /// finds no room (nothing changed).
    async fn share_many(
        &self,
        pairs: &[(&str, String)],
        snapshot: bool,
        labels: &Labels,
    ) -> Result<Room<Vec<VolumeInfo>>> {
        let props = Props::with_labels(labels);
        self.store.check_writable()?;
        let srcs = {
            let vols = self.store.volumes().read();
            pairs
                .iter()
                .map(|(source, _)| {
                    vols.get(*source)
                        .cloned()
                        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no volume or snapshot '{source}'")))
                })
                .collect::<Result<Vec<_>>>()?
        };
        if snapshot && srcs.iter().any(|s| s.snapshot) {
            return Err(Error::new(ErrorKind::InvalidArgument, "snapshots are taken of volumes, not of snapshots"));
        }
        // Wait for writes in flight on the sources, and hold new ones back briefly:
        // every source at once, gates taken in name order.
        let mut quiet = Vec::with_capacity(srcs.len());
        for src in &srcs {
            quiet.push(src.gate.write().await);
        }
        {
            let mut vols = self.store.volumes().write();
            for (_, target) in pairs {
                if vols.contains_key(target) {
                    return Err(Error::new(ErrorKind::AlreadyExists, "a volume or snapshot of that name exists"));
                }
                if !snapshot {
                    check_no_orphan_snapshots(&vols, target)?;
                }
            }
            if let Some(((source, _), _)) = pairs.iter().zip(&srcs).find(|(_, s)| s.deleted.load(Ordering::SeqCst)) {
                return Err(Error::new(ErrorKind::NotFound, format!("'{source}' was deleted")));
            }
            let maps: Vec<_> = srcs.iter().map(|s| s.map.read()).collect();
            // Each new volume's record, and a reference to each leaf it shares.
            let extra: u64 = pairs
                .iter()
                .zip(&maps)
                .map(|((_, target), map)| {
                    room::volume_record_bytes(target.len())
                        + props.record_bytes()
                        + room::PAGE_REF_BYTES * map.leaves().count() as u64
                })
                .sum();
            let mut alloc = self.store.alloc();
            if !self.store.has_room(&alloc, extra) {
                return Ok(Room::Need(NeedRoom { units: 0, extra }));
            }
            let created = now();
            let mut records = Vec::with_capacity(pairs.len() * 2);
            let mut made = Vec::with_capacity(pairs.len());
            for (((_, target), src), map) in pairs.iter().zip(&srcs).zip(&maps) {
                let id = self.store.next_volume_id();
                let size = src.size.load(Ordering::SeqCst);
                let meta = VolumeMeta {
                    name: target.clone(),
                    snapshot,
                    size,
                    created,
                    map: map.share(&mut alloc),
                    // A snapshot or clone is pristine when its source is: it shares
                    // nothing mapped. A first mapping sets the flag and logs its
                    // record under the source's gate, which this share holds until
                    // its own record is logged, so replay sees them in this order
                    // and agrees.
                    written: src.written.load(Ordering::SeqCst),
                    props: props.clone(),
                };
                alloc.counts.volumes += 1;
                alloc.counts.volume_bytes += meta.own_bytes();
                records.push(Record::Share {
                    source: src.id,
                    target: id,
                    size,
                    created,
                    snapshot,
                    name: target.clone(),
                });
                if !props.is_empty() {
                    records.push(Record::Props { volume: id, props: props.clone() });
                }
                made.push((target.clone(), Arc::new(VolState::new(id, meta))));
            }
            self.store.after_growth(&alloc);
            drop(alloc);
            drop(maps);
            // Together in the journal: no commit between them.
            self.store.log_records(&records);
            vols.extend(made);
        }
        drop(quiet);
        self.store.commit().await?;
        for (source, target) in pairs {
            tracing::info!(source, target = %target, snapshot, "shared");
        }
        pairs.iter().map(|(_, target)| self.volume_info(target)).collect::<Result<Vec<_>>>().map(Room::Done)
    }

    /// Snapshots, of `volume` or of all volumes, sorted by name.
    pub fn list_snapshots(&self, volume: Option<&str>) -> Vec<VolumeInfo> {
        let prefix = volume.map(|v| format!("{v}@"));
        self.store
            .volumes()
            .read()
            .values()
            .filter(|v| v.snapshot && prefix.as_ref().is_none_or(|p| v.name.starts_with(p.as_str())))
            .map(|v| self.store.info(v))
            .collect()
    }

    /// Byte ranges `(offset, length)` whose content may differ between `a` and `b`
    /// (volumes or snapshots, e.g. two snapshots of one volume, or a snapshot and the
    /// live volume), found from the mappings alone: ranges where one side has written
    /// blocks the other lacks, or both map different data units. Pages the two share
    /// are skipped without a look. The ranges are sorted, disjoint, 4 KiB-aligned, and
    /// cover up to the larger size.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn diff(&self, a: &str, b: &str) -> Result<Vec<(u64, u64)>> {
        let (va, vb) = (self.named("diff", a)?, self.named("diff", b)?);
        let (ma, mb) = (va.map.read().clone(), vb.map.read().clone());
        Ok(self.changed_blocks(&ma, &mb))
    }

    /// Byte ranges `(offset, length)` of volume or snapshot `name` that hold written
    /// data (every other byte reads as zeros), from its mapping alone: sorted,
    /// disjoint, 4 KiB-aligned. What a backup of it must read, and no more.
    ///
    /// Errors: [`ErrorKind::NotFound`].
    pub fn allocated(&self, name: &str) -> Result<Vec<(u64, u64)>> {
        let v = self.named("allocated ranges", name)?;
        let m = v.map.read().clone();
        // Against an empty table: the blocks written in it.
        Ok(self.changed_blocks(&m, &MapTable::new()))
    }

    /// The volume or snapshot `name`, for operation `op`.
    fn named(&self, op: &'static str, name: &str) -> Result<Arc<VolState>> {
        self.store
            .volumes()
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::NotFound, "no such volume or snapshot").op(op).volume(name))
    }

    /// The 4 KiB blocks, as merged ranges, where `ma` and `mb` differ (written in one
    /// and not the other, or both mapping other data units).
    fn changed_blocks(&self, ma: &MapTable, mb: &MapTable) -> Vec<(u64, u64)> {
        let bpu = self.store.geo().blocks_per_unit();
        let us = self.store.geo().unit_size;
        // Pages present on either side, in order, but for the leaves both share (a
        // snapshot and its volume share every leaf the volume did not change since).
        let same_leaf = |l: usize| matches!((ma.leaf(l), mb.leaf(l)), (Some(x), Some(y)) if Arc::ptr_eq(x, y));
        let present: std::collections::BTreeSet<usize> = ma
            .leaves()
            .chain(mb.leaves())
            .filter(|&(l, _)| !same_leaf(l))
            .flat_map(|(l, leaf)| leaf.pages().map(move |(i, _)| l * LEAF_PAGES + i))
            .collect();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut push = |off: u64, len: u64| match out.last_mut() {
            Some((o, l)) if *o + *l == off => *l += len,
            _ => out.push((off, len)),
        };
        for p in present {
            if let (Some(x), Some(y)) = (ma.page(p), mb.page(p)) {
                if Arc::ptr_eq(x, y) {
                    continue;
                }
            }
            for i in 0..PAGE_ENTRIES as u64 {
                let lunit = p as u64 * PAGE_ENTRIES as u64 + i;
                let (ea, eb) = (ma.get(lunit), mb.get(lunit));
                for blk in 0..bpu {
                    let bit = 1u32 << blk;
                    let wa = ea.is_mapped() && ea.bitmap & bit != 0;
                    let wb = eb.is_mapped() && eb.bitmap & bit != 0;
                    if wa != wb || (wa && ea.punit != eb.punit) {
                        push(lunit * us + blk * BLOCK_SIZE, BLOCK_SIZE);
                    }
                }
            }
        }
        out
    }

    /// Grows a volume to `size` bytes (a multiple of 4096). Durable on return. Requests
    /// are checked against the new size at once, but an NBD client learns an export's
    /// size only in its handshake: connected clients see the growth after reconnecting.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::InvalidArgument`] (shrink, bad size, or a snapshot).
    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        let err = |e: Error| e.op("resize volume").volume(name);
        validate_size(size).map_err(err)?;
        self.store.check_writable().map_err(err)?;
        {
            let vols = self.store.volumes().read();
            let vs = match vols.get(name) {
                Some(v) if v.snapshot => {
                    return Err(err(Error::new(ErrorKind::InvalidArgument, "a snapshot cannot be resized")))
                }
                Some(v) => v,
                None => return Err(err(Error::new(ErrorKind::NotFound, "no such volume"))),
            };
            // Held so that the resize record is logged in order with this volume's
            // mapping records.
            let _map = vs.map.write();
            let old = vs.size.load(Ordering::SeqCst);
            if size < old {
                return Err(err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("shrinking from {old} to {size} bytes is not supported"),
                )));
            }
            if size != old {
                self.store.log_record(&Record::VolumeResize { volume: vs.id, size });
                vs.size.store(size, Ordering::SeqCst);
            }
        }
        self.store.commit().await.map_err(err)?;
        self.volume_info(name)
    }
}
