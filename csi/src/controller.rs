//! The CSI Controller service (spec.md "Controller Service RPC"): volumes, snapshots,
//! clones, attachments (ControllerPublish), capacity and expansion, over the storage
//! hosts' management API. It keeps no state: the hosts are the source of truth, and
//! IDs ([`crate::ids`]) say where each volume lives.
//!
//! Each RPC checks its arguments first (INVALID_ARGUMENT), takes its name in the
//! in-flight set (a second call on the same volume or snapshot name gets ABORTED),
//! then asks the hosts. Every call is logged with its name or ID and its outcome.
//! Group snapshots (the GroupController service) are in `group`, changed-block tracking
//! (the SnapshotMetadata service) in `metadata`. Not here: the Node
//! service, the hosts' connections ([`crate::hosts`]).

mod group;
mod metadata;
pub mod qos;

pub use group::{parse_group_snapshot_id, GroupSnapshotId, GROUP_LABEL};

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use mgmt_api::pb as api;
use tonic::{Code, Request, Response, Status};

use crate::hosts::{Conn, Host, Hosts, Surveyed};
use crate::ids::{
    check_name, parse_snapshot_id, parse_volume_id, snapshot_name, volume_name, SnapshotId, VolumeId, NAME_LABEL,
};
use crate::inflight::InFlight;
use crate::pb;
use crate::pb::volume_capability::access_mode::Mode;
use crate::pb::volume_capability::AccessType;
use crate::CsiError;

/// Size of a volume created without a capacity range: 1 GiB.
pub const DEFAULT_VOLUME_SIZE: u64 = 1 << 30;

/// Sizes are rounded up to this many bytes (the engine's block).
pub const SIZE_ALIGN: u64 = 4096;

/// The largest volume a storage host makes: 1 PiB (the engine's limit).
pub const MAX_VOLUME_SIZE: u64 = 1 << 50;

pub use mgmt_api::ORIGIN_LABEL;

/// The prefix of the node IDs ferrovol's node plugin reports (`ferrovol:NODE-NAME`).
/// A node ID without it was made by no ferrovol node: ControllerPublishVolume answers
/// NOT_FOUND.
pub const NODE_ID_PREFIX: &str = "ferrovol:";

/// Keys of the publish_context a ControllerPublishVolume returns, read by the node.
pub mod publish_context {
    /// The storage host's NBD addresses, `HOST:PORT`, comma-separated.
    pub const NBD_ADDRESSES: &str = "nbdAddresses";
    /// The NBD export name to open (`VOLUME/KEY`: the attachment's key).
    pub const EXPORT_NAME: &str = "exportName";
    /// `true` when the node may only read.
    pub const READ_ONLY: &str = "readOnly";
    /// The storage host's name.
    pub const HOST: &str = "host";
    /// The node the volume is published to: a node plugin refuses a context made for
    /// another node.
    pub const NODE_ID: &str = "nodeId";
    /// NBD over TLS on the storage host: `off`, `optional` or `required` (its
    /// `--nbd-tls`; absent from hosts of older builds, read as `off`).
    pub const NBD_TLS: &str = "nbdTls";
}

/// Keys of the volume_context of a created volume.
pub mod volume_context {
    /// The storage host's name.
    pub const HOST: &str = "ferrovol.io/host";
    /// The storage host's id (its pool's UUID).
    pub const HOST_ID: &str = "ferrovol.io/host-id";
}

/// The Controller service.
#[derive(Clone)]
pub struct Controller {
    hosts: Arc<Hosts>,
    inflight: InFlight,
    /// `volume/NAME` and `snapshot/NAME` this controller created or began to create in
    /// the last [`RECENT`], with the host's name.
    recent: Arc<std::sync::Mutex<HashMap<String, (String, std::time::Instant)>>>,
}

/// How long a controller remembers where it created a name: a retry of CreateVolume
/// or CreateSnapshot while that host does not answer gets UNAVAILABLE instead of a
/// second copy on another host.
pub const RECENT: std::time::Duration = std::time::Duration::from_secs(3600);

impl Controller {
    /// A controller over `hosts`.
    pub fn new(hosts: Arc<Hosts>) -> Controller {
        Controller { hosts, inflight: InFlight::default(), recent: Default::default() }
    }
}

type Res<T> = Result<T, CsiError>;

/// Logs the outcome of `call` on `subject` and makes the gRPC answer.
fn answer<T: std::fmt::Debug>(call: &str, subject: &str, r: Res<T>) -> Result<Response<T>, Status> {
    match r {
        Ok(v) => {
            tracing::info!(call, subject, "ok");
            tracing::debug!(call, subject, reply = ?v);
            Ok(Response::new(v))
        }
        Err(e) => {
            tracing::warn!(call, subject, code = ?e.code, error = %e.message, "failed");
            Err(e.into())
        }
    }
}

// ---- arguments ----

/// Checks one volume capability: block, or mount with ext4, xfs or the default file
/// system; an access mode that a volume on one storage host can give.
fn check_capability(c: &pb::VolumeCapability) -> Res<()> {
    match &c.access_type {
        None => return Err(CsiError::invalid("a volume capability has no access type (block or mount)")),
        Some(AccessType::Block(_)) => {}
        Some(AccessType::Mount(m)) => {
            if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
                return Err(CsiError::invalid(format!("file system {:?} is not supported: ext4 or xfs", m.fs_type)));
            }
        }
    }
    let mode = c.access_mode.as_ref().map(|m| m.mode()).unwrap_or(Mode::Unknown);
    match mode {
        Mode::SingleNodeWriter
        | Mode::SingleNodeSingleWriter
        | Mode::SingleNodeMultiWriter
        | Mode::SingleNodeReaderOnly
        | Mode::MultiNodeReaderOnly => Ok(()),
        Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter => Err(CsiError::invalid(format!(
            "access mode {} is not supported: a ferrovol volume has one writer node at a time",
            mode.as_str_name()
        ))),
        Mode::Unknown => Err(CsiError::invalid("a volume capability has no access mode")),
    }
}

fn check_capabilities(caps: &[pb::VolumeCapability]) -> Res<()> {
    if caps.is_empty() {
        return Err(CsiError::invalid("volume capabilities are missing"));
    }
    caps.iter().try_for_each(check_capability)
}

fn mode_of(c: &pb::VolumeCapability) -> Mode {
    c.access_mode.as_ref().map(|m| m.mode()).unwrap_or(Mode::Unknown)
}

