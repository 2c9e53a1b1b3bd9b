//! An NBD export as a local block device that stays attached: [`attach`] handshakes
//! ([`crate::client`]) and hands the sockets to the kernel ([`crate::kernel`]),
//! [`detach`], [`resize`] (the device takes the export's new size, mounted or not),
//! [`reconnect`] (new sockets now), and [`watch`], the reconnect watcher: on the
//! kernel's link-dead message it handshakes again to the same export and gives the
//! device new sockets with `NBD_CMD_RECONFIGURE`.
//!
//! The kernel is the truth for what is attached where (its backend identifier, which
//! it checks on every reconfigure). What it cannot hold, the export name with its key
//! and the server's crash generation, is kept in a *record* per device in a root-only
//! run directory (`/run/ferrovol/nbd`, a tmpfs that ends with the kernel's state at a
//! reboot). A record counts only while the kernel's device has the record's backend.
//! One watcher per node; it can be stopped and started at any time and rebuilds its
//! view from the kernel and the records (the run directory's `watch.lock` tells that
//! one runs).
//!
//! Data integrity across a reconnect: a server that restarted after a crash may have
//! lost writes it acknowledged and the kernel's page cache holds as written; a later
//! flush on the new connection would then succeed over the loss. So a device is handed
//! new sockets only by a server of the same crash generation
//! ([`crate::client::CrashGeneration`]); otherwise the watcher detaches it (requests
//! fail with EIO at once, the file system sees the error) and records why.
//!
//! Blocking, on std threads. Not here: the handshake and the netlink messages.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::client::{self, CrashGeneration, ExportInfo, Target};
use crate::kernel::{self, KernelError};

/// Where records live by default.
pub const DEFAULT_RUN_DIR: &str = "/run/ferrovol/nbd";

/// How long a connect and each handshake step may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// The most connections one device takes.
pub const MAX_CONNECTIONS: u32 = 16;

