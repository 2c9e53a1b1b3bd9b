//! The CSI Node service (spec.md "Node Service RPC"): a published volume becomes a
//! block device through the kernel's NBD client ([`nbd::attach`]), formatted once when
//! the storage host says it was never written and it holds no signature, mounted on the
//! staging path (NodeStageVolume), bind-mounted into pods (NodePublishVolume), grown
//! (NodeExpandVolume) and watched (NodeGetVolumeStats with its volume condition).
//!
//! No state of its own: the kernel knows which NBD device serves which volume (its
//! backend identifier is `csi:VOLUME_ID`), mountinfo knows what is mounted where, and the
//! reconnect records (`/run/ferrovol/nbd`, shared with `ferrovol nbd watch`, a process of
//! its own) hold the export keys; so the plugin may restart at any time, and I/O goes on
//! meanwhile. Every call checks its arguments first, and changes nothing when it fails.
//! One call at a time per volume (`ABORTED` for a second).
//!
//! A volume of the storage host on the node's own machine (`AttachOptions::local`) is
//! attached as that host's local ublk device instead, when it can make one
//! ([`crate::local`]); the host knows which device serves it. Stage, publish, expand and
//! stats treat both kinds of device alike.
//!
//! Not here: the OS tools ([`crate::mounter`]), the controller.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nbd::attach::{self, AttachError, Health};
use tonic::{Code, Request, Response, Status};

use crate::controller::{publish_context, NODE_ID_PREFIX};
use crate::inflight::InFlight;
use crate::local::{is_ublk_device, kernel_resizes_ublk, LocalHost, LocalUblk, LocalVolume};
use crate::mounter::{self, Mount, Probe, FS_TYPES};
use crate::{pb, CsiError};

/// How the node attaches volumes.
#[derive(Debug, Clone)]
pub struct AttachOptions {
    /// Where the reconnect records live (shared with the watcher).
    pub run_dir: PathBuf,
    /// How long the kernel keeps requests waiting for a reconnect once every
    /// connection of a device is dead.
    pub dead_timeout: Duration,
    /// NBD connections per volume (more than 1 only if the export allows several).
    pub connections: u32,
    /// The most volumes this node takes (NodeGetInfo `max_volumes_per_node`; 0: no limit).
    pub max_volumes: i64,
    /// The directory of the node's NBD TLS credentials (`ca.crt`, `tls.crt`, `tls.key`;
    /// the certificate names the node): while it holds `tls.crt`, volumes of storage
    /// hosts with `--nbd-tls required` are attached over TLS with them (and of hosts
    /// with `optional` too); without it, such hosts' volumes cannot be staged here.
    pub tls_dir: Option<PathBuf>,
    /// The storage host on this machine, whose volumes are attached as its local ublk
    /// devices ([`crate::local`]); None: every volume over NBD.
    pub local: Option<LocalHost>,
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            run_dir: attach::DEFAULT_RUN_DIR.into(),
            dead_timeout: Duration::from_secs(120),
            connections: 1,
            max_volumes: 0,
            tls_dir: None,
            local: None,
        }
    }
}

/// The Node service of one node.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its Kubernetes node name.
    pub name: String,
    /// Its zone ([`crate::ZONE_KEY`]), if the cluster has zones.
    pub zone: Option<String>,
    /// How it attaches volumes.
    pub attach: AttachOptions,
    inflight: InFlight,
}

impl Node {
    /// The node named `name` (a Kubernetes node name: 1 to 247 bytes of lowercase
    /// letters, digits, `-` and `.`), in `zone`.
    ///
    /// Errors: a message naming the rule `name` or `zone` breaks.
    pub fn new(name: String, zone: Option<String>) -> Result<Node, String> {
        let ok = !name.is_empty()
            && name.len() <= 256 - NODE_ID_PREFIX.len()
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && name.as_bytes()[0].is_ascii_alphanumeric();
        if !ok {
            return Err(format!(
                "node name {name:?} is not a Kubernetes node name: 1 to {} bytes of lowercase letters, digits, '-' \
                 and '.', starting with a letter or digit",
                256 - NODE_ID_PREFIX.len()
            ));
        }
        if zone.as_deref() == Some("") {
            return Err("zone is empty: leave --zone out or name the zone".into());
        }
        Ok(Node { name, zone, attach: AttachOptions::default(), inflight: InFlight::default() })
    }

    /// The NBD TLS credentials directory, if it holds credentials now (they may be put
    /// there after the plugin started).
    fn tls_dir(&self) -> Option<&Path> {
        self.attach.tls_dir.as_deref().filter(|d| d.join(nbd::client::ClientTls::CERT).exists())
    }

    /// The same node attaching with `o`.
    pub fn with_attach(mut self, o: AttachOptions) -> Node {
        self.attach = o;
        self
    }