/// Checks the parameters of a storage or snapshot class (`classes`, for the message)
/// against the keys ferrovol takes there (`accepted`); the keys the
/// external-provisioner and -snapshotter add (`csi.storage.k8s.io/...`) pass.
///
/// Errors: INVALID_ARGUMENT naming every unknown key.
fn check_parameters(p: &HashMap<String, String>, classes: &str, accepted: &[&str]) -> Res<()> {
    let mut unknown: Vec<String> = p
        .keys()
        .filter(|k| !k.starts_with("csi.storage.k8s.io/") && !accepted.contains(&k.as_str()))
        .map(|k| format!("{k:?}"))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    let takes = if accepted.is_empty() { "no parameters".to_owned() } else { format!("only {}", accepted.join(", ")) };
    Err(CsiError::invalid(format!("unknown parameters {}: ferrovol's {classes} take {takes}", unknown.join(", "))))
}

/// What a new volume is made with beside its size: its labels and QoS limits.
struct Given {
    labels: HashMap<String, String>,
    qos: Option<api::Qos>,
}

/// The QoS limits a new volume gets (spec.md CreateVolume): its storage class's
/// `parameters`, then its VolumeAttributesClass's `mutable_parameters` over them;
/// `None` when unlimited.
///
/// Errors: INVALID_ARGUMENT for unknown keys (naming them) and invalid values.
fn volume_qos(parameters: &HashMap<String, String>, mutable: &HashMap<String, String>) -> Res<Option<api::Qos>> {
    check_parameters(parameters, "storage classes", &qos::KEYS)?;
    let unknown = qos::unknown_keys(mutable);
    if !unknown.is_empty() {
        return Err(CsiError::invalid(format!(
            "unknown mutable_parameters {unknown:?}: ferrovol's take only {}",
            qos::KEYS.join(", ")
        )));
    }
    let q = qos::apply(qos::apply(api::Qos::default(), parameters, "parameters")?, mutable, "mutable_parameters")?;
    Ok((!qos::is_unlimited(&q)).then_some(q))
}

/// The size a capacity range asks for (spec.md CreateVolume `capacity_range`): the
/// required bytes rounded up to [`SIZE_ALIGN`], or [`DEFAULT_VOLUME_SIZE`] (at most the
/// limit) when none is required.
///
/// Errors: OUT_OF_RANGE for negative values, a limit below the requirement, or a limit
/// under one block.
fn size_for(range: Option<&pb::CapacityRange>) -> Res<u64> {
    let (req, lim) = range.map(|r| (r.required_bytes, r.limit_bytes)).unwrap_or((0, 0));
    let oor = |m: String| CsiError::new(Code::OutOfRange, m);
    if req < 0 || lim < 0 {
        return Err(oor(format!("capacity range {req}..{lim} has a negative bound")));
    }
    let (req, lim) = (req as u64, lim as u64);
    let size = if req == 0 {
        if lim > 0 {
            (lim / SIZE_ALIGN * SIZE_ALIGN).min(DEFAULT_VOLUME_SIZE)
        } else {
            DEFAULT_VOLUME_SIZE
        }
    } else {
        req.div_ceil(SIZE_ALIGN) * SIZE_ALIGN
    };
    if size > MAX_VOLUME_SIZE {
        return Err(oor(format!("{size} bytes is more than a volume can hold ({MAX_VOLUME_SIZE})")));
    }
    if size == 0 || (lim > 0 && size > lim) {
        return Err(oor(format!(
            "no size in {req}..{lim} bytes is a multiple of {SIZE_ALIGN} (the required size is rounded up to it)"
        )));
    }
    Ok(size)
}

/// Whether an existing volume of `size` bytes meets a capacity range.
fn size_meets(size: u64, range: Option<&pb::CapacityRange>) -> bool {
    let (req, lim) = range.map(|r| (r.required_bytes.max(0) as u64, r.limit_bytes.max(0) as u64)).unwrap_or((0, 0));
    size >= req && (lim == 0 || size <= lim)
}

fn need(what: &str, v: &str) -> Res<()> {
    if v.is_empty() {
        Err(CsiError::invalid(format!("{what} is missing")))
    } else {
        Ok(())
    }
}

/// Checks a node ID's shape: [`NODE_ID_PREFIX`] and a name.
///
/// Errors: NOT_FOUND for an ID no ferrovol node makes.
fn check_node_id(node: &str) -> Res<()> {
    match node.strip_prefix(NODE_ID_PREFIX) {
        Some(name)
            if !name.is_empty() && name.len() <= 256 - NODE_ID_PREFIX.len() && !name.chars().any(char::is_control) =>
        {
            Ok(())
        }
        _ => Err(CsiError::not_found(format!(
            "node {node:?} is not a ferrovol node (its node plugin reports ids {NODE_ID_PREFIX}NODE-NAME)"
        ))),
    }
}

// ---- topology and placement ----

fn topology_matches(t: &pb::Topology, segs: &BTreeMap<String, String>) -> bool {
    t.segments.iter().all(|(k, v)| segs.get(k) == Some(v))
}

/// Where a volume on host `h` can be used: from any node of the host's zone (every
/// node reaches every storage host over the network), or from anywhere when the host
/// has no zone. The host's own segment is for choosing a host, never a node.
fn volume_topology(h: &Host) -> Vec<pb::Topology> {
    h.config.zone.as_ref().map(|z| crate::zone_topology(z)).into_iter().collect()
}

fn allowed_by(req: Option<&pb::TopologyRequirement>, h: &Host) -> bool {
    match req {
        Some(r) if !r.requisite.is_empty() => r.requisite.iter().any(|t| topology_matches(t, &h.config.segments())),
        _ => true,
    }
}

// ---- replies ----

fn timestamp(unix: u64) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds: unix as i64, nanos: 0 }
}