/// An attach, reconnect or resize that failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// A URI, device name or option that does not parse or is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The handshake failed.
    #[error(transparent)]
    Handshake(#[from] client::HandshakeError),
    /// The kernel refused.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The export cannot be a kernel block device, or changed in a way the device cannot
    /// follow.
    #[error("{0}")]
    Export(String),
    /// The server is of another crash generation than the device's record (see the
    /// module's notes): the device must not be reconnected to it.
    #[error("{0}")]
    Fenced(String),
    /// The device has no record here (attached by something else, or the record is
    /// gone): it cannot be reconnected or resized.
    #[error("/dev/nbd{0} has no reconnect record in {1}: attached by another tool, or before a reboot")]
    NoRecord(u32, String),
    /// The run directory could not be written.
    #[error("the reconnect record {path}: {source}")]
    Record {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Parses `nbd://HOST[:PORT]/EXPORT` (port 10809 by default), `nbds://` the same over
/// TLS, or `nbd+unix:///EXPORT?socket=PATH`. The export name is the rest of the path, `/`
/// included (ferrovol's `VOLUME/KEY`); no percent-decoding.
///
/// Errors: [`AttachError::Invalid`].
pub fn parse_uri(uri: &str) -> Result<(Target, String), AttachError> {
    let bad = |why: &str| AttachError::Invalid(format!("{uri}: {why}"));
    if let Some(rest) = uri.strip_prefix("nbd+unix:///") {
        let (export, query) = rest.split_once('?').unwrap_or((rest, ""));
        let socket = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("socket="))
            .ok_or_else(|| bad("an nbd+unix URI needs ?socket=PATH"))?;
        return Ok((Target::Unix(socket.into()), export.to_string()));
    }
    let (tls, rest) = match (uri.strip_prefix("nbd://"), uri.strip_prefix("nbds://")) {
        (Some(rest), _) => (false, rest),
        (_, Some(rest)) => (true, rest),
        _ => return Err(bad("not nbd[s]://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")),
    };
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
    if authority.is_empty() || authority.contains('@') {
        return Err(bad("not nbd://HOST[:PORT]/EXPORT"));
    }
    let addr = match authority.rsplit_once(':') {
        Some((host, port)) if !authority.ends_with(']') => {
            if host.is_empty() || !port.parse::<u16>().is_ok_and(|p| p != 0) {
                return Err(bad(&format!("{port:?} is not a port")));
            }
            authority.to_string()
        }
        _ => format!("{authority}:10809"),
    };
    Ok((if tls { Target::Tls(addr) } else { Target::Tcp(addr) }, export.to_string()))
}

/// Parses `/dev/nbdN`, `nbdN` or `N`.
///
/// Errors: [`AttachError::Invalid`].
pub fn parse_device(d: &str) -> Result<u32, AttachError> {
    let n = d.strip_prefix("/dev/").unwrap_or(d);
    let n = n.strip_prefix("nbd").unwrap_or(n);
    n.parse().map_err(|_| AttachError::Invalid(format!("{d:?} is not an NBD device (/dev/nbdN)")))
}

/// `uri` without the export name's key (what follows the volume), for messages and
/// logs.
pub fn shown(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://") else { return uri.to_string() };
    let rest = &uri[scheme_end + 3..];
    let Some(slash) = rest.find('/') else { return uri.to_string() };
    let (authority, path) = rest.split_at(slash);
    let path = &path[1..];
    let (path, query) = path.split_once('?').map_or((path, ""), |(p, q)| (p, q));
    match path.split_once('/') {
        Some((volume, _key)) => {
            let q = if query.is_empty() { String::new() } else { format!("?{query}") };
            format!("{}://{authority}/{volume}/…{q}", &uri[..scheme_end])
        }
        None => uri.to_string(),
    }
}

/// The backend identifier of an export: where it is and the volume, never a key (the
/// part of the name after its first `/`), since sysfs shows it to every user.
pub fn backend_of(target: &Target, export: &str) -> String {
    let volume = export.split('/').next().unwrap_or_default();
    match target {
        // The same export with or without TLS: a device may go over to TLS.
        Target::Tcp(addr) | Target::Tls(addr) => format!("{addr}/{volume}"),
        Target::Unix(_) => format!("{target}/{volume}"),
    }
}

/// What to attach.
#[derive(Debug, Clone)]
pub struct Options {
    /// The export's URI ([`parse_uri`]).
    pub uri: String,
    /// `/dev/nbdN` to use, or any free one.
    pub device: Option<u32>,
    /// Connections, 1 to [`MAX_CONNECTIONS`]; more than one needs an export with
    /// `NBD_FLAG_CAN_MULTI_CONN`.
    pub connections: u32,
    /// How long requests wait for a reconnect once every connection is dead before
    /// they fail with EIO; `None`: they fail at once ([`kernel::Attach`]).
    pub dead_timeout: Option<Duration>,
    /// The backend identifier; [`backend_of`] the URI by default.
    pub backend: Option<String>,
    /// The run directory for the record ([`DEFAULT_RUN_DIR`]).
    pub run_dir: PathBuf,
    /// The client's TLS credentials directory ([`client::ClientTls`]), for `nbds://`
    /// URIs; kept in the record, so that reconnects read it again.
    pub tls_dir: Option<PathBuf>,
}

/// A device attached by [`attach`].
#[derive(Debug, Clone)]
pub struct Attached {
    /// `N` of `/dev/nbdN`.
    pub index: u32,
    /// What the export offered.
    pub info: ExportInfo,
}

/// How a device fares, as its record tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Connected, as far as the watcher knows.
    Alive,
    /// A connection died; the watcher has been trying since this time (seconds since
    /// the epoch) to reconnect.
    Reconnecting(u64),
    /// Not reconnected on purpose; the device was detached. The reason.
    Fenced(String),
}

/// A device's record: what the watcher needs to reconnect it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// `N` of `/dev/nbdN`.
    pub index: u32,
    /// The export's URI, key included.
    pub uri: String,
    /// The backend identifier given to the kernel.
    pub backend: String,
    /// Connections at attach.
    pub connections: u32,
    /// The server's crash generation at attach or the last reconnect, if it tells one.
    pub generation: Option<CrashGeneration>,
    /// The TLS credentials directory for `nbds://`, read at each reconnect.
    pub tls_dir: Option<PathBuf>,
    /// How the device fares.
    pub health: Health,
}

impl Record {
    fn path(run_dir: &Path, index: u32) -> PathBuf {
        run_dir.join(format!("nbd{index}"))
    }