    /// The local host's handle on volume `id`, when the volume lives there
    /// ([`LocalHost::volume`]).
    ///
    /// Errors: UNAVAILABLE when the host does not answer.
    fn local_volume(&self, id: &str) -> Result<Option<LocalVolume>, CsiError> {
        let Some(local) = self.attach.local.as_ref() else { return Ok(None) };
        local.volume(id).map_err(|e| local_error(id, "look up", e))
    }

    /// The device volume `id` is attached as on this node, if any: its NBD device, or
    /// the local device the storage host on this machine says serves it.
    fn device_of(&self, id: &str) -> Result<Option<Device>, CsiError> {
        if let Some(i) = nbd_device_of(id)? {
            return Ok(Some(Device::Nbd(i)));
        }
        let Some(v) = self.local_volume(id)? else { return Ok(None) };
        match v.state() {
            Ok((size, pristine, Some(path))) if path.exists() => Ok(Some(Device::Local { path, size, pristine })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == mgmt_api::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(local_error(id, "read the local device", e)),
        }
    }

    /// Attaches volume `id` as a local device of the storage host on this machine,
    /// when it lives there, the attachment is writable, [`LocalUblk`] allows it and the
    /// host can make one; None otherwise (NBD then).
    fn attach_local(&self, id: &str, read_only: bool) -> Result<Option<Device>, CsiError> {
        let Some(mode) = self.attach.local.as_ref().map(|l| l.ublk) else { return Ok(None) };
        // A read-only attachment goes over NBD, whose export refuses writes; so does
        // every one when the kernel could not resize the device and `auto` asks for that.
        if read_only || mode == LocalUblk::Never || (mode == LocalUblk::Auto && !kernel_resizes_ublk()) {
            return Ok(None);
        }
        // A host that does not answer cannot serve the volume over NBD either: the NBD
        // attach reports it.
        let v = match self.local_volume(id) {
            Ok(Some(v)) => v,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(volume_id = id, error = %e.message, "the storage host on this machine does not answer");
                return Ok(None);
            }
        };
        let (size, pristine, _) = match v.state() {
            Ok(s) => s,
            Err(e) if e.kind() == mgmt_api::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(local_error(id, "read", e)),
        };
        match v.attach(&self.node_id()) {
            Ok(path) => Ok(Some(Device::Local { path, size, pristine })),
            Err(e) if e.kind() == mgmt_api::ErrorKind::FailedPrecondition => {
                tracing::info!(volume_id = id, error = %e, "no local device: attaching over NBD");
                Ok(None)
            }
            Err(e) => Err(local_error(id, "attach locally", e)),
        }
    }

    /// Removes volume `id`'s local device (OK when it has none).
    fn detach_local(&self, id: &str) -> Result<(), CsiError> {
        match self.local_volume(id)? {
            Some(v) => v.detach().map_err(|e| local_error(id, "detach the local device", e)),
            None => Ok(()),
        }
    }

    /// Detaches `dev` of volume `id`, whatever its kind.
    fn detach_device(&self, id: &str, dev: &Device) -> Result<(), CsiError> {
        match dev {
            Device::Nbd(i) => match attach::detach(&self.attach.run_dir, *i) {
                // A fenced device goes away with its last user (an unmount before).
                Ok(()) | Err(AttachError::Kernel(nbd::kernel::KernelError::NoDevice(_))) => {
                    attach::Record::remove(&self.attach.run_dir, *i);
                    Ok(())
                }
                Err(e) => Err(internal(format!("detach /dev/nbd{i}: {e}"))),
            },
            Device::Local { .. } => self.detach_local(id),
        }
    }

    /// The node ID this node reports: [`NODE_ID_PREFIX`] and its name.
    pub fn node_id(&self) -> String {
        format!("{NODE_ID_PREFIX}{}", self.name)
    }

    /// Runs `f` on the blocking pool without the volume's guard: for calls that change
    /// nothing (NodeGetVolumeStats), which must not make others ABORTED.
    async fn run_unguarded<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Node) -> Result<T, CsiError> + Send + 'static,
    ) -> Result<T, Status> {
        let node = self.clone();
        tokio::task::spawn_blocking(move || f(&node))
            .await
            .map_err(|e| Status::internal(format!("the call's task failed: {e}")))?
            .map_err(Status::from)
    }

    /// Runs `f` on the blocking pool holding the volume's in-flight guard.
    async fn run<T: Send + 'static>(
        &self,
        volume_id: &str,
        f: impl FnOnce(&Node) -> Result<T, CsiError> + Send + 'static,
    ) -> Result<T, Status> {
        let guard = self.inflight.take(format!("volume/{volume_id}"))?;
        let node = self.clone();
        // The guard goes with the work: a call the CO gave up on (its future dropped)
        // still holds the volume until the work ends.
        let out = tokio::task::spawn_blocking(move || {
            let r = f(&node);
            drop(guard);
            r
        })
        .await
        .map_err(|e| Status::internal(format!("the call's task failed: {e}")))?;
        out.map_err(Status::from)
    }
}