/// The content source a volume was made from, from its origin label.
fn source_of(conn: &Conn, v: &api::Volume) -> Option<pb::VolumeContentSource> {
    use pb::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let origin = v.labels.get(ORIGIN_LABEL)?;
    let t = match origin.split_once('@') {
        Some((vol, snap)) => Type::Snapshot(SnapshotSource {
            snapshot_id: SnapshotId { host: conn.short.clone(), volume: vol.into(), snapshot: snap.into() }.to_string(),
        }),
        None => Type::Volume(VolumeSource {
            volume_id: VolumeId { host: conn.short.clone(), name: origin.clone() }.to_string(),
        }),
    };
    Some(pb::VolumeContentSource { r#type: Some(t) })
}

fn csi_volume(h: &Host, conn: &Conn, v: &api::Volume) -> pb::Volume {
    pb::Volume {
        capacity_bytes: v.size_bytes as i64,
        volume_id: VolumeId { host: conn.short.clone(), name: v.name.clone() }.to_string(),
        volume_context: [
            (volume_context::HOST.to_string(), h.name().to_string()),
            (volume_context::HOST_ID.to_string(), conn.host_id.clone()),
        ]
        .into_iter()
        .collect(),
        content_source: source_of(conn, v),
        accessible_topology: volume_topology(h),
    }
}

fn csi_snapshot(conn: &Conn, v: &api::Volume) -> Option<pb::Snapshot> {
    let (vol, snap) = v.name.split_once('@')?;
    Some(pb::Snapshot {
        size_bytes: v.size_bytes as i64,
        snapshot_id: SnapshotId { host: conn.short.clone(), volume: vol.into(), snapshot: snap.into() }.to_string(),
        source_volume_id: VolumeId { host: conn.short.clone(), name: vol.into() }.to_string(),
        creation_time: Some(timestamp(v.created_unix)),
        ready_to_use: true,
        group_snapshot_id: String::new(),
    })
}

fn published_nodes(v: &api::Volume) -> Vec<String> {
    v.attachments.iter().map(|a| a.node_id.clone()).collect()
}

/// The volume condition of a volume on a host whose pool reports `failed`.
fn condition(failed: bool) -> pb::VolumeCondition {
    if failed {
        pb::VolumeCondition {
            abnormal: true,
            message: "the storage host's pool has failed after an I/O error: the volume cannot be written".into(),
        }
    } else {
        pb::VolumeCondition { abnormal: false, message: "healthy".into() }
    }
}

/// One page of `items` (sorted by key) after `token` (spec.md ListVolumes paging):
/// the page and the next token (empty at the end).
///
/// Errors: INVALID_ARGUMENT for a negative `max_entries`; ABORTED for a token that
/// `valid` refuses (no page of this controller ends there).
fn page<T>(
    mut items: Vec<(String, T)>,
    max_entries: i32,
    token: &str,
    valid: impl Fn(&str) -> bool,
) -> Res<(Vec<T>, String)> {
    if max_entries < 0 {
        return Err(CsiError::invalid(format!("max_entries {max_entries} is negative")));
    }
    if !token.is_empty() && !valid(token) {
        return Err(CsiError::new(
            Code::Aborted,
            format!("starting_token {token:?} is not a token this controller gave"),
        ));
    }
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let start = if token.is_empty() { 0 } else { items.partition_point(|(k, _)| k.as_str() <= token) };
    let rest = items.split_off(start);
    let n = if max_entries == 0 { rest.len() } else { (max_entries as usize).min(rest.len()) };
    let next = if n < rest.len() { rest[n - 1].0.clone() } else { String::new() };
    Ok((rest.into_iter().take(n).map(|(_, v)| v).collect(), next))
}

// ---- the calls ----

impl Controller {
    /// The host of a volume or snapshot ID's short host id.
    ///
    /// Errors: NOT_FOUND (`what` named) when every host answered and none has it;
    /// UNAVAILABLE when some do not answer.
    async fn host_of(&self, short: &str, what: &str) -> Res<(&Host, Conn)> {
        self.hosts
            .by_short_id(short)
            .await?
            .ok_or_else(|| CsiError::not_found(format!("{what} does not exist: no storage host {short}")))
    }

    /// Remembers that this controller is creating `key` on host `host`, for
    /// [`Controller::check_recent`], for [`RECENT`].
    fn remember(&self, key: &str, host: &str) {
        let mut m = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, (_, at)| at.elapsed() < RECENT);
        m.insert(key.to_string(), (host.to_string(), std::time::Instant::now()));
    }

    /// UNAVAILABLE when this controller created (or tried to create) `key` on a host
    /// among `down` in the last [`RECENT`]: a retry must not make it a second time
    /// elsewhere (the first answer may have been lost).
    fn check_recent(&self, key: &str, down: &[&Host]) -> Res<()> {
        let m = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((host, at)) = m.get(key) {
            if at.elapsed() < RECENT && down.iter().any(|h| h.name() == host) {
                return Err(CsiError::unavailable(format!(
                    "{key} was being created on storage host {host}, which does not answer: retry when it does"
                )));
            }
        }
        Ok(())
    }

    async fn create_volume(&self, r: pb::CreateVolumeRequest) -> Res<pb::CreateVolumeResponse> {
        check_name("volume", &r.name)?;
        check_capabilities(&r.volume_capabilities)?;
        let qos = volume_qos(&r.parameters, &r.mutable_parameters)?;
        let size = size_for(r.capacity_range.as_ref())?;
        let key = format!("volume/{}", r.name);
        let _guard = self.inflight.take(key.clone())?;
        let name = volume_name(&r.name);
        let survey = self.hosts.survey().await;
        // The name first: a retry finds what an earlier call made, whatever became of
        // its source since.
        let mut down = Vec::new();
        for s in &survey {
            match &s.answer {
                Ok(view) => {
                    if let Some(v) = view.volumes.iter().find(|v| v.name == name) {
                        return self.existing_volume(s.host, &view.conn, v.clone(), &r, size).await;
                    }
                }
                Err(_) => down.push(s.host),
            }
        }
        self.check_recent(&key, &down)?;
        let mut labels = std::collections::HashMap::new();
        labels.insert(NAME_LABEL.to_string(), r.name.clone());
        let (h, conn, v) = match r.volume_content_source.as_ref().and_then(|s| s.r#type.as_ref()) {
            Some(t) => {
                let src = self.resolve_source(t).await?;
                self.remember(&key, src.host.name());
                self.create_clone(&r, &name, size, Given { labels, qos }, src).await?
            }
            None => self.create_fresh(&r, &name, size, Given { labels, qos }, &key, survey).await?,
        };
        Ok(pb::CreateVolumeResponse { volume: Some(csi_volume(h, &conn, &v)) })
    }

    /// The host and full name of a content source, with its size.
    ///
    /// Errors: NOT_FOUND when it does not exist; UNAVAILABLE when its host does not
    /// answer.
    async fn resolve_source(&self, t: &pb::volume_content_source::Type) -> Res<Source<'_>> {
        use pb::volume_content_source::Type;
        let (short, full, what) = match t {
            Type::Snapshot(s) => {
                let id = parse_snapshot_id(&s.snapshot_id).ok_or_else(|| {
                    CsiError::not_found(format!("source snapshot {:?} does not exist", s.snapshot_id))
                })?;
                (id.host.clone(), id.full_name(), format!("source snapshot {}", s.snapshot_id))
            }
            Type::Volume(v) => {
                let id = parse_volume_id(&v.volume_id)
                    .ok_or_else(|| CsiError::not_found(format!("source volume {:?} does not exist", v.volume_id)))?;
                (id.host.clone(), id.name, format!("source volume {}", v.volume_id))
            }
        };
        let (host, conn) = self.host_of(&short, &what).await?;
        let f = full.clone();
        let v = host.call("look up the content source", |c| async move { c.volume(&f).await }).await.map_err(|e| {
            if e.code == Code::NotFound {
                CsiError::not_found(format!("{what} does not exist"))
            } else {
                e
            }
        })?;
        Ok(Source { host, conn, full, size: v.size_bytes, what })
    }

    /// CreateVolume for a name that exists: the same answer if it matches the request
    /// (its size in the range, the same content source, a host the topology allows;
    /// finishing a clone's growth that an earlier call did not), else ALREADY_EXISTS.
    async fn existing_volume(
        &self,
        h: &Host,
        conn: &Conn,
        v: api::Volume,
        r: &pb::CreateVolumeRequest,
        size: u64,
    ) -> Res<pb::CreateVolumeResponse> {
        let exists = |why: String| CsiError::new(Code::AlreadyExists, format!("volume {} exists {why}", r.name));
        if v.labels.get(NAME_LABEL).is_some_and(|n| *n != r.name) {
            return Err(exists(format!("under the host name {} for another CSI name", v.name)));
        }
        let wanted = r.volume_content_source.as_ref().and_then(|s| s.r#type.as_ref()).map(|t| {
            use pb::volume_content_source::Type;
            match t {
                Type::Snapshot(s) => parse_snapshot_id(&s.snapshot_id).map(|id| (id.host.clone(), id.full_name())),
                Type::Volume(v) => parse_volume_id(&v.volume_id).map(|id| (id.host, id.name)),
            }
        });
        let origin = v.labels.get(ORIGIN_LABEL);
        let same_source = match &wanted {
            None => origin.is_none(),
            Some(None) => false,
            Some(Some((short, full))) => *short == conn.short && origin == Some(full),
        };
        if !same_source {
            return Err(exists("with another content source".into()));
        }
        if !allowed_by(r.accessibility_requirements.as_ref(), h) {
            return Err(exists(format!("on storage host {}, which the topology requirements exclude", h.name())));
        }
        let range = r.capacity_range.as_ref();
        let required = range.map(|c| c.required_bytes).unwrap_or(0) > 0;
        let v = if wanted.is_some() && required && v.size_bytes < size && size_meets(size, range) {
            let name = v.name.clone();
            h.call("grow the clone", |c| async move { c.resize_volume(&name, size).await }).await?
        } else {
            v
        };
        if !size_meets(v.size_bytes, range) {
            return Err(exists(format!("with {} bytes, outside the requested range", v.size_bytes)));
        }
        Ok(pb::CreateVolumeResponse { volume: Some(csi_volume(h, conn, &v)) })
    }

    async fn create_clone<'a>(
        &'a self,
        r: &pb::CreateVolumeRequest,
        name: &str,
        size: u64,
        given: Given,
        src: Source<'a>,
    ) -> Res<(&'a Host, Conn, api::Volume)> {
        let want = clone_size(r.capacity_range.as_ref(), size, &src)?;
        if !allowed_by(r.accessibility_requirements.as_ref(), src.host) {
            return Err(CsiError::new(
                Code::ResourceExhausted,
                format!(
                    "a clone lives on its source's storage host {}, which the accessibility requirements exclude",
                    src.host.name()
                ),
            ));
        }
        let Given { labels, qos } = given;
        let req =
            api::CloneVolumeRequest { source: src.full.clone(), name: name.to_string(), labels, exist_ok: true, qos };
        let v = src.host.call("clone", |c| async move { c.clone_volume_with(req).await }).await?;
        let v = if v.size_bytes < want {
            let name = v.name.clone();
            src.host.call("grow the clone", |c| async move { c.resize_volume(&name, want).await }).await?
        } else {
            v
        };
        Ok((src.host, src.conn, v))
    }

    /// Places a new volume (spec.md CreateVolume `accessibility_requirements`): hosts
    /// allowed by the requisite topologies with room for it ([`View::available`]); the
    /// first preferred topology that has one; among those the host with the most room
    /// (then the fewest volumes, then the first in the configuration).
    async fn create_fresh<'a>(
        &'a self,
        r: &pb::CreateVolumeRequest,
        name: &str,
        size: u64,
        given: Given,
        key: &str,
        survey: Vec<Surveyed<'a>>,
    ) -> Res<(&'a Host, Conn, api::Volume)> {
        let req = r.accessibility_requirements.as_ref();
        let mut down = Vec::new();
        let mut full = Vec::new();
        let mut fits: Vec<(usize, &Host, Conn, u64, usize)> = Vec::new();
        for (i, s) in survey.into_iter().enumerate() {
            if !allowed_by(req, s.host) {
                continue;
            }
            match s.answer {
                Err(e) => down.push(e.message),
                Ok(view) => {
                    let avail = view.available(self.hosts.overcommit);
                    if view.failed {
                        full.push(format!("{}'s pool has failed", s.host.name()));
                    } else if avail >= size {
                        fits.push((i, s.host, view.conn.clone(), avail, view.volumes.len()));
                    } else {
                        full.push(format!("{} has room for {avail} bytes", s.host.name()));
                    }
                }
            }
        }
        // Most room, then fewest volumes, then configuration order.
        let best = |c: &[&(usize, &'a Host, Conn, u64, usize)]| -> Option<(usize, &'a Host, Conn, u64, usize)> {
            c.iter().min_by_key(|(i, _, _, avail, n)| (std::cmp::Reverse(*avail), *n, *i)).map(|x| (*x).clone())
        };
        let preferred = req.map(|r| r.preferred.as_slice()).unwrap_or_default();
        let pick = preferred
            .iter()
            .find_map(|t| {
                best(&fits.iter().filter(|f| topology_matches(t, &f.1.config.segments())).collect::<Vec<_>>())
            })
            .or_else(|| best(&fits.iter().collect::<Vec<_>>()));
        let Some((_, h, conn, _, _)) = pick else {
            if full.is_empty() && !down.is_empty() {
                return Err(CsiError::unavailable(format!("no allowed storage host answers: {}", down.join("; "))));
            }
            let mut why = full;
            if !down.is_empty() {
                why.push(format!("not answering: {}", down.join("; ")));
            }
            return Err(CsiError::new(
                Code::ResourceExhausted,
                format!(
                    "no storage host allowed by the topology requirements has room for {size} bytes{}",
                    if why.is_empty() { String::new() } else { format!(" ({})", why.join(", ")) }
                ),
            ));
        };
        self.remember(key, h.name());
        let Given { labels, qos } = given;
        let req = api::CreateVolumeRequest { name: name.to_string(), size_bytes: size, labels, exist_ok: true, qos };
        let v = h.call("create the volume", |c| async move { c.create_volume_with(req).await }).await?;
        Ok((h, conn, v))
    }

    async fn delete_volume(&self, r: pb::DeleteVolumeRequest) -> Res<pb::DeleteVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        let Some(id) = parse_volume_id(&r.volume_id) else { return Ok(pb::DeleteVolumeResponse {}) };
        let _guard = self.inflight.take(format!("volume/{}", id.name))?;
        let Some((h, _)) = self.hosts.by_short_id(&id.host).await? else { return Ok(pb::DeleteVolumeResponse {}) };
        let name = id.name.clone();
        match h.call("delete the volume", |c| async move { c.delete_volume(&name).await }).await {
            Ok(()) => Ok(pb::DeleteVolumeResponse {}),
            Err(e) if e.code == Code::NotFound => Ok(pb::DeleteVolumeResponse {}),
            Err(e) => Err(e),
        }
    }

    /// The volume of `volume_id` on its host.
    ///
    /// Errors: NOT_FOUND, UNAVAILABLE.
    async fn volume_of(&self, volume_id: &str) -> Res<(&Host, Conn, api::Volume)> {
        let missing = || CsiError::not_found(format!("volume {volume_id:?} does not exist"));
        let id = parse_volume_id(volume_id).ok_or_else(missing)?;
        let (h, conn) = self.host_of(&id.host, &format!("volume {volume_id}")).await?;
        let name = id.name.clone();
        let v = h.call("look up the volume", |c| async move { c.volume(&name).await }).await.map_err(|e| {
            if e.code == Code::NotFound {
                missing()
            } else {
                e
            }
        })?;
        if v.snapshot {
            return Err(missing());
        }
        Ok((h, conn, v))
    }

    async fn publish(&self, r: pb::ControllerPublishVolumeRequest) -> Res<pb::ControllerPublishVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        need("node_id", &r.node_id)?;
        let cap = r.volume_capability.as_ref().ok_or_else(|| CsiError::invalid("volume_capability is missing"))?;
        check_capability(cap)?;
        let (h, _conn, v) = self.volume_of(&r.volume_id).await?;
        check_node_id(&r.node_id)?;
        let _guard = self.inflight.take(format!("volume/{}", v.name))?;
        let mode = mode_of(cap);
        let read_only = r.readonly || matches!(mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly);
        let exclusive = matches!(
            mode,
            Mode::SingleNodeWriter
                | Mode::SingleNodeSingleWriter
                | Mode::SingleNodeMultiWriter
                | Mode::SingleNodeReaderOnly
        );
        let req =
            api::PublishVolumeRequest { volume: v.name.clone(), node_id: r.node_id.clone(), read_only, exclusive };
        let a = h.call("publish the volume", |c| async move { c.publish(req).await }).await?;
        let ctx = [
            (publish_context::NBD_ADDRESSES.to_string(), a.nbd_addresses.join(",")),
            (publish_context::EXPORT_NAME.to_string(), a.export_name),
            (publish_context::READ_ONLY.to_string(), a.read_only.to_string()),
            (publish_context::HOST.to_string(), h.name().to_string()),
            (publish_context::NODE_ID.to_string(), r.node_id.clone()),
            (publish_context::NBD_TLS.to_string(), if a.nbd_tls.is_empty() { "off".into() } else { a.nbd_tls }),
        ];
        Ok(pb::ControllerPublishVolumeResponse { publish_context: ctx.into_iter().collect() })
    }

    async fn unpublish(&self, r: pb::ControllerUnpublishVolumeRequest) -> Res<pb::ControllerUnpublishVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        let done = pb::ControllerUnpublishVolumeResponse {};
        let Some(id) = parse_volume_id(&r.volume_id) else { return Ok(done) };
        let _guard = self.inflight.take(format!("volume/{}", id.name))?;
        let Some((h, _)) = self.hosts.by_short_id(&id.host).await? else { return Ok(done) };
        let nodes = if r.node_id.is_empty() {
            let name = id.name.clone();
            match h.call("look up the volume", |c| async move { c.volume(&name).await }).await {
                Ok(v) => published_nodes(&v),
                Err(e) if e.code == Code::NotFound => return Ok(done),
                Err(e) => return Err(e),
            }
        } else {
            vec![r.node_id.clone()]
        };
        for node in nodes {
            let name = id.name.clone();
            match h.call("unpublish the volume", |c| async move { c.unpublish(&name, &node).await }).await {
                Ok(_) => {}
                Err(e) if e.code == Code::NotFound => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    async fn validate(&self, r: pb::ValidateVolumeCapabilitiesRequest) -> Res<pb::ValidateVolumeCapabilitiesResponse> {
        need("volume_id", &r.volume_id)?;
        if r.volume_capabilities.is_empty() {
            return Err(CsiError::invalid("volume_capabilities are missing"));
        }
        self.volume_of(&r.volume_id).await?;
        let bad = r
            .volume_capabilities
            .iter()
            .find_map(|c| check_capability(c).err())
            .or_else(|| volume_qos(&r.parameters, &r.mutable_parameters).err());
        Ok(match bad {
            Some(e) => pb::ValidateVolumeCapabilitiesResponse { confirmed: None, message: e.message },
            None => pb::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context,
                    volume_capabilities: r.volume_capabilities,
                    parameters: r.parameters,
                    mutable_parameters: r.mutable_parameters,
                }),
                message: String::new(),
            },
        })
    }

    /// Every volume (not snapshots) of every host, with its pool's health.
    ///
    /// Errors: UNAVAILABLE when a host does not answer (a listing without its volumes
    /// would be wrong).
    async fn all_volumes(&self) -> Res<Vec<(String, pb::list_volumes_response::Entry)>> {
        use pb::list_volumes_response::{Entry, VolumeStatus};
        let mut out = Vec::new();
        for s in self.hosts.survey().await {
            let view = s.answer?;
            let h = s.host;
            let (conn, failed) = (&view.conn, view.failed);
            for v in view.volumes.iter().filter(|v| !v.snapshot) {
                let vol = csi_volume(h, conn, v);
                out.push((
                    vol.volume_id.clone(),
                    Entry {
                        volume: Some(vol),
                        status: Some(VolumeStatus {
                            published_node_ids: published_nodes(v),
                            volume_condition: Some(condition(failed)),
                        }),
                    },
                ));
            }
        }
        Ok(out)
    }

    async fn list_volumes(&self, r: pb::ListVolumesRequest) -> Res<pb::ListVolumesResponse> {
        if r.max_entries < 0 {
            return Err(CsiError::invalid(format!("max_entries {} is negative", r.max_entries)));
        }
        if !r.starting_token.is_empty() && parse_volume_id(&r.starting_token).is_none() {
            return Err(CsiError::new(
                Code::Aborted,
                format!("starting_token {:?} is not a token this controller gave", r.starting_token),
            ));
        }
        let all = self.all_volumes().await?;
        let (entries, next_token) = page(all, r.max_entries, &r.starting_token, |t| parse_volume_id(t).is_some())?;
        Ok(pb::ListVolumesResponse { entries, next_token })
    }

    async fn get_volume(&self, r: pb::ControllerGetVolumeRequest) -> Res<pb::ControllerGetVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        let (h, conn, v) = self.volume_of(&r.volume_id).await?;
        let failed = h.call("read the pool status", |c| async move { c.pool_status().await }).await?.failed;
        Ok(pb::ControllerGetVolumeResponse {
            volume: Some(csi_volume(h, &conn, &v)),
            status: Some(pb::controller_get_volume_response::VolumeStatus {
                published_node_ids: published_nodes(&v),
                volume_condition: Some(condition(failed)),
            }),
        })
    }

    async fn get_capacity(&self, r: pb::GetCapacityRequest) -> Res<pb::GetCapacityResponse> {
        if r.volume_capabilities.iter().any(|c| check_capability(c).is_err())
            || volume_qos(&r.parameters, &HashMap::new()).is_err()
        {
            return Ok(pb::GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: Some(0),
                minimum_volume_size: None,
            });
        }
        let mut total = 0u64;
        let mut largest = 0u64;
        for s in self.hosts.survey().await {
            let Ok(view) = s.answer else { continue };
            if let Some(t) = &r.accessible_topology {
                if !topology_matches(t, &s.host.config.segments()) {
                    continue;
                }
            }
            let room = view.available(self.hosts.overcommit).min(MAX_VOLUME_SIZE) / SIZE_ALIGN * SIZE_ALIGN;
            total = total.saturating_add(room);
            largest = largest.max(room);
        }
        Ok(pb::GetCapacityResponse {
            available_capacity: total.min(i64::MAX as u64) as i64,
            maximum_volume_size: Some(largest.min(i64::MAX as u64) as i64),
            minimum_volume_size: Some(SIZE_ALIGN as i64),
        })
    }

    /// ControllerModifyVolume: the QoS keys given change their limits on the volume's
    /// host (at once, on its open connections); the others stay, and with none given
    /// nothing changes (csi-sanity sends none when it has no parameters to try).
    ///
    /// Errors: INVALID_ARGUMENT (no volume_id, unknown keys named, invalid values),
    /// NOT_FOUND, ABORTED (a call on the volume in flight), UNAVAILABLE.
    async fn modify(&self, r: pb::ControllerModifyVolumeRequest) -> Res<pb::ControllerModifyVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        let unknown = qos::unknown_keys(&r.mutable_parameters);
        if !unknown.is_empty() {
            return Err(CsiError::invalid(format!(
                "unknown mutable_parameters {unknown:?}: ferrovol's take only {}",
                qos::KEYS.join(", ")
            )));
        }
        // The volume's name is taken before its limits are read, so that two modifies
        // of one volume never both start from the same limits.
        let _guard = match parse_volume_id(&r.volume_id) {
            Some(id) => Some(self.inflight.take(format!("volume/{}", id.name))?),
            None => None,
        };
        let (h, _conn, v) = self.volume_of(&r.volume_id).await?;
        if r.mutable_parameters.is_empty() {
            return Ok(pb::ControllerModifyVolumeResponse {});
        }
        let want = qos::apply(v.qos.unwrap_or_default(), &r.mutable_parameters, "mutable_parameters")?;
        let req = api::SetVolumeQosRequest { name: v.name.clone(), qos: Some(want) };
        h.call("set the QoS limits", |c| async move { c.set_volume_qos(req).await }).await?;
        Ok(pb::ControllerModifyVolumeResponse {})
    }

    async fn expand(&self, r: pb::ControllerExpandVolumeRequest) -> Res<pb::ControllerExpandVolumeResponse> {
        need("volume_id", &r.volume_id)?;
        let range = r.capacity_range.as_ref().ok_or_else(|| CsiError::invalid("capacity_range is missing"))?;
        if let Some(c) = &r.volume_capability {
            check_capability(c)?;
        }
        if range.required_bytes <= 0 {
            return Err(CsiError::invalid("capacity_range.required_bytes is missing: the size to grow to"));
        }
        let size = size_for(Some(range))?;
        let (h, _conn, v) = self.volume_of(&r.volume_id).await?;
        let _guard = self.inflight.take(format!("volume/{}", v.name))?;
        let node_expansion_required =
            !matches!(r.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()), Some(AccessType::Block(_)));
        let v = if v.size_bytes >= size {
            v
        } else {
            let view = h.view().await?;
            let (grow, avail) = (size - v.size_bytes, view.available(self.hosts.overcommit));
            if grow > avail {
                return Err(CsiError::new(
                    Code::ResourceExhausted,
                    format!(
                        "storage host {} has room for {avail} more bytes, not the {grow} this growth takes",
                        h.name()
                    ),
                ));
            }
            let name = v.name.clone();
            h.call("grow the volume", |c| async move { c.resize_volume(&name, size).await }).await?
        };
        if !size_meets(v.size_bytes, Some(range)) && range.limit_bytes > 0 && v.size_bytes > range.limit_bytes as u64 {
            return Err(CsiError::new(
                Code::OutOfRange,
                format!(
                    "volume {} holds {} bytes, more than the limit {}: volumes do not shrink",
                    r.volume_id, v.size_bytes, range.limit_bytes
                ),
            ));
        }
        Ok(pb::ControllerExpandVolumeResponse { capacity_bytes: v.size_bytes as i64, node_expansion_required })
    }

    async fn create_snapshot(&self, r: pb::CreateSnapshotRequest) -> Res<pb::CreateSnapshotResponse> {
        need("source_volume_id", &r.source_volume_id)?;
        check_name("snapshot", &r.name)?;
        check_parameters(&r.parameters, "snapshot classes", &[])?;
        let key = format!("snapshot/{}", r.name);
        let _guard = self.inflight.take(key.clone())?;
        let snap_name = snapshot_name(&r.name);
        // The name first, on every host: the same name of another source is refused.
        let mut down = Vec::new();
        for s in self.hosts.survey().await {
            let view = match s.answer {
                Ok(v) => v,
                Err(_) => {
                    down.push(s.host);
                    continue;
                }
            };
            let snaps = s.host.call("list the snapshots", |c| async move { c.list_snapshots(None).await }).await?;
            let found = snaps.into_iter().find(|v| {
                v.name.split_once('@').is_some_and(|(_, n)| n == snap_name)
                    && v.labels.get(NAME_LABEL).is_none_or(|n| *n == r.name)
            });
            if let Some(v) = found {
                let snap = csi_snapshot(&view.conn, &v)
                    .ok_or_else(|| CsiError::new(Code::Internal, "a snapshot without '@'"))?;
                if snap.source_volume_id != r.source_volume_id {
                    return Err(CsiError::new(
                        Code::AlreadyExists,
                        format!("snapshot {} exists with source volume {}", r.name, snap.source_volume_id),
                    ));
                }
                return Ok(pb::CreateSnapshotResponse { snapshot: Some(snap) });
            }
        }
        self.check_recent(&key, &down)?;
        let (h, conn, v) = self.volume_of(&r.source_volume_id).await?;
        self.remember(&key, h.name());
        let req = api::CreateSnapshotRequest {
            volume: v.name.clone(),
            snapshot: snap_name,
            labels: [(NAME_LABEL.to_string(), r.name.clone())].into_iter().collect(),
            exist_ok: true,
        };
        let s = h.call("create the snapshot", |c| async move { c.create_snapshot_with(req).await }).await?;
        let snap = csi_snapshot(&conn, &s).ok_or_else(|| CsiError::new(Code::Internal, "a snapshot without '@'"))?;
        Ok(pb::CreateSnapshotResponse { snapshot: Some(snap) })
    }

    async fn delete_snapshot(&self, r: pb::DeleteSnapshotRequest) -> Res<pb::DeleteSnapshotResponse> {
        need("snapshot_id", &r.snapshot_id)?;
        let Some(id) = parse_snapshot_id(&r.snapshot_id) else { return Ok(pb::DeleteSnapshotResponse {}) };
        let _guard = self.inflight.take(format!("snapshot/{}", id.snapshot))?;
        let Some((h, _)) = self.hosts.by_short_id(&id.host).await? else { return Ok(pb::DeleteSnapshotResponse {}) };
        let (vol, snap) = (id.volume.clone(), id.snapshot.clone());
        match h.call("delete the snapshot", |c| async move { c.delete_snapshot(&vol, &snap).await }).await {
            Ok(()) => Ok(pb::DeleteSnapshotResponse {}),
            Err(e) if e.code == Code::NotFound => Ok(pb::DeleteSnapshotResponse {}),
            Err(e) => Err(e),
        }
    }

    /// Snapshots on one host (of one volume, or all), as (snapshot ID, snapshot).
    async fn snapshots_on(&self, h: &Host, conn: &Conn, volume: Option<&str>) -> Res<Vec<(String, pb::Snapshot)>> {
        let vol = volume.map(str::to_string);
        let snaps = match h.call("list the snapshots", |c| async move { c.list_snapshots(vol.as_deref()).await }).await
        {
            Ok(s) => s,
            Err(e) if e.code == Code::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(snaps.iter().filter_map(|v| csi_snapshot(conn, v)).map(|s| (s.snapshot_id.clone(), s)).collect())
    }

    async fn list_snapshots(&self, r: pb::ListSnapshotsRequest) -> Res<pb::ListSnapshotsResponse> {
        if !r.starting_token.is_empty() && parse_snapshot_id(&r.starting_token).is_none() {
            return Err(CsiError::new(
                Code::Aborted,
                format!("starting_token {:?} is not a token this controller gave", r.starting_token),
            ));
        }
        let items = if !r.snapshot_id.is_empty() {
            match parse_snapshot_id(&r.snapshot_id) {
                None => Vec::new(),
                Some(id) => match self.hosts.by_short_id(&id.host).await? {
                    None => Vec::new(),
                    Some((h, conn)) => {
                        let mut v = self.snapshots_on(h, &conn, Some(&id.volume)).await?;
                        v.retain(|(k, _)| *k == r.snapshot_id);
                        v
                    }
                },
            }
        } else if !r.source_volume_id.is_empty() {
            match parse_volume_id(&r.source_volume_id) {
                None => Vec::new(),
                Some(id) => match self.hosts.by_short_id(&id.host).await? {
                    None => Vec::new(),
                    Some((h, conn)) => self.snapshots_on(h, &conn, Some(&id.name)).await?,
                },
            }
        } else {
            let mut all = Vec::new();
            for s in self.hosts.survey().await {
                let view = s.answer?;
                all.extend(self.snapshots_on(s.host, &view.conn, None).await?);
            }
            all
        };
        let (snaps, next_token) = page(items, r.max_entries, &r.starting_token, |t| parse_snapshot_id(t).is_some())?;
        let entries = snaps.into_iter().map(|s| pb::list_snapshots_response::Entry { snapshot: Some(s) }).collect();
        Ok(pb::ListSnapshotsResponse { entries, next_token })
    }

    async fn get_snapshot(&self, r: pb::GetSnapshotRequest) -> Res<pb::GetSnapshotResponse> {
        need("snapshot_id", &r.snapshot_id)?;
        let missing = || CsiError::not_found(format!("snapshot {:?} does not exist", r.snapshot_id));
        let id = parse_snapshot_id(&r.snapshot_id).ok_or_else(missing)?;
        let (h, conn) = self.host_of(&id.host, &format!("snapshot {}", r.snapshot_id)).await?;
        let snap = self.snapshots_on(h, &conn, Some(&id.volume)).await?.into_iter().find(|(k, _)| *k == r.snapshot_id);
        Ok(pb::GetSnapshotResponse { snapshot: Some(snap.ok_or_else(missing)?.1) })
    }
}

