//! Changes to a volume's properties after it was made: attachments (publishing a
//! volume to a node and unpublishing it, [`Pool::attach`], [`Pool::detach`]) and
//! labels ([`Pool::set_label`]), kept with the volume's metadata and committed before
//! they return. Not here: enforcing attachments on a wire (the server's NBD exports),
//! the types (`props`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::catalogue::now;
use super::Pool;
use crate::error::{shown_name, Error, ErrorKind, Result};
use crate::journal::Record;
use crate::props::{
    validate_labels, validate_node_id, AttachKey, Attachment, Labels, Props, MAX_ATTACHMENTS, MAX_PROPS_BYTES,
};
use crate::store::room::{NeedRoom, Room};

/// What a change to a volume's properties decided, looking at the current ones.
enum Change<T> {
    /// Nothing to change; this is the answer.
    Keep(T),
    /// Store these properties; then this is the answer.
    Set(Props, T),
}

impl Pool {
    /// Publishes volume `volume` to node `node_id`: the node may then open its export
    /// with the returned attachment's key (read-only if `read_only`). With `exclusive`,
    /// no other node may be attached while this one is, and the call fails if one is.
    /// Idempotent: the same node with the same `read_only` and `exclusive` gets the
    /// attachment it has, key included. Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`] (no such volume, or a snapshot: snapshots are
    /// not published), [`ErrorKind::InvalidArgument`] (node id, or more than
    /// [`MAX_ATTACHMENTS`] nodes or [`MAX_PROPS_BYTES`] of labels and attachments),
    /// [`ErrorKind::AlreadyExists`] (attached to this node with other flags),
    /// [`ErrorKind::Attached`] (attached to another node, and one of the two is
    /// exclusive), [`ErrorKind::NoSpace`] (no room for the metadata),
    /// [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn attach(&self, volume: &str, node_id: &str, read_only: bool, exclusive: bool) -> Result<Attachment> {
        let err = |e: Error| e.op("attach").volume(volume);
        validate_node_id(node_id).map_err(err)?;
        self.change_props(volume, |p| {
            if let Some(a) = p.attachments.iter().find(|a| a.node_id == node_id) {
                if a.read_only == read_only && a.exclusive == exclusive {
                    return Ok(Change::Keep(a.clone()));
                }
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!(
                        "already published to node '{}' {} and {}",
                        shown_name(node_id),
                        if a.read_only { "read-only" } else { "read-write" },
                        if a.exclusive { "exclusively" } else { "shared" }
                    ),
                ));
            }
            if let Some(other) = p.attachments.iter().find(|a| exclusive || a.exclusive) {
                return Err(Error::new(
                    ErrorKind::Attached,
                    format!("published to node '{}' and not to be shared with another", shown_name(&other.node_id)),
                ));
            }
            let a = Attachment {
                node_id: node_id.to_owned(),
                key: AttachKey::random(),
                read_only,
                exclusive,
                created: u64::from(now()),
            };
            let mut next = p.clone();
            next.attachments.push(a.clone());
            if next.attachments.len() > MAX_ATTACHMENTS || next.record_bytes() > MAX_PROPS_BYTES {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("published to too many nodes (at most {MAX_ATTACHMENTS}, and {MAX_PROPS_BYTES} bytes of labels and node ids)"),
                ));
            }
            Ok(Change::Set(next, a))
        })
        .await
        .map_err(err)
    }

    /// Unpublishes volume `volume` from node `node_id`: the attachment and its key are
    /// gone once this returns (durably). Returns the attachment removed, or `None` when
    /// the volume was not published to that node (nothing changes). The caller closes
    /// the node's open connections; the engine knows none.
    ///
    /// Errors: [`ErrorKind::NotFound`] (no such volume), [`ErrorKind::InvalidArgument`]
    /// (node id), [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn detach(&self, volume: &str, node_id: &str) -> Result<Option<Attachment>> {
        let err = |e: Error| e.op("detach").volume(volume);
        validate_node_id(node_id).map_err(err)?;
        self.change_props(volume, |p| {
            let Some(i) = p.attachments.iter().position(|a| a.node_id == node_id) else {
                return Ok(Change::Keep(None));
            };
            let mut next = p.clone();
            let gone = next.attachments.remove(i);
            Ok(Change::Set(next, Some(gone)))
        })
        .await
        .map_err(err)
    }

    /// Sets label `key` of volume `volume` to `value`, or removes it when `value` is
    /// `None`; returns the volume's labels after. Idempotent (setting a label to the
    /// value it has changes nothing). Durable on return. Snapshots keep the labels
    /// they were taken with.
    ///
    /// Errors: [`ErrorKind::NotFound`] (no such volume, or a snapshot),
    /// [`ErrorKind::InvalidArgument`] (the key or value, more than
    /// [`crate::MAX_LABELS`] labels, or more than [`MAX_PROPS_BYTES`] of labels and
    /// attachments), [`ErrorKind::NoSpace`] (no room for the metadata),
    /// [`ErrorKind::Failed`]/[`ErrorKind::Io`].
    pub async fn set_label(&self, volume: &str, key: &str, value: Option<&str>) -> Result<Labels> {
        let err = |e: Error| e.op("set label").volume(volume);
        self.change_props(volume, |p| {
            if p.labels.get(key).map(String::as_str) == value {
                return Ok(Change::Keep(p.labels.clone()));
            }
            let mut next = p.clone();
            match value {
                Some(v) => next.labels.insert(key.to_owned(), v.to_owned()),
                None => next.labels.remove(key),
            };
            validate_labels(&next.labels)?;
            if next.record_bytes() > MAX_PROPS_BYTES {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("labels and attachments would take more than {MAX_PROPS_BYTES} bytes"),
                ));
            }
            let labels = next.labels.clone();
            Ok(Change::Set(next, labels))
        })
        .await
        .map_err(err)
    }

    /// Runs `decide` on the current properties of volume `name` (not a snapshot) and
    /// logs and commits what it sets, making room for the metadata it adds. A `Keep`
    /// is committed too when a change is still pending, so that an answer is never
    /// given before what it reports is durable.
    async fn change_props<T>(&self, name: &str, decide: impl Fn(&Props) -> Result<Change<T>>) -> Result<T> {
        self.store.check_writable()?;
        let decide = &decide;
        let change = || async move {
            // The registry is held throughout, so that the volume cannot be deleted
            // between the decision and its record.
            let vols = self.store.volumes().read();
            let vs = match vols.get(name) {
                Some(v) if !v.snapshot => v,
                _ => return Err(Error::new(ErrorKind::NotFound, "no such volume")),
            };
            let _map = vs.map.write();
            let current = vs.props();
            let (next, answer) = match decide(&current)? {
                Change::Keep(answer) => return Ok(Room::Done(answer)),
                Change::Set(next, answer) => (next, answer),
            };
            let extra = next.record_bytes().saturating_sub(current.record_bytes());
            let mut a = self.store.alloc();
            if extra > 0 && !self.store.has_room(&a, extra) {
                return Ok(Room::Need(NeedRoom { units: 0, extra }));
            }
            a.counts.volume_bytes -= current.record_bytes();
            a.counts.volume_bytes += next.record_bytes();
            self.store.after_growth(&a);
            drop(a);
            debug_assert!(!vs.deleted.load(Ordering::SeqCst));
            self.store.log_record(&Record::Props { volume: vs.id, props: next.clone() });
            *vs.props.lock() = Arc::new(next);
            Ok(Room::Done(answer))
        };
        let answer = self.store.with_room(change, super::catalogue::metadata_full).await?;
        self.store.commit().await?;
        Ok(answer)
    }
}