    fn encode(&self) -> String {
        let mut s = format!(
            "uri={}\nbackend={}\nconnections={}\n",
            self.uri.replace('\n', ""),
            self.backend.replace('\n', ""),
            self.connections
        );
        if let Some(g) = &self.generation {
            s += &format!("generation={g}\n");
        }
        if let Some(d) = &self.tls_dir {
            s += &format!("tls_dir={}\n", d.display().to_string().replace('\n', ""));
        }
        s += &match &self.health {
            Health::Alive => "health=alive\n".to_string(),
            Health::Reconnecting(t) => format!("health=reconnecting\nsince={t}\n"),
            Health::Fenced(why) => format!("health=fenced\nwhy={}\n", why.replace('\n', " ")),
        };
        s
    }

    fn decode(index: u32, text: &str) -> Option<Record> {
        let kv: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        let health = match *kv.get("health")? {
            "alive" => Health::Alive,
            "reconnecting" => Health::Reconnecting(kv.get("since")?.parse().ok()?),
            "fenced" => Health::Fenced(kv.get("why").unwrap_or(&"").to_string()),
            _ => return None,
        };
        Some(Record {
            index,
            uri: kv.get("uri")?.to_string(),
            backend: kv.get("backend")?.to_string(),
            connections: kv.get("connections")?.parse().ok()?,
            generation: match kv.get("generation") {
                Some(g) => Some(CrashGeneration::parse(g)?),
                None => None,
            },
            tls_dir: kv.get("tls_dir").map(PathBuf::from),
            health,
        })
    }

    /// Reads the record of `/dev/nbd{index}`, if there is a readable one.
    pub fn load(run_dir: &Path, index: u32) -> Option<Record> {
        Record::decode(index, &std::fs::read_to_string(Record::path(run_dir, index)).ok()?)
    }

    /// Writes it (readable by its owner only: it holds the export's key), atomically.
    ///
    /// Errors: [`AttachError::Record`].
    pub fn store(&self, run_dir: &Path) -> Result<(), AttachError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let path = Record::path(run_dir, self.index);
        let err = |source| AttachError::Record { path: path.display().to_string(), source };
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(run_dir).map_err(err)?;
        // A new file of our own (never one planted there, nor a symlink), made 0600.
        let tmp = run_dir.join(format!(".nbd{}.{}.{}", self.index, std::process::id(), now_nanos()));
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(err)?;
        f.write_all(self.encode().as_bytes()).map_err(err)?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(err)
    }

    /// Removes the record of `/dev/nbd{index}`, if any.
    pub fn remove(run_dir: &Path, index: u32) {
        let _ = std::fs::remove_file(Record::path(run_dir, index));
    }
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// [`open_exact`], going over to TLS when the server requires it: an `nbd://` URI whose
/// server answers `NBD_REP_ERR_TLS_REQD` is opened as `nbds://` when `tls_dir` is given
/// (never the other way: a server that stops offering TLS is not followed). Returns
/// the URI opened, for the record.
fn open_connections(
    uri: &str,
    connections: u32,
    tls_dir: Option<&Path>,
) -> Result<(String, Vec<client::Stream>, ExportInfo), AttachError> {
    match open_exact(uri, connections, tls_dir) {
        Ok((streams, info)) => Ok((uri.to_string(), streams, info)),
        Err(AttachError::Handshake(client::HandshakeError::TlsRequired { .. }))
            if tls_dir.is_some() && uri.starts_with("nbd://") =>
        {
            let upgraded = format!("nbds://{}", &uri["nbd://".len()..]);
            let (streams, info) = open_exact(&upgraded, connections, tls_dir)?;
            tracing::info!(uri = %shown(&upgraded), "the server requires TLS: opened over TLS");
            Ok((upgraded, streams, info))
        }
        Err(e) => Err(e),
    }
}

/// Checks a TLS credentials directory as a record keeps it: an absolute UTF-8 path
/// without line breaks (a watcher in another directory reads it back the same).
///
/// Errors: [`AttachError::Invalid`].
fn check_tls_dir(dir: &Path) -> Result<(), AttachError> {
    match dir.to_str() {
        Some(d) if dir.is_absolute() && !d.contains(['\n', '\r']) => Ok(()),
        _ => Err(AttachError::Invalid(format!(
            "--tls-dir {}: give an absolute path (UTF-8, no line breaks)",
            dir.display()
        ))),
    }
}