/// A resolved content source.
struct Source<'a> {
    host: &'a Host,
    conn: Conn,
    /// Its full name on the host (`VOLUME` or `VOLUME@SNAPSHOT`).
    full: String,
    size: u64,
    /// How messages name it.
    what: String,
}

/// The size of a clone of `src` for a capacity range whose size is `size`: the
/// source's size when none is required, else `size` (a clone grows, never shrinks).
///
/// Errors: OUT_OF_RANGE when `size` is below the source's, or the source's above the
/// limit.
fn clone_size(range: Option<&pb::CapacityRange>, size: u64, src: &Source<'_>) -> Res<u64> {
    let (req, lim) = range.map(|r| (r.required_bytes.max(0) as u64, r.limit_bytes.max(0) as u64)).unwrap_or((0, 0));
    let want = if req == 0 { src.size } else { size };
    if want < src.size || (lim > 0 && want > lim) {
        return Err(CsiError::new(
            Code::OutOfRange,
            format!("{} holds {} bytes; a clone of it cannot be made in {req}..{lim} bytes", src.what, src.size),
        ));
    }
    Ok(want)
}

/// The controller capabilities (spec.md ControllerGetCapabilities).
pub const CAPABILITIES: &[pb::controller_service_capability::rpc::Type] = {
    use pb::controller_service_capability::rpc::Type as T;
    &[
        T::CreateDeleteVolume,
        T::PublishUnpublishVolume,
        T::ListVolumes,
        T::ListVolumesPublishedNodes,
        T::GetCapacity,
        T::CreateDeleteSnapshot,
        T::ListSnapshots,
        T::CloneVolume,
        T::PublishReadonly,
        T::ExpandVolume,
        T::GetVolume,
        T::VolumeCondition,
        T::SingleNodeMultiWriter,
        T::ModifyVolume,
    ]
};