/// The backend identifier of a volume's device.
pub fn backend_of(volume_id: &str) -> String {
    format!("csi:{volume_id}")
}

fn dev_path(index: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nbd{index}"))
}

/// The block device a volume is attached as on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Device {
    /// `/dev/nbdN`, attached by this node through the kernel's NBD client.
    Nbd(u32),
    /// A local device (`/dev/ublkbN`) the storage host on this machine made, with
    /// what the host said of the volume when it was found: its size in bytes, and
    /// whether it was never written.
    Local { path: PathBuf, size: u64, pristine: bool },
}

impl Device {
    fn path(&self) -> PathBuf {
        match self {
            Device::Nbd(i) => dev_path(*i),
            Device::Local { path, .. } => path.clone(),
        }
    }

    /// Its size in bytes as the kernel sees it (sysfs), 0 when unknown.
    fn kernel_size(&self) -> u64 {
        let path = self.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        std::fs::read_to_string(format!("/sys/block/{name}/size"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(0, |sectors| sectors * 512)
    }
}

/// What the node needs to know of an attached volume before it mounts it.
#[derive(Debug, Clone, Copy)]
struct Facts {
    /// Never written since it was created: it may be formatted.
    never_written: bool,
    /// Writes are refused.
    read_only: bool,
}

impl Facts {
    /// Of an NBD export, from its handshake (or reconnect record).
    fn of_export(info: &nbd::client::ExportInfo) -> Facts {
        Facts { never_written: info.never_written(), read_only: info.read_only() }
    }

    /// Of a local device (writable: read-only attachments go over NBD), whose volume
    /// the host says is `pristine` or not.
    fn of_local(pristine: bool) -> Facts {
        Facts { never_written: pristine, read_only: false }
    }
}

fn internal(m: impl Into<String>) -> CsiError {
    CsiError::new(Code::Internal, m)
}

fn required<'a>(what: &str, v: &'a str) -> Result<&'a str, CsiError> {
    if v.is_empty() {
        return Err(CsiError::invalid(format!("{what} is missing")));
    }
    Ok(v)
}

/// A volume capability as this node serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cap {
    /// A file system of this type, mounted with these flags.
    Mount { fs: String, flags: Vec<String> },
    /// A raw block device.
    Block,
}

/// Checks a capability: single-node access modes only; ext4 or xfs.
fn capability(c: Option<&pb::VolumeCapability>) -> Result<(Cap, bool), CsiError> {
    use pb::volume_capability::access_mode::Mode;
    use pb::volume_capability::AccessType;
    let c = c.ok_or_else(|| CsiError::invalid("volume_capability is missing"))?;
    let mode = c.access_mode.as_ref().map(|m| m.mode()).unwrap_or(Mode::Unknown);
    let read_only = match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => false,
        Mode::SingleNodeReaderOnly => true,
        Mode::Unknown => return Err(CsiError::invalid("volume_capability has no access mode")),
        other => {
            return Err(CsiError::invalid(format!(
                "access mode {other:?}: a ferrovol volume is attached to one node at a time"
            )))
        }
    };
    let cap = match &c.access_type {
        Some(AccessType::Block(_)) => Cap::Block,
        Some(AccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() { "ext4".to_string() } else { m.fs_type.clone() };
            if !FS_TYPES.contains(&fs.as_str()) {
                return Err(CsiError::invalid(format!("fs_type {fs:?}: this driver makes {}", FS_TYPES.join(" or "))));
            }
            Cap::Mount { fs, flags: m.mount_flags.clone() }
        }
        None => return Err(CsiError::invalid("volume_capability has no access type (mount or block)")),
    };
    Ok((cap, read_only))
}

/// The export URIs of a publish_context, one per address.
/// The NBD URIs to try for a publish_context, over TLS (`nbds://`) when the storage
/// host requires it, or offers it and the node has credentials (`tls_dir`).
///
/// Errors: INVALID_ARGUMENT (a context not made by ferrovol's controller);
/// FAILED_PRECONDITION (the host requires TLS and the node has no credentials).
fn uris(ctx: &std::collections::HashMap<String, String>, tls_dir: Option<&Path>) -> Result<Vec<String>, CsiError> {
    let addrs = ctx.get(publish_context::NBD_ADDRESSES).filter(|a| !a.is_empty());
    let export = ctx.get(publish_context::EXPORT_NAME).filter(|e| !e.is_empty());
    let (Some(addrs), Some(export)) = (addrs, export) else {
        return Err(CsiError::invalid(format!(
            "publish_context lacks {} or {}: was the volume published by ferrovol's controller?",
            publish_context::NBD_ADDRESSES,
            publish_context::EXPORT_NAME
        )));
    };
    let tls =
        match ctx.get(publish_context::NBD_TLS).map(String::as_str) {
            None | Some("off") => false,
            Some("optional") => tls_dir.is_some(),
            Some("required") if tls_dir.is_some() => true,
            Some("required") => return Err(CsiError::new(
                Code::FailedPrecondition,
                "the storage host requires NBD over TLS and this node plugin has no TLS credentials (--nbd-tls-dir)",
            )),
            Some(other) => {
                return Err(CsiError::invalid(format!("publish_context {}={other:?}", publish_context::NBD_TLS)))
            }
        };
    let scheme = if tls { "nbds" } else { "nbd" };
    Ok(addrs.split(',').map(|a| format!("{scheme}://{}/{export}", a.trim())).collect())
}

