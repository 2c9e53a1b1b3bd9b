//! The management API's server side: the `Management` service of the `mgmt-api` crate
//! (gRPC, proto/ferrovol.proto there) implemented over a [`Pool`].
//!
//! Lives here: [`ManagementService`] and what it is configured with ([`HostIdentity`]),
//! the conversion of engine types to the API's, create-by-name idempotence (`exist_ok`),
//! unpublish's fencing of the node's NBD connections, and the audit line of every call
//! that changes something. Not here: the protocol and its client (`mgmt-api`),
//! listening and TLS (host.rs, tls.rs), the engine.

use std::sync::Arc;
use std::time::Duration;

use mgmt_api::pb;
use pb::management_server::{Management, ManagementServer};
use storage_engine::{Attachment, ErrorKind, Labels, Pool, VolumeInfo};
use tonic::{Request, Response, Status};

use crate::access::{Fences, NbdAccess};
use crate::errors::grpc_status;
use crate::qos::{Limiters, QosLimits};

pub use mgmt_api::{GROUP_SIZE_LABEL, ORIGIN_LABEL, QOS_LABEL};

/// How long UnpublishVolume waits for the node's connections to close before it
/// answers `ABORTED` (the attachment is gone by then; a retry waits again).
pub const UNPUBLISH_WAIT: Duration = Duration::from_secs(30);

/// What the management service reports of its host and how NBD is served.
#[derive(Clone)]
pub struct HostIdentity {
    /// NBD URIs the server listens on (GetPoolStatus `nbd_endpoints`).
    pub endpoints: Vec<String>,
    /// `host:port` addresses nodes reach NBD at (`--advertise`, or the TCP listen
    /// address): GetHostInfo and every attachment report them.
    pub nbd_addresses: Vec<String>,
    /// Who may open an export over TCP.
    pub access: NbdAccess,
    /// NBD over TLS on TCP (`--nbd-tls`), `None` for off.
    pub tls: Option<nbd::TlsMode>,
    /// The attachments' revocation signals, shared with the NBD registry.
    pub fences: Arc<Fences>,
    /// The volumes' QoS limiters, shared with the NBD registry.
    pub limits: Arc<Limiters>,
    /// The volumes served as local block devices (`volume attach-local`).
    pub local: Arc<crate::local::LocalDevices>,
}

impl HostIdentity {
    /// An identity for a service with no NBD listener (tests, the fuzz target).
    pub fn detached() -> HostIdentity {
        HostIdentity {
            endpoints: Vec::new(),
            nbd_addresses: Vec::new(),
            access: NbdAccess::Open,
            tls: None,
            fences: Arc::new(Fences::default()),
            limits: Arc::new(Limiters::default()),
            local: Arc::new(crate::local::LocalDevices::none()),
        }
    }

    /// `--nbd-tls` as the management API names it: `off`, `optional` or `required`.
    pub fn tls_name(&self) -> String {
        match self.tls {
            None => "off",
            Some(nbd::TlsMode::Optional) => "optional",
            Some(nbd::TlsMode::Required) => "required",
        }
        .to_owned()
    }
}

/// The management service over one pool.
pub struct ManagementService {
    pool: Pool,
    host: HostIdentity,
    /// Held through each CreateGroupSnapshot, so that one taking a partial group again
    /// never deletes what another has just made.
    groups: tokio::sync::Mutex<()>,
}

impl ManagementService {
    /// `v` with its local device, if it has one.
    fn with_local(&self, mut v: pb::Volume) -> pb::Volume {
        if let Some(d) = self.host.local.get(&v.name) {
            v.local_device = d.path;
        }
        v
    }

    /// A gRPC server for `pool`, reporting `host`.
    pub fn new(pool: Pool, host: HostIdentity) -> ManagementServer<ManagementService> {
        ManagementServer::new(ManagementService::service(pool, host))
    }

    /// The service itself, to call its methods in-process.
    pub fn service(pool: Pool, host: HostIdentity) -> ManagementService {
        ManagementService { pool, host, groups: tokio::sync::Mutex::new(()) }
    }
}