/// Opens `connections` handshaken connections to `uri`, over TLS with the credentials
/// in `tls_dir` for an `nbds://` URI; all must describe the export alike.
fn open_exact(
    uri: &str,
    connections: u32,
    tls_dir: Option<&Path>,
) -> Result<(Vec<client::Stream>, ExportInfo), AttachError> {
    let (target, export) = parse_uri(uri)?;
    if connections == 0 || connections > MAX_CONNECTIONS {
        return Err(AttachError::Invalid(format!("--connections {connections}: 1 to {MAX_CONNECTIONS}")));
    }
    let tls = match (&target, tls_dir) {
        (Target::Tls(_), Some(dir)) => Some(
            client::ClientTls::load(dir)
                .map_err(|e| AttachError::Invalid(format!("the TLS credentials in {}: {e}", dir.display())))?,
        ),
        (Target::Tls(_), None) => {
            return Err(AttachError::Invalid(format!(
                "{} is over TLS: give the directory of the client's TLS credentials (ca.crt, tls.crt, tls.key)",
                shown(uri)
            )))
        }
        _ => None,
    };
    let mut streams = Vec::new();
    let mut info: Option<ExportInfo> = None;
    for _ in 0..connections {
        let (s, i) = client::connect(&target, &export, HANDSHAKE_TIMEOUT, tls.as_ref())?;
        if connections > 1 && !i.multi_conn() {
            return Err(AttachError::Export(format!(
                "{} does not allow several connections (no NBD_FLAG_CAN_MULTI_CONN): use --connections 1",
                shown(uri)
            )));
        }
        // Size and flags, not the description (which may change between two handshakes:
        // a first write, a resize).
        if info.as_ref().is_some_and(|f| (f.size, f.flags, f.block_size) != (i.size, i.flags, i.block_size)) {
            return Err(AttachError::Export(format!(
                "{} answered two connections differently (size, flags or block sizes)",
                shown(uri)
            )));
        }
        streams.push(s);
        info = Some(i);
    }
    Ok((streams, info.expect("one connection at least")))
}

/// Attaches an export (`NBD_CMD_CONNECT`) and writes its record. An `nbd://` URI whose
/// server requires TLS is attached over TLS when `o.tls_dir` is given (the record keeps
/// the `nbds://` URI).
///
/// Errors: [`AttachError::Invalid`]; [`AttachError::Handshake`]; [`AttachError::Export`]
/// (several connections to an export without multi-conn, a block size the kernel cannot
/// take); [`AttachError::Kernel`]; [`AttachError::Record`] (the device is detached
/// again: without its record it could not be reconnected).
pub fn attach(o: &Options) -> Result<Attached, AttachError> {
    let (target, export) = parse_uri(&o.uri)?;
    if let Some(d) = &o.tls_dir {
        check_tls_dir(d)?;
    }
    let (uri, streams, info) = open_connections(&o.uri, o.connections, o.tls_dir.as_deref())?;
    let (block_size, warning) = kernel_block_size(&info)?;
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    let backend = o.backend.clone().unwrap_or_else(|| backend_of(&target, &export));
    let index = kernel::connect(&kernel::Attach {
        index: o.device,
        size: info.size,
        block_size,
        server_flags: info.flags,
        sockets: streams.iter().map(AsRawFd::as_raw_fd).collect(),
        dead_conn_timeout: o.dead_timeout.map(|t| t.min(kernel::MAX_DEAD_CONN_TIMEOUT)),
        backend: backend.clone(),
    })?;
    // The kernel holds its own references to the sockets.
    drop(streams);
    let record = Record {
        index,
        uri,
        backend,
        connections: o.connections,
        generation: info.crash_generation(),
        tls_dir: o.tls_dir.clone(),
        health: Health::Alive,
    };
    if let Err(e) = record.store(&o.run_dir) {
        let _ = kernel::disconnect(index);
        return Err(e);
    }
    Ok(Attached { index, info })
}

