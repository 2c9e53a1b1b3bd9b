//! The storage host on the node's own machine: when a published volume lives there, the
//! node asks that host for a local block device (its management API's AttachLocal, a
//! ublk device `/dev/ublkbN`) instead of attaching over NBD, which would cross a TCP
//! socket to reach the same machine.
//!
//! What lives here: which host is local (its management socket, given to the node),
//! whether a volume is that host's (its volume ID names the host's pool), whether the
//! kernel resizes ublk devices online, and the calls the node makes. The host keeps
//! which device serves which volume (`Volume.local_device`), so the node keeps no state
//! for local devices either. Not here: the NBD path ([`nbd::attach`]), the CSI calls
//! ([`crate::node`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mgmt_api::{ApiError, Client, ErrorKind};

use crate::ids::{parse_volume_id, short_host_id};

/// How long one call to the local host may take (connecting included): longer than
/// the host waits for the driver to start a device (60 s), so that a slow start
/// answers rather than times out while the device is made.
pub const LOCAL_CALL_TIMEOUT: Duration = Duration::from_secs(75);

/// When the node attaches a local host's volumes as ublk devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalUblk {
    /// When the host can make one and the kernel resizes ublk devices online (Linux
    /// 6.16 and later), so that NodeExpandVolume behaves as over NBD; NBD otherwise.
    Auto,
    /// Whenever the host can make one. On a kernel that does not resize ublk devices
    /// online, NodeExpandVolume of such a volume fails (FAILED_PRECONDITION) until it is
    /// staged again.
    Always,
    /// Never: NBD for every volume.
    Never,
}

impl std::str::FromStr for LocalUblk {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(LocalUblk::Auto),
            "always" => Ok(LocalUblk::Always),
            "never" => Ok(LocalUblk::Never),
            other => Err(format!("{other:?}: auto, always or never")),
        }
    }
}

/// The storage host on this machine, as the node reaches it.
#[derive(Debug, Clone)]
pub struct LocalHost {
    /// Its management socket (the host's `--data-dir`/ferrovol.sock, shared with the
    /// node plugin).
    pub socket: PathBuf,
    /// When its volumes are attached as ublk devices.
    pub ublk: LocalUblk,
    /// The host's short id once read (its pool's UUID does not change): volumes of
    /// other hosts are told apart without a call.
    short_id: Arc<Mutex<Option<String>>>,
}

/// A volume of the local host: a client connected to it and the volume's name there.
pub struct LocalVolume {
    /// The management client.
    pub client: Client,
    /// The volume's name on the host.
    pub name: String,
}

/// Runs `f` on the runtime of the calling blocking-pool thread (the node's calls run
/// there), bounded by [`LOCAL_CALL_TIMEOUT`].
///
/// Errors: [`ErrorKind::Unavailable`] on timeout; `f`'s own.
pub fn block_on<T>(what: &str, f: impl Future<Output = Result<T, ApiError>>) -> Result<T, ApiError> {
    let handle = tokio::runtime::Handle::current();
    handle.block_on(async {
        match tokio::time::timeout(LOCAL_CALL_TIMEOUT, f).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::new(
                ErrorKind::Unavailable,
                format!(
                    "{what}: the storage host on this machine did not answer within {} s",
                    LOCAL_CALL_TIMEOUT.as_secs()
                ),
            )),
        }
    })
}

impl LocalHost {
    /// The storage host whose management socket is `socket`.
    pub fn new(socket: PathBuf, ublk: LocalUblk) -> LocalHost {
        LocalHost { socket, ublk, short_id: Arc::default() }
    }