/// Maps an attach error for volume `id`.
fn attach_error(id: &str, e: AttachError) -> CsiError {
    use nbd::client::HandshakeError as H;
    match e {
        AttachError::Handshake(H::Refused { message, .. }) => CsiError::new(
            Code::FailedPrecondition,
            format!("volume {id} is not published to this node (the storage host refused: {message})"),
        ),
        AttachError::Handshake(H::UnknownExport { .. }) => {
            CsiError::not_found(format!("volume {id} does not exist on its storage host"))
        }
        AttachError::Handshake(h @ H::Io { .. }) => CsiError::unavailable(format!("volume {id}: {h}")),
        AttachError::Fenced(why) => CsiError::new(Code::FailedPrecondition, format!("volume {id}: {why}")),
        // TLS refused by either side, no credentials, a kernel without TLS: the node or
        // the host must be set up differently; retrying the same call will not help.
        AttachError::Handshake(h @ (H::Tls { .. } | H::TlsRequired { .. })) => {
            CsiError::new(Code::FailedPrecondition, format!("volume {id}: {h}"))
        }
        AttachError::Invalid(why) => CsiError::new(Code::FailedPrecondition, format!("volume {id}: {why}")),
        AttachError::Kernel(k @ (nbd::kernel::KernelError::Permission | nbd::kernel::KernelError::NoDriver)) => {
            CsiError::new(
                Code::FailedPrecondition,
                format!("{k} (the node plugin runs privileged, with the nbd module)"),
            )
        }
        other => internal(format!("volume {id}: {other}")),
    }
}

/// The attached NBD device of `volume_id`, if any (none on a kernel without the NBD
/// driver, where nothing can be attached).
fn nbd_device_of(volume_id: &str) -> Result<Option<u32>, CsiError> {
    match attach::find(&backend_of(volume_id)) {
        Ok(d) => Ok(d),
        Err(AttachError::Kernel(nbd::kernel::KernelError::NoDriver)) => Ok(None),
        Err(e) => Err(internal(format!("volume {volume_id}: {e}"))),
    }
}

/// The CSI error of a failed call to the storage host on this machine.
fn local_error(id: &str, what: &str, e: mgmt_api::ApiError) -> CsiError {
    CsiError::from_api("on this machine", &format!("{what} of volume {id}"), e)
}

/// Mounts of `dev` other than at `except`.
fn other_mounts(all: &[Mount], dev: &Path, except: &Path) -> Vec<PathBuf> {
    let except = mounter::resolve(except);
    all.iter().filter(|m| m.device().as_deref() == Some(dev) && m.target != except).map(|m| m.target.clone()).collect()
}

impl Node {
    /// A fenced device (its storage host restarted after a crash) is not staged or
    /// published again: its file system may miss writes it took for done. Unstaging it
    /// (once no pod uses it) and staging it again attaches it afresh.
    fn refuse_fenced(&self, id: &str, index: u32) -> Result<(), CsiError> {
        if let Some(Health::Fenced(why)) = attach::health(&self.attach.run_dir, index) {
            return Err(CsiError::new(
                Code::FailedPrecondition,
                format!("volume {id} was fenced ({why}); unstage it and stage it again"),
            ));
        }
        Ok(())
    }