fn attachment_info(a: &Attachment) -> pb::AttachmentInfo {
    pb::AttachmentInfo {
        node_id: a.node_id.clone(),
        read_only: a.read_only,
        exclusive: a.exclusive,
        created_unix: a.created,
    }
}

fn volume(v: VolumeInfo) -> pb::Volume {
    let limits = QosLimits::of_labels(&v.name, &v.labels);
    pb::Volume {
        qos: (!limits.is_unlimited()).then(|| qos_pb(&limits)),
        export_name: v.name.clone(),
        name: v.name,
        id: v.id,
        size_bytes: v.size,
        allocated_bytes: v.allocated,
        created_unix: v.created,
        snapshot: v.snapshot,
        exclusive_bytes: v.exclusive,
        shared_bytes: v.shared,
        pristine: v.pristine,
        labels: v.labels.into_iter().collect(),
        attachments: v.attachments.iter().map(attachment_info).collect(),
        local_device: String::new(),
    }
}

fn local_device(d: crate::local::LocalDevice) -> pb::LocalDevice {
    pb::LocalDevice { name: d.name, path: d.path, read_only: d.read_only }
}

/// A delete refused by a volume's local device ([`crate::local::LocalDevices::reserve`]):
/// ABORTED while another call holds it (retry), else FAILED_PRECONDITION (detach first).
fn delete_refused(e: crate::local::LocalError) -> Status {
    match e {
        crate::local::LocalError::Busy(m) => Status::aborted(m),
        e => Status::failed_precondition(e.to_string()),
    }
}

fn local_status(e: crate::local::LocalError) -> Status {
    use crate::local::LocalError;
    match e {
        LocalError::NotFound(m) => Status::not_found(m),
        LocalError::Exists(m) => Status::already_exists(m),
        LocalError::Busy(m) => Status::aborted(m),
        LocalError::Unavailable(m) => Status::failed_precondition(m),
        LocalError::Failed(m) => Status::internal(m),
    }
}

fn qos_pb(l: &QosLimits) -> pb::Qos {
    pb::Qos {
        read_iops: l.read_iops,
        write_iops: l.write_iops,
        read_bytes_per_second: l.read_bytes_per_second,
        write_bytes_per_second: l.write_bytes_per_second,
        burst_ms: l.burst_ms,
    }
}

/// The limits a request asks for (none when absent), checked.
fn qos_limits(q: Option<&pb::Qos>) -> Result<QosLimits, Status> {
    let l = q.map_or_else(QosLimits::default, |q| QosLimits {
        read_iops: q.read_iops,
        write_iops: q.write_iops,
        read_bytes_per_second: q.read_bytes_per_second,
        write_bytes_per_second: q.write_bytes_per_second,
        burst_ms: q.burst_ms,
    });
    l.validate().map_err(|why| Status::invalid_argument(format!("QoS limits: {why}")))?;
    Ok(l)
}