    /// The host's short id, if read before.
    fn known_id(&self) -> Option<String> {
        self.short_id.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The local host's client and the volume's name when volume `volume_id` lives on
    /// that host (its ID names the host's pool); `None` when it lives elsewhere, or
    /// when no socket is there (no storage host runs on this machine). A volume of
    /// another host is told apart without a call once the host's id was read.
    ///
    /// Errors: the host does not answer ([`ErrorKind::Unavailable`]), or fails; a
    /// host whose id was never read cannot say whether the volume is its own.
    pub fn volume(&self, volume_id: &str) -> Result<Option<LocalVolume>, ApiError> {
        let Some(vid) = parse_volume_id(volume_id) else { return Ok(None) };
        let known = self.known_id();
        if known.as_ref().is_some_and(|id| *id != vid.host) || !self.socket.exists() {
            return Ok(None);
        }
        let socket = self.socket.clone();
        let client = block_on("connect to the storage host on this machine", async move {
            let client = Client::connect_unix(&socket).await?;
            let id = match known {
                Some(id) => id,
                None => short_host_id(&client.host_info().await?.host_id),
            };
            Ok((client, id))
        });
        let (client, id) = client?;
        *self.short_id.lock().unwrap_or_else(|p| p.into_inner()) = Some(id.clone());
        Ok((id == vid.host).then(|| LocalVolume { client, name: vid.name }))
    }
}

impl LocalVolume {
    /// The volume's size in bytes, whether it was never written (`pristine`), and its
    /// local device, if it has one.
    ///
    /// Errors: [`ErrorKind::NotFound`] when the host has no such volume; the call's.
    pub fn state(&self) -> Result<(u64, bool, Option<PathBuf>), ApiError> {
        let v = block_on("read the volume", self.client.volume(&self.name))?;
        let dev = (!v.local_device.is_empty()).then(|| PathBuf::from(v.local_device));
        Ok((v.size_bytes, v.pristine, dev))
    }

    /// Asks the host for the volume's local device for node `node_id` (the host
    /// removes it when the volume is unpublished from the node) and returns its path;
    /// the device the volume has already if another call made it.
    ///
    /// Errors: [`ErrorKind::FailedPrecondition`] when the host can make no ublk device
    /// (its build, the kernel or its rights) or the volume is not published to the
    /// node writable; [`ErrorKind::NotFound`]; the call's.
    pub fn attach(&self, node_id: &str) -> Result<PathBuf, ApiError> {
        match block_on("attach the volume locally", self.client.attach_local_for(&self.name, node_id)) {
            Ok(d) => Ok(PathBuf::from(d.path)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => match self.state()? {
                (_, _, Some(dev)) => Ok(dev),
                _ => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Removes the volume's local device; OK when it has none.
    ///
    /// Errors: the call's (the device is in use is FAILED_PRECONDITION or ABORTED).
    pub fn detach(&self) -> Result<(), ApiError> {
        match block_on("detach the local device", self.client.detach_local(&self.name)) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Whether the running kernel resizes ublk devices online (UBLK_U_CMD_UPDATE_SIZE,
/// Linux 6.16), from `/proc/sys/kernel/osrelease`.
pub fn kernel_resizes_ublk() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").is_ok_and(|r| release_at_least(&r, 6, 16))
}

/// Whether kernel release `release` (e.g. `6.12.38+deb13-amd64`) is at least
/// `major.minor`.
pub fn release_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    let num = |p: Option<&str>| p.and_then(|s| s.parse::<u32>().ok());
    match (num(parts.next()), num(parts.next())) {
        (Some(a), Some(b)) => (a, b) >= (major, minor),
        _ => false,
    }
}

/// Whether `dev` is a ublk block device path (`/dev/ublkbN`).
pub fn is_ublk_device(dev: &Path) -> bool {
    dev.to_str()
        .and_then(|s| s.strip_prefix("/dev/ublkb"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        assert!(!release_at_least("6.12.38+deb13-amd64", 6, 16));
        assert!(release_at_least("6.16.0", 6, 16));
        assert!(release_at_least("6.17-rc1", 6, 16));
        assert!(release_at_least("7.0.1", 6, 16));
        assert!(!release_at_least("5.19.0", 6, 16));
        assert!(!release_at_least("garbage", 6, 16));
    }

    #[test]
    fn only_ublk_block_devices_count_as_local_devices() {
        assert!(is_ublk_device(Path::new("/dev/ublkb0")));
        assert!(is_ublk_device(Path::new("/dev/ublkb12")));
        assert!(!is_ublk_device(Path::new("/dev/ublkc0")));
        assert!(!is_ublk_device(Path::new("/dev/ublkb")));
        assert!(!is_ublk_device(Path::new("/dev/nbd0")));
    }

    #[test]
    fn local_ublk_modes_parse() {
        assert_eq!("auto".parse::<LocalUblk>().unwrap(), LocalUblk::Auto);
        assert_eq!("always".parse::<LocalUblk>().unwrap(), LocalUblk::Always);
        assert_eq!("never".parse::<LocalUblk>().unwrap(), LocalUblk::Never);
        assert!("sometimes".parse::<LocalUblk>().is_err());
    }
}