/// The kernel device's logical block size for an export (proto.md "Block size
/// constraints": the client MUST honour the minimum): its preferred size, at least its
/// minimum and 512, at most 4096; with a warning when the export takes requests smaller
/// than the kernel's largest (32 MiB).
///
/// Errors: [`AttachError::Export`] for an export whose minimum is above 4096 (the
/// kernel's largest logical block size), or whose size is not a multiple of the block
/// size.
pub fn kernel_block_size(info: &ExportInfo) -> Result<(u64, Option<String>), AttachError> {
    let (min, pref, max) = match info.block_size {
        Some(b) => (u64::from(b.minimum), u64::from(b.preferred), u64::from(b.maximum)),
        None => (1, 4096, u64::from(u32::MAX)),
    };
    let name = info.name.split('/').next().unwrap_or_default();
    if min > 4096 {
        return Err(AttachError::Export(format!(
            "export {name:?} takes blocks of {min} bytes at least; the kernel's are 4096 at most"
        )));
    }
    let bs = pref.clamp(min.max(512), 4096);
    if !info.size.is_multiple_of(bs) {
        return Err(AttachError::Export(format!(
            "export {name:?} is {} bytes, not a multiple of its block size {bs}",
            info.size
        )));
    }
    let warning = (max < 32 << 20)
        .then(|| format!("export {name:?} takes requests of {max} bytes at most; the kernel may send larger ones"));
    Ok((bs, warning))
}

/// Detaches `/dev/nbd{index}` and removes its record.
///
/// Errors: as [`kernel::disconnect`].
pub fn detach(run_dir: &Path, index: u32) -> Result<(), AttachError> {
    kernel::disconnect(index)?;
    Record::remove(run_dir, index);
    Ok(())
}

/// The record of `/dev/nbd{index}` if the kernel has it attached with the record's
/// backend.
fn live_record(run_dir: &Path, index: u32) -> Result<Record, AttachError> {
    let no_record = || AttachError::NoRecord(index, run_dir.display().to_string());
    let rec = Record::load(run_dir, index).ok_or_else(no_record)?;
    let dev = kernel::status(Some(index))?.into_iter().next();
    match dev {
        Some(d) if d.connected && d.backend.as_deref() == Some(rec.backend.as_str()) => Ok(rec),
        Some(d) if d.connected => Err(no_record()),
        _ => Err(KernelError::NoDevice(format!("{index} attached")).into()),
    }
}

/// The size of `/dev/nbd{index}` in bytes, from sysfs.
fn device_size(index: u32) -> Option<u64> {
    let sectors: u64 = std::fs::read_to_string(format!("/sys/block/nbd{index}/size")).ok()?.trim().parse().ok()?;
    Some(sectors * 512)
}

/// Makes `/dev/nbd{index}` take its export's size now (after the volume grew), with
/// the file system on it mounted or not (`NBD_CMD_RECONFIGURE` with the size: the
/// kernel sets the capacity and tells udev). Returns the new size in bytes.
///
/// Errors: [`AttachError::NoRecord`]; [`AttachError::Export`] when the export shrank (a
/// device never shrinks under its file system); [`AttachError::Fenced`] when the
/// server changed its crash generation (see the module's notes);
/// [`AttachError::Handshake`]; [`AttachError::Kernel`].
pub fn resize(run_dir: &Path, index: u32) -> Result<u64, AttachError> {
    let rec = live_record(run_dir, index)?;
    let (_, _probe, info) = open_connections(&rec.uri, 1, rec.tls_dir.as_deref())?;
    check_generation(&rec, &info)?;
    let current = device_size(index).unwrap_or(0);
    if info.size < current {
        return Err(AttachError::Export(format!(
            "{} is {} bytes now, smaller than /dev/nbd{index} ({current} bytes): not shrunk",
            rec.backend, info.size
        )));
    }
    if info.size != current {
        kernel::reconfigure(&kernel::Reconfigure {
            index,
            backend: rec.backend.clone(),
            sockets: Vec::new(),
            size: Some(info.size),
        })?;
    }
    Ok(info.size)
}

/// Refuses a server whose crash generation is not the record's.
fn check_generation(rec: &Record, info: &ExportInfo) -> Result<(), AttachError> {
    let now = info.crash_generation();
    if rec.generation.is_some() && rec.generation != now {
        return Err(AttachError::Fenced(format!(
            "the storage host of {} restarted after a crash (crash generation {} at attach, {} now): writes it \
             acknowledged without a flush may be lost, so the device is not reconnected",
            rec.backend,
            rec.generation.as_ref().map_or("-".into(), ToString::to_string),
            now.as_ref().map_or("none".into(), ToString::to_string),
        )));
    }
    Ok(())
}