#[tonic::async_trait]
impl pb::controller_server::Controller for Controller {
    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        let name = r.name.clone();
        answer("CreateVolume", &name, self.create_volume(r).await)
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        let id = r.volume_id.clone();
        answer("DeleteVolume", &id, self.delete_volume(r).await)
    }

    async fn controller_publish_volume(
        &self,
        req: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("{} to {}", r.volume_id, r.node_id);
        answer("ControllerPublishVolume", &subject, self.publish(r).await)
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("{} from {}", r.volume_id, if r.node_id.is_empty() { "every node" } else { &r.node_id });
        answer("ControllerUnpublishVolume", &subject, self.unpublish(r).await)
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        let id = r.volume_id.clone();
        answer("ValidateVolumeCapabilities", &id, self.validate(r).await)
    }

    async fn list_volumes(
        &self,
        req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("after {:?}", r.starting_token);
        answer("ListVolumes", &subject, self.list_volumes(r).await)
    }

    async fn get_capacity(
        &self,
        req: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        let r = req.into_inner();
        let subject = match &r.accessible_topology {
            Some(t) => t.segments.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","),
            None => "every host".to_string(),
        };
        answer("GetCapacity", &subject, self.get_capacity(r).await)
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        use pb::controller_service_capability::{Rpc, Type};
        let capabilities = CAPABILITIES
            .iter()
            .map(|t| pb::ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: *t as i32 })) })
            .collect();
        Ok(Response::new(pb::ControllerGetCapabilitiesResponse { capabilities }))
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::CreateSnapshotResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("{} of {}", r.name, r.source_volume_id);
        answer("CreateSnapshot", &subject, self.create_snapshot(r).await)
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        let id = r.snapshot_id.clone();
        answer("DeleteSnapshot", &id, self.delete_snapshot(r).await)
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("id {:?} source {:?} after {:?}", r.snapshot_id, r.source_volume_id, r.starting_token);
        answer("ListSnapshots", &subject, self.list_snapshots(r).await)
    }

    async fn get_snapshot(
        &self,
        req: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        let r = req.into_inner();
        let id = r.snapshot_id.clone();
        answer("GetSnapshot", &id, self.get_snapshot(r).await)
    }

    async fn controller_expand_volume(
        &self,
        req: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        let id = r.volume_id.clone();
        answer("ControllerExpandVolume", &id, self.expand(r).await)
    }

    async fn controller_get_volume(
        &self,
        req: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        let r = req.into_inner();
        let id = r.volume_id.clone();
        answer("ControllerGetVolume", &id, self.get_volume(r).await)
    }

    async fn controller_modify_volume(
        &self,
        req: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        let r = req.into_inner();
        let id = r.volume_id.clone();
        answer("ControllerModifyVolume", &id, self.modify(r).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(req: i64, lim: i64) -> pb::CapacityRange {
        pb::CapacityRange { required_bytes: req, limit_bytes: lim }
    }

    #[test]
    fn sizes_round_up_to_a_block_within_the_limit() {
        assert_eq!(size_for(None).unwrap(), DEFAULT_VOLUME_SIZE);
        assert_eq!(size_for(Some(&range(1, 0))).unwrap(), 4096);
        assert_eq!(size_for(Some(&range(4096, 4096))).unwrap(), 4096);
        assert_eq!(size_for(Some(&range(0, 10_000))).unwrap(), 8192);
        for bad in [range(1, 4095), range(5000, 6000), range(-1, 0), range(0, 100), range(10, 5)] {
            assert_eq!(size_for(Some(&bad)).unwrap_err().code, Code::OutOfRange, "{bad:?}");
        }
    }

    #[test]
    fn pages_follow_tokens_and_refuse_strangers() {
        let items = |n: usize| (0..n).map(|i| (format!("k{i:02}"), i)).collect::<Vec<_>>();
        let valid = |t: &str| t.starts_with('k');
        let (p, t) = page(items(5), 2, "", valid).unwrap();
        assert_eq!((p, t.as_str()), (vec![0, 1], "k01"));
        let (p, t) = page(items(5), 2, "k01", valid).unwrap();
        assert_eq!((p, t.as_str()), (vec![2, 3], "k03"));
        let (p, t) = page(items(5), 2, "k03", valid).unwrap();
        assert_eq!((p, t.as_str()), (vec![4], ""));
        assert_eq!(page(items(5), 0, "", valid).unwrap().0.len(), 5);
        assert_eq!(page(items(5), 1, "bad", valid).unwrap_err().code, Code::Aborted);
        assert_eq!(page(items(5), -1, "", valid).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn capabilities_refuse_multi_node_writers_and_other_file_systems() {
        let cap = |mode: Mode, fs: &str| pb::VolumeCapability {
            access_mode: Some(pb::volume_capability::AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Mount(pb::volume_capability::MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            })),
        };
        assert!(check_capability(&cap(Mode::SingleNodeWriter, "ext4")).is_ok());
        assert!(check_capability(&cap(Mode::MultiNodeReaderOnly, "xfs")).is_ok());
        for bad in [
            cap(Mode::MultiNodeMultiWriter, ""),
            cap(Mode::MultiNodeSingleWriter, ""),
            cap(Mode::SingleNodeWriter, "btrfs"),
            cap(Mode::Unknown, ""),
        ] {
            assert_eq!(check_capability(&bad).unwrap_err().code, Code::InvalidArgument, "{bad:?}");
        }
    }
}