/// The labels a request asks for, without the server's own ([`ORIGIN_LABEL`],
/// [`GROUP_SIZE_LABEL`], [`QOS_LABEL`]), which it refuses.
fn labels(m: &std::collections::HashMap<String, String>) -> Result<Labels, Status> {
    if let Some(k) = [ORIGIN_LABEL, GROUP_SIZE_LABEL, QOS_LABEL].into_iter().find(|k| m.contains_key(*k)) {
        return Err(Status::invalid_argument(format!("label '{k}' is set by the server")));
    }
    Ok(m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// `labels` with the label that keeps `limits` (none when unlimited).
fn with_limits(mut labels: Labels, limits: &QosLimits) -> Labels {
    if let Some(v) = limits.to_label() {
        labels.insert(QOS_LABEL.to_owned(), v);
    }
    labels
}

/// Who made a call, for the audit line: the TLS client certificate's subject, the
/// unix socket peer's uid, or `in-process`.
fn caller<T>(req: &Request<T>) -> String {
    if let Some(who) = req.extensions().get::<crate::tls::Caller>() {
        return who.0.clone();
    }
    if let Some(info) = req.extensions().get::<tonic::transport::server::UdsConnectInfo>() {
        if let Some(cred) = info.peer_cred {
            return format!("uid={}", cred.uid());
        }
    }
    "in-process".to_owned()
}

/// The audit line of a call that changes something: who, what, with which arguments
/// (never a secret), and how it ended; written when the call ends, or with outcome
/// `cancelled` when its caller went away first (a change may then have been made).
struct Audit {
    caller: String,
    call: &'static str,
    args: String,
    outcome: Option<String>,
}

impl Audit {
    fn end<T>(mut self, r: &Result<T, Status>) {
        self.outcome = Some(match r {
            Ok(_) => "ok".to_owned(),
            Err(s) => format!("{:?}: {}", s.code(), s.message()),
        });
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        let outcome = self.outcome.as_deref().unwrap_or("cancelled");
        let (caller, call, args) = (&self.caller, self.call, &self.args);
        tracing::info!(target: "ferrovol::audit", caller, call, args, outcome, "audit");
    }
}

impl ManagementService {
    /// The answer to a create that found `name` taken: the existing volume when
    /// `same` says it is what was asked for (after the commit that made it is durable:
    /// a concurrent create may still be committing it), else `ALREADY_EXISTS`.
    async fn existing(
        &self,
        name: &str,
        same: impl Fn(&VolumeInfo) -> Result<(), String>,
    ) -> Result<pb::Volume, Status> {
        let v = self.pool.volume_info(name).map_err(|e| grpc_status(&e))?;
        if let Err(why) = same(&v) {
            return Err(Status::already_exists(format!("'{name}' exists and {why}")));
        }
        self.pool.flush().await.map_err(|e| grpc_status(&e))?;
        Ok(volume(v))
    }

    async fn do_create_volume(&self, r: pb::CreateVolumeRequest) -> Result<pb::Volume, Status> {
        let want = with_limits(labels(&r.labels)?, &qos_limits(r.qos.as_ref())?);
        match self.pool.create_volume_with(&r.name, r.size_bytes, &want).await {
            Ok(v) => Ok(volume(v)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists && r.exist_ok => {
                self.existing(&r.name, |v| {
                    if v.size != r.size_bytes {
                        Err(format!("has size {} bytes, not {}", v.size, r.size_bytes))
                    } else if v.labels != want {
                        Err("has other labels or QoS limits".to_owned())
                    } else {
                        Ok(())
                    }
                })
                .await
            }
            Err(e) => Err(grpc_status(&e)),
        }
    }

    async fn do_create_snapshot(&self, r: pb::CreateSnapshotRequest) -> Result<pb::Volume, Status> {
        let want = labels(&r.labels)?;
        match self.pool.create_snapshot_with(&r.volume, &r.snapshot, &want).await {
            Ok(v) => Ok(volume(v)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists && r.exist_ok => {
                let full = format!("{}@{}", r.volume, r.snapshot);
                self.existing(&full, |v| if v.labels == want { Ok(()) } else { Err("has other labels".to_owned()) })
                    .await
            }
            Err(e) => Err(grpc_status(&e)),
        }
    }

    async fn do_create_group_snapshot(
        &self,
        r: pb::CreateGroupSnapshotRequest,
    ) -> Result<pb::ListSnapshotsResponse, Status> {
        let mut want = labels(&r.labels)?;
        want.insert(GROUP_SIZE_LABEL.to_owned(), r.volumes.len().to_string());
        let vols: Vec<&str> = r.volumes.iter().map(String::as_str).collect();
        // Members in the order the engine makes them: by volume name.
        let answer = |mut made: Vec<VolumeInfo>| {
            made.sort_by(|a, b| a.name.split('@').next().cmp(&b.name.split('@').next()));
            pb::ListSnapshotsResponse { snapshots: made.into_iter().map(volume).collect() }
        };
        let _one_at_a_time = self.groups.lock().await;
        let e = match self.pool.create_group_snapshot(&vols, &r.snapshot, &want).await {
            Ok(made) => return Ok(answer(made)),
            Err(e) => e,
        };
        if e.kind() != ErrorKind::AlreadyExists || !r.exist_ok {
            return Err(grpc_status(&e));
        }
        let members: Vec<Option<VolumeInfo>> =
            vols.iter().map(|v| self.pool.volume_info(&format!("{v}@{}", r.snapshot)).ok()).collect();
        // Only members of one group: the labels asked for, the server's group size
        // label among them, and one creation time.
        let present: Vec<&VolumeInfo> = members.iter().flatten().collect();
        let one_group =
            present.iter().all(|m| m.labels == want) && present.windows(2).all(|w| w[0].created == w[1].created);
        if !one_group {
            return Err(Status::already_exists(format!(
                "a snapshot {} of one of the volumes exists and is not a member of this group (other labels, or \
                 taken at another time)",
                r.snapshot
            )));
        }
        if present.len() == vols.len() {
            self.pool.flush().await.map_err(|e| grpc_status(&e))?;
            return Ok(answer(members.into_iter().flatten().collect()));
        }
        // Part of the group: a crash cut it short before it was answered. Taken again,
        // whole.
        for (v, m) in vols.iter().zip(&members) {
            if m.is_some() {
                tracing::warn!(volume = v, snapshot = %r.snapshot, "a partial group snapshot: its member is taken again");
                self.pool.delete_snapshot(v, &r.snapshot).await.map_err(|e| grpc_status(&e))?;
            }
        }
        self.pool.create_group_snapshot(&vols, &r.snapshot, &want).await.map(answer).map_err(|e| grpc_status(&e))
    }

    async fn do_clone_volume(&self, r: pb::CloneVolumeRequest) -> Result<pb::Volume, Status> {
        let mut want = with_limits(labels(&r.labels)?, &qos_limits(r.qos.as_ref())?);
        want.insert(ORIGIN_LABEL.to_owned(), r.source.clone());
        match self.pool.clone_volume_with(&r.source, &r.name, &want).await {
            Ok(v) => Ok(volume(v)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists && r.exist_ok => {
                self.existing(&r.name, |v| match v.labels.get(ORIGIN_LABEL) {
                    Some(o) if *o != r.source => Err(format!("is a clone of '{o}', not of '{}'", r.source)),
                    None => Err("is not a clone".to_owned()),
                    Some(_) if v.labels != want => Err("has other labels or QoS limits".to_owned()),
                    Some(_) => Ok(()),
                })
                .await
            }
            Err(e) => Err(grpc_status(&e)),
        }
    }

    /// Stores the limits, then applies them: in a task of its own, so that a caller
    /// that goes away between the two leaves no volume enforcing other limits than it
    /// stores; one at a time over every listener ([`Limiters::changing`]).
    async fn do_set_qos(&self, r: pb::SetVolumeQosRequest) -> Result<pb::Volume, Status> {
        let limits = qos_limits(r.qos.as_ref())?;
        let (pool, registry) = (self.pool.clone(), Arc::clone(&self.host.limits));
        let task = tokio::spawn(async move {
            let _one_at_a_time = registry.changing().await;
            let status = |e: storage_engine::Error| grpc_status(&e);
            pool.set_label(&r.name, QOS_LABEL, limits.to_label().as_deref()).await.map_err(status)?;
            let v = pool.volume_info(&r.name).map_err(status)?;
            registry.set(&v.name, v.id, limits);
            tracing::info!(volume = r.name, limits = %limits, "QoS limits set");
            Ok(volume(v))
        });
        task.await.map_err(|e| Status::internal(format!("setting QoS limits failed: {e}")))?
    }

    async fn do_publish(&self, r: pb::PublishVolumeRequest) -> Result<pb::Attachment, Status> {
        let a = self.pool.attach(&r.volume, &r.node_id, r.read_only, r.exclusive).await.map_err(|e| grpc_status(&e))?;
        let size = self.pool.volume(&r.volume).map_err(|e| grpc_status(&e))?.size();
        Ok(pb::Attachment {
            export_name: format!("{}/{}", r.volume, a.key.to_hex()),
            volume: r.volume,
            node_id: a.node_id,
            read_only: a.read_only,
            exclusive: a.exclusive,
            nbd_addresses: self.host.nbd_addresses.clone(),
            size_bytes: size,
            created_unix: a.created,
            nbd_tls: self.host.tls_name(),
        })
    }

    /// Detaches, then fences: in a task of its own, so that a caller that goes away
    /// (a deadline, a closed connection) stops neither. When the node was not (or is
    /// no longer) published, still waits for connections of keys revoked from it
    /// earlier that have not closed (an unpublish that timed out, retried).
    async fn do_unpublish(&self, r: pb::UnpublishVolumeRequest) -> Result<pb::UnpublishVolumeResponse, Status> {
        let (pool, fences) = (self.pool.clone(), Arc::clone(&self.host.fences));
        let local = Arc::clone(&self.host.local);
        let task = tokio::spawn(async move {
            let gone = pool.detach(&r.volume, &r.node_id).await.map_err(|e| grpc_status(&e))?;
            // The node's local device goes too (after the attachment: an attach that
            // checks it afterwards removes its own device).
            let (l, v, n) = (Arc::clone(&local), r.volume.clone(), r.node_id.clone());
            let _ = tokio::task::spawn_blocking(move || l.detach_for(&v, &n)).await;
            let mut keys = fences.pending(&r.volume, &r.node_id);
            if let Some(a) = &gone {
                keys.push(a.key);
            }
            for key in &keys {
                if !fences.revoke(key, &r.volume, &r.node_id, UNPUBLISH_WAIT).await {
                    return Err(Status::aborted(format!(
                        "unpublished '{}' from node '{}', but {} of its NBD connections did not close within {:?}: \
                         retry",
                        r.volume,
                        r.node_id,
                        fences.holders(key),
                        UNPUBLISH_WAIT
                    )));
                }
            }
            Ok(pb::UnpublishVolumeResponse { was_published: gone.is_some() })
        });
        task.await.map_err(|e| Status::internal(format!("unpublish failed: {e}")))?
    }
}

/// Runs a call that changes something and writes its audit line, whose arguments are
/// the request (which never holds a secret), named `$r` in `$body`.
macro_rules! audited {
    ($req:ident, $call:literal, |$r:ident| $body:expr) => {{
        let caller = caller(&$req);
        let $r = $req.into_inner();
        let audit = Audit { caller, call: $call, args: format!("{:?}", $r), outcome: None };
        let out = $body;
        audit.end(&out);
        out.map(Response::new)
    }};
}

#[tonic::async_trait]
impl Management for ManagementService {
    async fn create_volume(&self, req: Request<pb::CreateVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        audited!(req, "CreateVolume", |r| self.do_create_volume(r).await)
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        audited!(req, "DeleteVolume", |r| {
            let reserved = self.host.local.reserve(&r.name);
            if let Err(e) = reserved {
                Err(delete_refused(e))
            } else {
                let id = self.pool.volume_info(&r.name).map(|v| v.id).ok();
                let out = self.pool.delete_volume(&r.name).await;
                if let (Ok(()), Some(id)) = (&out, id) {
                    self.host.limits.forget(&r.name, id);
                }
                out.map(|()| pb::DeleteVolumeResponse {}).map_err(|e| grpc_status(&e))
            }
        })
    }

    async fn set_volume_qos(&self, req: Request<pb::SetVolumeQosRequest>) -> Result<Response<pb::Volume>, Status> {
        audited!(req, "SetVolumeQos", |r| self.do_set_qos(r).await)
    }

    async fn resize_volume(&self, req: Request<pb::ResizeVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        audited!(req, "ResizeVolume", |r| {
            let out = self.pool.resize_volume(&r.name, r.size_bytes).await.map(volume).map_err(|e| grpc_status(&e));
            if out.is_ok() && self.host.local.holds(&r.name) {
                let local = Arc::clone(&self.host.local);
                let _ = tokio::task::spawn_blocking(move || local.resized(&r.name, r.size_bytes)).await;
            }
            out
        })
    }

    async fn get_volume(&self, req: Request<pb::GetVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let v = self.pool.volume_info(&req.into_inner().name).map_err(|e| grpc_status(&e))?;
        Ok(Response::new(self.with_local(volume(v))))
    }

    async fn list_volumes(
        &self,
        _req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let volumes = self.pool.list_volumes().into_iter().map(|v| self.with_local(volume(v))).collect();
        Ok(Response::new(pb::ListVolumesResponse { volumes }))
    }

    async fn create_snapshot(&self, req: Request<pb::CreateSnapshotRequest>) -> Result<Response<pb::Volume>, Status> {
        audited!(req, "CreateSnapshot", |r| self.do_create_snapshot(r).await)
    }

    async fn create_group_snapshot(
        &self,
        req: Request<pb::CreateGroupSnapshotRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        audited!(req, "CreateGroupSnapshot", |r| self.do_create_group_snapshot(r).await)
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        audited!(req, "DeleteSnapshot", |r| {
            let name = format!("{}@{}", r.volume, r.snapshot);
            let reserved = self.host.local.reserve(&name);
            if let Err(e) = reserved {
                Err(delete_refused(e))
            } else {
                let r = self.pool.delete_snapshot(&r.volume, &r.snapshot).await;
                r.map(|()| pb::DeleteSnapshotResponse {}).map_err(|e| grpc_status(&e))
            }
        })
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let vol = (!r.volume.is_empty()).then_some(r.volume.as_str());
        let snapshots: Vec<_> = self.pool.list_snapshots(vol).into_iter().map(|v| self.with_local(volume(v))).collect();
        // A deleted volume's snapshots stay listed under its name; a name that has
        // neither a volume nor snapshots is a mistake worth saying so.
        if let Some(v) = vol {
            if snapshots.is_empty() && self.pool.volume(v).is_err() {
                return Err(Status::not_found(format!("no volume and no snapshots named '{v}'")));
            }
        }
        Ok(Response::new(pb::ListSnapshotsResponse { snapshots }))
    }

    async fn clone_volume(&self, req: Request<pb::CloneVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        audited!(req, "CloneVolume", |r| self.do_clone_volume(r).await)
    }

    async fn diff_snapshots(
        &self,
        req: Request<pb::DiffSnapshotsRequest>,
    ) -> Result<Response<pb::DiffSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let ranges = if r.from.is_empty() { self.pool.allocated(&r.to) } else { self.pool.diff(&r.from, &r.to) };
        let ranges = ranges.map_err(|e| grpc_status(&e))?;
        let ranges = ranges.into_iter().map(|(offset, length)| pb::ByteRange { offset, length }).collect();
        Ok(Response::new(pb::DiffSnapshotsResponse { ranges }))
    }

    async fn publish_volume(&self, req: Request<pb::PublishVolumeRequest>) -> Result<Response<pb::Attachment>, Status> {
        // The reply carries the key: the audit line shows the request only.
        audited!(req, "PublishVolume", |r| self.do_publish(r).await)
    }

    async fn unpublish_volume(
        &self,
        req: Request<pb::UnpublishVolumeRequest>,
    ) -> Result<Response<pb::UnpublishVolumeResponse>, Status> {
        audited!(req, "UnpublishVolume", |r| self.do_unpublish(r).await)
    }

    async fn attach_local(&self, req: Request<pb::AttachLocalRequest>) -> Result<Response<pb::LocalDevice>, Status> {
        audited!(req, "AttachLocal", |r| {
            // A node's device: only while the volume is published to it writable.
            let node = (!r.node_id.is_empty()).then_some(r.node_id.clone());
            let published_to = |pool: &storage_engine::Pool, node: &str| {
                pool.volume_info(&r.name).is_ok_and(|v| v.attachments.iter().any(|a| a.node_id == node && !a.read_only))
            };
            if let Some(n) = &node {
                if !published_to(&self.pool, n) {
                    return Err(Status::failed_precondition(format!(
                        "'{}' is not published to node '{n}' writable: no local device for it",
                        r.name
                    )));
                }
            }
            // The driver starts the device (and the kernel reads it) before this returns.
            let (pool, local, name) = (self.pool.clone(), Arc::clone(&self.host.local), r.name.clone());
            let n = node.clone();
            let d = match tokio::task::spawn_blocking(move || local.attach(&pool, &name, n.as_deref())).await {
                Ok(out) => out.map_err(local_status)?,
                Err(e) => return Err(Status::internal(format!("attaching locally failed: {e}"))),
            };
            // An unpublish that ran while the device started found none to remove:
            // the device, in the table now, goes if the attachment went.
            if let Some(n) = &node {
                if !published_to(&self.pool, n) {
                    let (local, name, node) = (Arc::clone(&self.host.local), r.name.clone(), n.clone());
                    let _ = tokio::task::spawn_blocking(move || local.detach_for(&name, &node)).await;
                    return Err(Status::failed_precondition(format!(
                        "'{}' was unpublished from node '{}' while its local device started: removed",
                        r.name, n
                    )));
                }
            }
            Ok(local_device(d))
        })
    }

    async fn detach_local(&self, req: Request<pb::DetachLocalRequest>) -> Result<Response<pb::LocalDevice>, Status> {
        audited!(req, "DetachLocal", |r| {
            let local = Arc::clone(&self.host.local);
            match tokio::task::spawn_blocking(move || local.detach(&r.name)).await {
                Ok(out) => out.map(local_device).map_err(|e| match e {
                    crate::local::LocalError::Exists(m) => Status::not_found(m),
                    e => local_status(e),
                }),
                Err(e) => Err(Status::internal(format!("detaching locally failed: {e}"))),
            }
        })
    }

    async fn get_host_info(&self, _req: Request<pb::GetHostInfoRequest>) -> Result<Response<pb::HostInfo>, Status> {
        let s = self.pool.status();
        Ok(Response::new(pb::HostInfo {
            host_id: s.uuid,
            nbd_addresses: self.host.nbd_addresses.clone(),
            nbd_access: self.host.access.as_str().to_owned(),
            capacity_bytes: s.capacity,
            free_bytes: s.free,
            reserved_bytes: s.reserved,
            format_version: storage_engine::format::FORMAT_VERSION,
            software_version: env!("CARGO_PKG_VERSION").to_owned(),
            unit_size_bytes: s.unit_size,
            nbd_tls: self.host.tls_name(),
        }))
    }

    async fn get_pool_status(
        &self,
        _req: Request<pb::GetPoolStatusRequest>,
    ) -> Result<Response<pb::PoolStatus>, Status> {
        Ok(Response::new(self.pool_status(self.pool.status())))
    }

    async fn grow_pool(&self, req: Request<pb::GrowPoolRequest>) -> Result<Response<pb::PoolStatus>, Status> {
        audited!(req, "GrowPool", |r| {
            let size = (r.size_bytes != 0).then_some(r.size_bytes);
            self.pool.grow(size).await.map(|s| self.pool_status(s)).map_err(|e| grpc_status(&e))
        })
    }
}

impl ManagementService {
    /// The wire form of the pool's status.
    fn pool_status(&self, s: storage_engine::PoolStatus) -> pb::PoolStatus {
        pb::PoolStatus {
            uuid: s.uuid,
            path: s.path.display().to_string(),
            capacity_bytes: s.capacity,
            used_bytes: s.used,
            metadata_bytes: s.metadata,
            free_bytes: s.free,
            unit_size_bytes: s.unit_size,
            volume_count: s.volumes,
            direct_io: s.direct_io,
            failed: s.failed,
            nbd_endpoints: self.host.endpoints.clone(),
            reserved_bytes: s.reserved,
            size_bytes: s.size,
        }
    }
}