/// Hands `/dev/nbd{index}` new sockets now, to its recorded export or to `to` (a URI
/// and the backend identifier it leads to, [`backend_of`] the URI by default); the
/// kernel takes one in place of each dead connection and drops the rest, and refuses
/// them all for another backend. Also takes the export's size if it grew. A recorded
/// `nbd://` URI whose server now requires TLS is reconnected as `nbds://` when the
/// record has a TLS credentials directory (and the record follows).
///
/// Errors: [`AttachError::NoRecord`]; [`AttachError::Fenced`] (another crash generation:
/// the caller should detach); [`AttachError::Export`] (the export shrank, or its
/// connections disagree); [`AttachError::Handshake`]; [`AttachError::Kernel`]
/// ([`KernelError::OtherBackend`] for another backend).
pub fn reconnect(run_dir: &Path, index: u32, to: Option<(&str, Option<&str>)>) -> Result<(), AttachError> {
    let mut rec = live_record(run_dir, index)?;
    let (uri, backend) = match to {
        None => (rec.uri.clone(), rec.backend.clone()),
        Some((uri, backend)) => {
            let (target, export) = parse_uri(uri)?;
            (uri.to_string(), backend.map_or_else(|| backend_of(&target, &export), str::to_string))
        }
    };
    // A server that turned TLS on since: the device goes over to TLS.
    let (uri, streams, info) = open_connections(&uri, rec.connections, rec.tls_dir.as_deref())?;
    check_generation(&rec, &info)?;
    let current = device_size(index).unwrap_or(0);
    if info.size < current {
        return Err(AttachError::Export(format!(
            "{} is {} bytes now, smaller than /dev/nbd{index} ({current} bytes): not reconnected",
            shown(&uri),
            info.size
        )));
    }
    kernel::reconfigure(&kernel::Reconfigure {
        index,
        // The backend the new sockets lead to: the kernel compares it with its own.
        backend: backend.clone(),
        sockets: streams.iter().map(AsRawFd::as_raw_fd).collect(),
        size: (info.size > current).then_some(info.size),
    })?;
    // The record follows: the next reconnect goes where this one went.
    if rec.health != Health::Alive || rec.uri != uri || rec.backend != backend {
        (rec.health, rec.uri, rec.backend) = (Health::Alive, uri, backend);
        rec.store(run_dir)?;
    }
    Ok(())
}

/// The attached device whose backend identifier is `backend`, if any.
///
/// Errors: as [`kernel::status`].
pub fn find(backend: &str) -> Result<Option<u32>, AttachError> {
    Ok(kernel::status(None)?
        .into_iter()
        .find(|d| d.connected && d.backend.as_deref() == Some(backend))
        .map(|d| d.index))
}

/// What the export of `/dev/nbd{index}` offers now (a handshake on a connection of its
/// own, to the recorded URI).
///
/// Errors: [`AttachError::NoRecord`]; [`AttachError::Handshake`].
pub fn export_info(run_dir: &Path, index: u32) -> Result<ExportInfo, AttachError> {
    let rec = live_record(run_dir, index)?;
    Ok(open_connections(&rec.uri, 1, rec.tls_dir.as_deref())?.2)
}

/// How `/dev/nbd{index}` fares, from its record: `None` without one.
pub fn health(run_dir: &Path, index: u32) -> Option<Health> {
    live_record(run_dir, index).ok().map(|r| r.health)
}

/// A device as `list` shows it: the kernel's view and its record's.
#[derive(Debug, Clone)]
pub struct Listed {
    /// The kernel's device.
    pub device: kernel::Device,
    /// Its record's health, if it has a record with its backend.
    pub health: Option<Health>,
}

/// The NBD devices with their health.
///
/// Errors: as [`kernel::status`].
pub fn list(run_dir: &Path) -> Result<Vec<Listed>, AttachError> {
    Ok(kernel::status(None)?
        .into_iter()
        .map(|d| {
            let health = Record::load(run_dir, d.index)
                .filter(|r| d.connected && d.backend.as_deref() == Some(r.backend.as_str()))
                .map(|r| r.health);
            Listed { device: d, health }
        })
        .collect())
}

/// Whether a watcher holds the run directory's lock.
pub fn watcher_running(run_dir: &Path) -> bool {
    let Ok(f) = std::fs::OpenOptions::new().write(true).open(run_dir.join("watch.lock")) else { return false };
    match f.try_lock() {
        Ok(()) => {
            let _ = f.unlock();
            false
        }
        Err(_) => true,
    }
}

/// One device being reconnected at a time.
type Busy = Arc<Mutex<HashSet<u32>>>;