    fn stage(&self, r: pb::NodeStageVolumeRequest) -> Result<(), CsiError> {
        let id = r.volume_id.as_str();
        let staging = PathBuf::from(&r.staging_target_path);
        let (cap, mut read_only) = capability(r.volume_capability.as_ref())?;
        read_only |= r.publish_context.get(publish_context::READ_ONLY).is_some_and(|v| v == "true");
        let all = mounter::mounts().map_err(internal)?;
        let staged = mounter::mount_at(&all, &staging);
        let existing = self.device_of(id)?;
        if let Some(Device::Nbd(i)) = existing {
            self.refuse_fenced(id, i)?;
        }
        if let Some(m) = &staged {
            let same_dev = existing.as_ref().is_some_and(|d| m.device() == Some(d.path()));
            let same = match &cap {
                Cap::Mount { fs, .. } => same_dev && m.fs_type == *fs && m.read_only() == read_only,
                Cap::Block => false,
            };
            if same {
                return Ok(());
            }
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!(
                    "{} already has {} ({}{}) mounted: volume {id} was staged there with another capability, or \
                     another volume was",
                    staging.display(),
                    m.source,
                    m.fs_type,
                    if m.read_only() { ", read-only" } else { "" }
                ),
            ));
        }
        let uris = uris(&r.publish_context, self.tls_dir())?;
        if let Some(other) = r.publish_context.get(publish_context::NODE_ID).filter(|n| **n != self.node_id()) {
            return Err(CsiError::new(
                Code::FailedPrecondition,
                format!("volume {id} is published to node {other}, not to this one ({})", self.node_id()),
            ));
        }
        if !staging.is_dir() && matches!(cap, Cap::Mount { .. }) {
            return Err(CsiError::not_found(format!(
                "staging_target_path {} is not a directory (the CO makes it)",
                staging.display()
            )));
        }
        // A volume of the storage host on this machine: its local device, if it makes one.
        if existing.is_some() && cap == Cap::Block {
            return Ok(());
        }
        let local = if existing.is_none() { self.attach_local(id, read_only)? } else { None };
        let (device, facts, attached_now) = match (existing, local) {
            (Some(Device::Nbd(i)), _) => {
                let info = attach::export_info(&self.attach.run_dir, i).map_err(|e| attach_error(id, e))?;
                (Device::Nbd(i), Facts::of_export(&info), false)
            }
            (Some(d @ Device::Local { pristine, .. }), _) => (d, Facts::of_local(pristine), false),
            (None, Some(d @ Device::Local { pristine, .. })) => {
                tracing::info!(volume_id = id, device = %d.path().display(), "attached locally");
                (d, Facts::of_local(pristine), true)
            }
            (None, _) => {
                let mut last = None;
                let mut done = None;
                for uri in &uris {
                    let o = attach::Options {
                        uri: uri.clone(),
                        device: None,
                        connections: self.attach.connections,
                        dead_timeout: Some(self.attach.dead_timeout),
                        backend: Some(backend_of(id)),
                        run_dir: self.attach.run_dir.clone(),
                        tls_dir: self.attach.tls_dir.clone(),
                    };
                    match attach::attach(&o) {
                        Ok(a) => {
                            done = Some(a);
                            break;
                        }
                        Err(e) => {
                            let e = attach_error(id, e);
                            let retry_next = e.code == Code::Unavailable;
                            last = Some(e);
                            if !retry_next {
                                break;
                            }
                        }
                    }
                }
                let Some(a) = done else { return Err(last.unwrap_or_else(|| internal("no NBD address"))) };
                tracing::info!(volume_id = id, device = a.index, "attached");
                (Device::Nbd(a.index), Facts::of_export(&a.info), true)
            }
        };
        let Cap::Mount { fs, flags } = cap else { return Ok(()) };
        let undo = |e: CsiError| {
            if attached_now {
                let _ = self.detach_device(id, &device);
            }
            e
        };
        let dev = device.path();
        match mounter::probe(&dev).map_err(internal).map_err(undo)? {
            Probe::FileSystem(t) if t == fs => {}
            Probe::FileSystem(t) => {
                return Err(undo(CsiError::new(
                    Code::FailedPrecondition,
                    format!("volume {id} holds a {t} file system, not {fs}: not mounted, not formatted"),
                )))
            }
            Probe::Other(what) => {
                return Err(undo(CsiError::new(
                    Code::FailedPrecondition,
                    format!("volume {id} holds {what}: not formatted"),
                )))
            }
            Probe::Empty if !facts.never_written => {
                return Err(undo(CsiError::new(
                    Code::FailedPrecondition,
                    format!(
                        "volume {id} was written but shows no file system signature (damaged, or written raw): \
                         it is never formatted; check it"
                    ),
                )))
            }
            Probe::Empty if read_only || facts.read_only => {
                return Err(undo(CsiError::new(
                    Code::FailedPrecondition,
                    format!("volume {id} is empty and attached read-only: nothing to mount"),
                )))
            }
            Probe::Empty => {
                tracing::info!(volume_id = id, fs, "formatting a volume never written");
                mounter::mkfs(&dev, &fs).map_err(internal).map_err(undo)?;
            }
        }
        let mut options = flags;
        if read_only || facts.read_only {
            options.push("ro".into());
        }
        if fs == "xfs" {
            // Clones and restored snapshots carry their origin's UUID.
            options.push("nouuid".into());
        }
        mounter::mount(&dev, &staging, &fs, &options).map_err(internal).map_err(undo)?;
        Ok(())
    }

    fn unstage(&self, r: pb::NodeUnstageVolumeRequest) -> Result<(), CsiError> {
        let id = r.volume_id.as_str();
        let staging = PathBuf::from(&r.staging_target_path);
        let all = mounter::mounts().map_err(internal)?;
        let device = self.device_of(id)?;
        if let Some(d) = &device {
            let others = other_mounts(&all, &d.path(), &staging);
            if !others.is_empty() {
                return Err(CsiError::new(
                    Code::FailedPrecondition,
                    format!(
                        "volume {id} ({}) is still mounted at {}: unpublish it first",
                        d.path().display(),
                        others.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        if let Some(m) = mounter::mount_at(&all, &staging) {
            // A ublk mount on the staging path of a volume whose host names no device
            // for it: its device was removed (the host restarted, or unpublished the
            // volume from this node); the mount is the volume's, stale. (Its device
            // number may serve another volume by now, so the path alone cannot tell.)
            let stale_local =
                device.is_none() && self.attach.local.is_some() && m.device().is_some_and(|d| is_ublk_device(&d));
            if !stale_local && device.as_ref().is_none_or(|d| m.device() != Some(d.path())) {
                return Err(CsiError::new(
                    Code::FailedPrecondition,
                    format!("{} holds {} ({}), not volume {id}", staging.display(), m.source, m.fs_type),
                ));
            }
            mounter::umount(&staging).map_err(|e| {
                CsiError::new(Code::FailedPrecondition, format!("volume {id} is in use at {}: {e}", staging.display()))
            })?;
        }
        if let Some(d) = device {
            self.detach_device(id, &d)?;
            tracing::info!(volume_id = id, device = %d.path().display(), "detached");
        }
        Ok(())
    }

    fn publish(&self, r: pb::NodePublishVolumeRequest) -> Result<(), CsiError> {
        let id = r.volume_id.as_str();
        let target = PathBuf::from(&r.target_path);
        let staging = PathBuf::from(&r.staging_target_path);
        let (cap, read_only) = capability(r.volume_capability.as_ref())?;
        let read_only = read_only || r.readonly;
        let Some(device) = self.device_of(id)? else {
            return Err(CsiError::new(Code::FailedPrecondition, format!("volume {id} is not staged on this node")));
        };
        if let Device::Nbd(i) = device {
            self.refuse_fenced(id, i)?;
        }
        let dev = device.path();
        let all = mounter::mounts().map_err(internal)?;
        if let Some(m) = mounter::mount_at(&all, &target) {
            if m.device() == Some(dev.clone()) && m.read_only() == read_only {
                return Ok(());
            }
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!("{} is already a mount point of something else, or read-only differs", target.display()),
            ));
        }
        match cap {
            Cap::Mount { .. } => {
                let staged = mounter::mount_at(&all, &staging);
                if staged.as_ref().and_then(Mount::device) != Some(dev.clone()) {
                    return Err(CsiError::new(
                        Code::FailedPrecondition,
                        format!("volume {id} is not staged at {} as a mount volume", staging.display()),
                    ));
                }
                std::fs::create_dir_all(&target).map_err(|e| internal(format!("create {}: {e}", target.display())))?;
                mounter::bind(&staging, &target, read_only).map_err(internal)?;
            }
            Cap::Block => {
                if mounter::mount_at(&all, &staging).is_some() {
                    return Err(CsiError::new(
                        Code::FailedPrecondition,
                        format!("volume {id} is staged as a mount volume, not as a block volume"),
                    ));
                }
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| internal(format!("create {}: {e}", parent.display())))?;
                }
                if !target.exists() {
                    std::fs::File::create(&target)
                        .map_err(|e| internal(format!("create {}: {e}", target.display())))?;
                }
                mounter::bind(&dev, &target, read_only).map_err(internal)?;
            }
        }
        Ok(())
    }

    fn unpublish(&self, r: pb::NodeUnpublishVolumeRequest) -> Result<(), CsiError> {
        let target = PathBuf::from(&r.target_path);
        loop {
            let all = mounter::mounts().map_err(internal)?;
            if mounter::mount_at(&all, &target).is_none() {
                break;
            }
            mounter::umount(&target).map_err(|e| {
                CsiError::new(Code::Internal, format!("volume {}: unmount {}: {e}", r.volume_id, target.display()))
            })?;
        }
        let gone = match std::fs::symlink_metadata(&target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
            Ok(m) if m.is_dir() => std::fs::remove_dir(&target),
            Ok(_) => std::fs::remove_file(&target),
        };
        gone.map_err(|e| internal(format!("remove {}: {e}", target.display())))
    }

    /// The device and the mount (if a file system) behind a volume path: a publish
    /// target, a staging path, or the device.
    fn behind(&self, id: &str, path: &Path) -> Result<(Device, Option<Mount>), CsiError> {
        let Some(device) = self.device_of(id)? else {
            return Err(CsiError::not_found(format!("volume {id} is not attached on this node")));
        };
        let dev = device.path();
        if mounter::resolve(path) == dev {
            return Ok((device, None));
        }
        if !path.exists() {
            return Err(CsiError::not_found(format!("{} does not exist", path.display())));
        }
        let all = mounter::mounts().map_err(internal)?;
        match mounter::mount_at(&all, path) {
            Some(m) if m.device() == Some(dev.clone()) => {
                let fs = (m.fs_type != "devtmpfs").then_some(m);
                Ok((device, fs))
            }
            _ => Err(CsiError::not_found(format!("{} is not where volume {id} is mounted", path.display()))),
        }
    }

    fn expand(&self, r: pb::NodeExpandVolumeRequest) -> Result<i64, CsiError> {
        let id = r.volume_id.as_str();
        let (device, mount) = self.behind(id, Path::new(&r.volume_path))?;
        let size = match &device {
            Device::Nbd(i) => attach::resize(&self.attach.run_dir, *i).map_err(|e| match e {
                AttachError::Export(m) => CsiError::new(Code::FailedPrecondition, format!("volume {id}: {m}")),
                other => attach_error(id, other),
            })?,
            // The host resized the device with the volume (ControllerExpandVolume),
            // where the kernel can.
            &Device::Local { ref path, size, .. } => {
                let seen = device.kernel_size();
                if seen < size {
                    return Err(CsiError::new(
                        Code::FailedPrecondition,
                        format!(
                            "volume {id} is {size} bytes but its local device {} shows {seen}: this kernel does not \
                             resize ublk devices online (Linux 6.16 does); the volume shows its new size once \
                             staged again",
                            path.display()
                        ),
                    ));
                }
                size
            }
        };
        let required = r.capacity_range.as_ref().map_or(0, |c| c.required_bytes.max(0) as u64);
        if size < required {
            return Err(CsiError::new(
                Code::OutOfRange,
                format!("volume {id} is {size} bytes on its storage host, below the {required} asked"),
            ));
        }
        let block = matches!(
            r.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()),
            Some(pb::volume_capability::AccessType::Block(_))
        );
        if let (Some(m), false) = (mount, block) {
            mounter::grow(&device.path(), &m.target, &m.fs_type).map_err(internal)?;
        }
        Ok(size as i64)
    }

    fn stats(&self, r: pb::NodeGetVolumeStatsRequest) -> Result<pb::NodeGetVolumeStatsResponse, CsiError> {
        use pb::volume_usage::Unit;
        let id = r.volume_id.as_str();
        let (device, mount) = match self.behind(id, Path::new(&r.volume_path)) {
            Err(e) if e.code == Code::NotFound && self.attach.local.is_some() => {
                // A local device its host removed leaves the file system's mount behind.
                let all = mounter::mounts().map_err(internal)?;
                let gone = mounter::mount_at(&all, Path::new(&r.volume_path))
                    .and_then(|m| m.device())
                    .filter(|d| is_ublk_device(d));
                let Some(dev) = gone else { return Err(e) };
                let message = format!(
                    "the local device {} is gone (the storage host on this machine restarted, or unpublished the \
                     volume): its pods must be restarted for it to be staged again",
                    dev.display()
                );
                return Ok(pb::NodeGetVolumeStatsResponse {
                    usage: Vec::new(),
                    volume_condition: Some(pb::VolumeCondition { abnormal: true, message }),
                });
            }
            other => other?,
        };
        let usage = match mount {
            Some(m) => {
                let (b, i) = mounter::usage(&m.target).map_err(internal)?;
                vec![
                    pb::VolumeUsage {
                        total: b[0] as i64,
                        available: b[1] as i64,
                        used: b[2] as i64,
                        unit: Unit::Bytes as i32,
                    },
                    pb::VolumeUsage {
                        total: i[0] as i64,
                        available: i[1] as i64,
                        used: i[2] as i64,
                        unit: Unit::Inodes as i32,
                    },
                ]
            }
            None => vec![pb::VolumeUsage {
                total: device.kernel_size() as i64,
                unit: Unit::Bytes as i32,
                ..Default::default()
            }],
        };
        let index = match device {
            Device::Nbd(i) => i,
            // Found through the host, which names it as the volume's device: it serves.
            Device::Local { path, .. } => {
                let message = format!("attached as the local device {}", path.display());
                return Ok(pb::NodeGetVolumeStatsResponse {
                    usage,
                    volume_condition: Some(pb::VolumeCondition { abnormal: false, message }),
                });
            }
        };
        let condition = match attach::health(&self.attach.run_dir, index) {
            Some(Health::Alive) => pb::VolumeCondition { abnormal: false, message: "attached".into() },
            Some(Health::Reconnecting(since)) => pb::VolumeCondition {
                abnormal: true,
                message: format!("every NBD connection is dead (since {since}, seconds since the epoch); reconnecting"),
            },
            Some(Health::Fenced(why)) => pb::VolumeCondition { abnormal: true, message: why },
            None => pb::VolumeCondition {
                abnormal: true,
                message: "the device has no reconnect record: it will not be reconnected".into(),
            },
        };
        Ok(pb::NodeGetVolumeStatsResponse { usage, volume_condition: Some(condition) })
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for Node {
    /// Attaches the volume (its publish_context: NBD addresses and the export name with
    /// its key), then for a mount volume makes a file system only if the storage host
    /// says the volume was never written and `blkid -p` finds no signature, and mounts it
    /// on the staging path. Idempotent; another capability on a staged path is
    /// ALREADY_EXISTS; a volume not published to this node is FAILED_PRECONDITION.
    async fn node_stage_volume(
        &self,
        r: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("staging_target_path", &r.staging_target_path)?;
        capability(r.volume_capability.as_ref())?;
        let id = r.volume_id.clone();
        self.run(&id, move |n| n.stage(r)).await?;
        Ok(Response::new(pb::NodeStageVolumeResponse {}))
    }

    /// Unmounts the staging path and detaches the device; OK when already done; a volume
    /// still mounted elsewhere (published) is FAILED_PRECONDITION naming where.
    async fn node_unstage_volume(
        &self,
        r: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("staging_target_path", &r.staging_target_path)?;
        let id = r.volume_id.clone();
        self.run(&id, move |n| n.unstage(r)).await?;
        Ok(Response::new(pb::NodeUnstageVolumeResponse {}))
    }

    /// Bind-mounts the staged file system on the target directory, or the device on the
    /// target file for a block volume (read-only when asked). Idempotent.
    async fn node_publish_volume(
        &self,
        r: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("target_path", &r.target_path)?;
        required("staging_target_path", &r.staging_target_path)?;
        capability(r.volume_capability.as_ref())?;
        let id = r.volume_id.clone();
        self.run(&id, move |n| n.publish(r)).await?;
        Ok(Response::new(pb::NodePublishVolumeResponse {}))
    }

    /// Unmounts and removes the target path; OK when it is gone already.
    async fn node_unpublish_volume(
        &self,
        r: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("target_path", &r.target_path)?;
        let id = r.volume_id.clone();
        self.run(&id, move |n| n.unpublish(r)).await?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    /// Bytes and inodes of a mounted volume, the size of a block one, and its condition
    /// (abnormal while its connections are dead or after it was fenced).
    async fn node_get_volume_stats(
        &self,
        r: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("volume_path", &r.volume_path)?;
        Ok(Response::new(self.run_unguarded(move |n| n.stats(r)).await?))
    }

    /// The device takes the volume's new size (NBD reconfigure), then its file system
    /// grows online (resize2fs, xfs_growfs). `volume_path` may be a publish target, the
    /// staging path or the device.
    async fn node_expand_volume(
        &self,
        r: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        required("volume_id", &r.volume_id)?;
        required("volume_path", &r.volume_path)?;
        let id = r.volume_id.clone();
        let capacity_bytes = self.run(&id, move |n| n.expand(r)).await?;
        Ok(Response::new(pb::NodeExpandVolumeResponse { capacity_bytes }))
    }

    async fn node_get_capabilities(
        &self,
        _r: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        use pb::node_service_capability::{rpc::Type, Rpc, Type as T};
        let capabilities = [
            Type::StageUnstageVolume,
            Type::ExpandVolume,
            Type::GetVolumeStats,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(|t| pb::NodeServiceCapability { r#type: Some(T::Rpc(Rpc { r#type: t as i32 })) })
        .collect();
        Ok(Response::new(pb::NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _r: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        let accessible_topology = self.zone.as_deref().map(crate::zone_topology);
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.node_id(),
            max_volumes_per_node: self.attach.max_volumes,
            accessible_topology,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_follow_the_hosts_tls_mode_and_the_nodes_credentials() {
        let ctx = |tls: Option<&str>| {
            let mut c: std::collections::HashMap<String, String> = [
                (publish_context::NBD_ADDRESSES.to_string(), "h1:10809, h2:7000".to_string()),
                (publish_context::EXPORT_NAME.to_string(), "vol/key".to_string()),
            ]
            .into_iter()
            .collect();
            if let Some(t) = tls {
                c.insert(publish_context::NBD_TLS.to_string(), t.to_string());
            }
            c
        };
        let dir = Path::new("/etc/ferrovol/nbd-tls");
        let plain = vec!["nbd://h1:10809/vol/key".to_string(), "nbd://h2:7000/vol/key".to_string()];
        let tls = vec!["nbds://h1:10809/vol/key".to_string(), "nbds://h2:7000/vol/key".to_string()];
        assert_eq!(uris(&ctx(None), Some(dir)).unwrap(), plain, "a host of an older build");
        assert_eq!(uris(&ctx(Some("off")), Some(dir)).unwrap(), plain);
        assert_eq!(uris(&ctx(Some("optional")), None).unwrap(), plain);
        assert_eq!(uris(&ctx(Some("optional")), Some(dir)).unwrap(), tls);
        assert_eq!(uris(&ctx(Some("required")), Some(dir)).unwrap(), tls);
        assert_eq!(uris(&ctx(Some("required")), None).unwrap_err().code, Code::FailedPrecondition);
        assert_eq!(uris(&ctx(Some("sometimes")), Some(dir)).unwrap_err().code, Code::InvalidArgument);
    }
}