/// Runs the reconnect watcher until the process ends: takes the run directory's lock
/// (one watcher per node), joins the kernel's link-dead messages, offers every recorded
/// device new sockets once (connections may have died while no watcher ran), then
/// reconnects each device whose link dies, retrying every `retry` (with more time
/// between tries as they fail, up to 8×) until it is reconnected, detached, or fenced.
///
/// Errors: another watcher runs; the kernel has no NBD driver; the run directory cannot
/// be made.
pub fn watch(run_dir: &Path, retry: Duration) -> Result<(), AttachError> {
    use std::os::unix::fs::DirBuilderExt;
    let err = |source| AttachError::Record { path: run_dir.display().to_string(), source };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(run_dir).map_err(err)?;
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(run_dir.join("watch.lock"))
        .map_err(err)?;
    if lock.try_lock().is_err() {
        return Err(AttachError::Invalid(format!("another watcher runs on {}", run_dir.display())));
    }
    let (tx, rx) = std::sync::mpsc::channel::<Option<u32>>();
    let mut events = kernel::LinkDeadEvents::subscribe()?;
    std::thread::Builder::new()
        .name("nbd-link-dead".into())
        .spawn(move || loop {
            match events.wait() {
                Ok(i) => {
                    if tx.send(Some(i)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "link-dead messages lost; looking at every device");
                    // Subscribe again (waiting longer after each failure), then look at
                    // every device once: messages may have been lost meanwhile.
                    let mut wait = Duration::from_secs(1);
                    loop {
                        std::thread::sleep(wait);
                        match kernel::LinkDeadEvents::subscribe() {
                            Ok(ev) => {
                                events = ev;
                                break;
                            }
                            Err(e) => tracing::error!(error = %e, "cannot subscribe again"),
                        }
                        wait = (wait * 2).min(Duration::from_secs(60));
                    }
                    if tx.send(None).is_err() {
                        return;
                    }
                }
            }
        })
        .map_err(err)?;
    tracing::info!(run_dir = %run_dir.display(), "watching NBD devices");
    let busy: Busy = Arc::default();
    let sweep = |busy: &Busy| {
        if let Ok(devs) = kernel::status(None) {
            for d in devs.into_iter().filter(|d| d.connected) {
                spawn_reconnect(run_dir, d.index, retry, busy, false);
            }
        }
    };
    sweep(&busy);
    while let Ok(ev) = rx.recv() {
        match ev {
            Some(i) => spawn_reconnect(run_dir, i, retry, &busy, true),
            None => sweep(&busy),
        }
    }
    drop(lock);
    Ok(())
}

/// Starts reconnecting `/dev/nbd{index}` on a thread of its own unless one does already.
/// `dead`: the kernel said a link died (else an offer after the watcher's start).
fn spawn_reconnect(run_dir: &Path, index: u32, retry: Duration, busy: &Busy, dead: bool) {
    if !busy.lock().expect("not poisoned").insert(index) {
        return;
    }
    let run_dir = run_dir.to_path_buf();
    let busy = Arc::clone(busy);
    let spawned = std::thread::Builder::new().name(format!("nbd{index}-reconnect")).spawn(move || {
        reconnect_until_done(&run_dir, index, retry, dead);
        busy.lock().expect("not poisoned").remove(&index);
    });
    if spawned.is_err() {
        tracing::error!(index, "cannot start a reconnect thread");
    }
}

/// The device at `rec.index` is still attached with `rec`'s backend, and its record is
/// still `rec`'s (same export).
fn same_device(run_dir: &Path, rec: &Record) -> bool {
    live_record(run_dir, rec.index).is_ok_and(|r| r.backend == rec.backend && r.uri == rec.uri)
}

fn reconnect_until_done(run_dir: &Path, index: u32, retry: Duration, dead: bool) {
    let mut wait = retry;
    let mut marked = false;
    loop {
        let rec = match live_record(run_dir, index) {
            Ok(r) => r,
            Err(AttachError::NoRecord(..)) => {
                if dead {
                    tracing::warn!(index, "a link of /dev/nbd{index} died; it has no record here, not reconnected");
                }
                return;
            }
            // Detached meanwhile, or the kernel cannot tell: nothing to do.
            Err(_) => return,
        };
        if matches!(rec.health, Health::Fenced(_)) {
            return;
        }
        match reconnect(run_dir, index, None) {
            Ok(()) => {
                if dead || marked {
                    tracing::info!(index, backend = %rec.backend, "/dev/nbd{index} reconnected");
                }
                return;
            }
            Err(AttachError::Fenced(why)) => {
                // Still the device the record was read for? (It may have been detached
                // and another volume attached at its index meanwhile.)
                if !same_device(run_dir, &rec) {
                    return;
                }
                tracing::error!(index, "{why}; detaching /dev/nbd{index}");
                let mut fenced = rec.clone();
                fenced.health = Health::Fenced(why);
                let _ = fenced.store(run_dir);
                if let Err(e) = kernel::disconnect(index) {
                    tracing::error!(index, error = %e, "detach failed");
                }
                return;
            }
            Err(e) => {
                // After the watcher's start as after a link-dead message: a device
                // whose export does not answer is taken for dead, its connections
                // may have died while no watcher ran.
                if !marked && same_device(run_dir, &rec) {
                    tracing::warn!(index, error = %e, "reconnecting /dev/nbd{index}");
                    let mut r = rec.clone();
                    r.health = Health::Reconnecting(now());
                    let _ = r.store(run_dir);
                    marked = true;
                }
            }
        }
        std::thread::sleep(wait);
        wait = (wait * 2).min(retry * 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_and_devices_parse() {
        let (t, e) = parse_uri("nbd://10.0.2.2:10809/vol/abc123").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("10.0.2.2:10809".into()), "vol/abc123"));
        let (t, e) = parse_uri("nbd://host/vol").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("host:10809".into()), "vol"));
        let (t, e) = parse_uri("nbd+unix:///vol?socket=/run/nbd.sock").unwrap();
        assert_eq!((t, e.as_str()), (Target::Unix("/run/nbd.sock".into()), "vol"));
        let (t, e) = parse_uri("nbd://[::1]:7000/vol?tls=off").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("[::1]:7000".into()), "vol"));
        for bad in ["http://x/y", "nbd:///vol", "nbd+unix:///vol", "nbd://host:/v", "nbd://host:0/v", "nbd://u@h/v"] {
            assert!(parse_uri(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_device("/dev/nbd3").unwrap(), 3);
        assert_eq!(parse_device("nbd0").unwrap(), 0);
        assert_eq!(parse_device("7").unwrap(), 7);
        assert!(parse_device("/dev/sda").is_err());
        assert_eq!(backend_of(&Target::Tcp("h:1".into()), "vol/key"), "h:1/vol");
        assert_eq!(backend_of(&Target::Tls("h:1".into()), "vol/key"), "h:1/vol");
        let (t, e) = parse_uri("nbds://h:1/vol/key").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tls("h:1".into()), "vol/key"));
    }

    #[test]
    fn records_round_trip_and_stay_private() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let mut r = Record {
            index: 3,
            uri: "nbd://h:1/vol/key".into(),
            backend: "h:1/vol".into(),
            connections: 2,
            generation: Some(CrashGeneration { pool: "0123456789ab".into(), generation: 4 }),
            tls_dir: Some("/etc/ferrovol/nbd-tls".into()),
            health: Health::Alive,
        };
        r.store(&run).unwrap();
        assert_eq!(Record::load(&run, 3).as_ref(), Some(&r));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(run.join("nbd3")).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&run).unwrap().permissions().mode() & 0o777, 0o700);
        r.health = Health::Reconnecting(17);
        r.generation = None;
        r.store(&run).unwrap();
        assert_eq!(Record::load(&run, 3).as_ref(), Some(&r));
        r.health = Health::Fenced("a crash\nof the host".into());
        r.store(&run).unwrap();
        assert_eq!(Record::load(&run, 3).unwrap().health, Health::Fenced("a crash of the host".into()));
        Record::remove(&run, 3);
        assert!(Record::load(&run, 3).is_none());
    }

    #[test]
    fn crash_generations_are_found_in_descriptions() {
        let g = CrashGeneration { pool: "0123456789ab".into(), generation: 12 };
        let d = format!("ferrovol thin volume v, 4096 bytes; {}", g.tag());
        assert_eq!(CrashGeneration::find(&d), Some(g.clone()));
        assert_eq!(CrashGeneration::parse(&g.to_string()), Some(g));
        assert_eq!(CrashGeneration::find("qemu-nbd export"), None);
        assert_eq!(CrashGeneration::find("crash-generation zz.1"), None);
        assert_eq!(CrashGeneration::find("crash-generation ab.x"), None);
    }
}
