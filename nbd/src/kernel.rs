//! The Linux kernel's NBD driver, driven through its generic netlink family `nbd`
//! (include/uapi/linux/nbd-netlink.h, drivers/block/nbd.c): [`connect`] hands it sockets
//! in the transmission phase (from [`crate::client::connect`]) and makes `/dev/nbdN`,
//! [`disconnect`] detaches it, [`status`] lists the devices with their backend
//! identifiers (read from sysfs, where the kernel shows them), [`reconfigure`] hands a
//! live device new sockets (for a reconnect) or a new size, and [`LinkDeadEvents`]
//! receives the family's multicast `NBD_CMD_LINK_DEAD` messages.
//!
//! Synchronous, through neli's netlink router. Not here: the handshake
//! ([`crate::client`]), the reconnect policy ([`crate::attach`]).

use std::os::fd::RawFd;
use std::time::Duration;

use neli::consts::nl::NlmF;
use neli::consts::socket::NlFamily;
use neli::genl::{AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, Nlattr, NlattrBuilder};
use neli::nl::NlPayload;
use neli::router::synchronous::NlRouter;
use neli::types::{Buffer, GenlBuffer};
use neli::utils::Groups;

/// The family's name and version.
const FAMILY: &str = "nbd";
const VERSION: u8 = 1;

// Commands (enum of nbd-netlink.h).
const CMD_CONNECT: u8 = 1;
const CMD_DISCONNECT: u8 = 2;
const CMD_RECONFIGURE: u8 = 3;
const CMD_LINK_DEAD: u8 = 4;
const CMD_STATUS: u8 = 5;
/// The family's multicast group, where `NBD_CMD_LINK_DEAD` goes.
const MCAST_GROUP: &str = "nbd_mc_group";

// Attributes.
const ATTR_INDEX: u16 = 1;
const ATTR_SIZE_BYTES: u16 = 2;
const ATTR_BLOCK_SIZE_BYTES: u16 = 3;
const ATTR_TIMEOUT: u16 = 4;
const ATTR_SERVER_FLAGS: u16 = 5;
const ATTR_CLIENT_FLAGS: u16 = 6;
const ATTR_SOCKETS: u16 = 7;
const ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
const ATTR_DEVICE_LIST: u16 = 9;
const ATTR_BACKEND_IDENTIFIER: u16 = 10;
const SOCK_ITEM: u16 = 1;
const SOCK_FD: u16 = 1;
const DEVICE_ITEM: u16 = 1;
const DEVICE_INDEX: u16 = 1;
const DEVICE_CONNECTED: u16 = 2;

/// The longest dead-connection timeout taken: one day.
pub const MAX_DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(86_400);

/// What to attach.
#[derive(Debug, Clone)]
pub struct Attach {
    /// `/dev/nbdN` to use, or any free one (the kernel picks or makes it).
    pub index: Option<u32>,
    /// Size in bytes (the export's).
    pub size: u64,
    /// Logical block size in bytes (512 to 4096, a power of two).
    pub block_size: u64,
    /// The export's transmission flags (`NBD_FLAG_*`): read-only, flush, FUA, trim...
    pub server_flags: u16,
    /// Sockets in the transmission phase, one per connection; the kernel takes its own
    /// reference, so the caller may close them after.
    pub sockets: Vec<RawFd>,
    /// How long new requests wait for a reconnect (`NBD_CMD_RECONFIGURE`) once every
    /// connection is dead, before they fail with EIO; `None`: they fail at once. At
    /// most [`MAX_DEAD_CONN_TIMEOUT`]. The per-request timeout is 0 (`NBD_ATTR_TIMEOUT`):
    /// with one connection a request in flight waits for as long as it takes (the
    /// kernel logs it every 30 s); with several, a request unanswered for 30 s marks
    /// its connection dead and is sent again on another (drivers/block/nbd.c,
    /// `nbd_xmit_timeout`).
    pub dead_conn_timeout: Option<Duration>,
    /// The backend identifier: what the device is attached to (for ferrovol, the
    /// storage host's id and the volume). The kernel refuses a reconfigure that names
    /// another, and shows it in `/sys/block/nbdN/backend`.
    pub backend: String,
}

/// A device of the NBD driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// `N` of `/dev/nbdN`.
    pub index: u32,
    /// It has a live configuration (attached).
    pub connected: bool,
    /// Its backend identifier, if it was attached with one.
    pub backend: Option<String>,
}

/// A kernel call that failed.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The kernel has no `nbd` netlink family: the module is not loaded (`modprobe
    /// nbd`) or the kernel has no NBD driver.
    #[error("the kernel's NBD driver is not there (no generic netlink family \"nbd\"): modprobe nbd")]
    NoDriver,
    /// The caller may not configure NBD devices (`EPERM`: it needs CAP_SYS_ADMIN).
    #[error("not allowed to configure NBD devices (run as root, or with CAP_SYS_ADMIN)")]
    Permission,
    /// The device is attached already (`EBUSY`), or still being removed after a
    /// detach (`EINVAL` for a device asked for by index: retry).
    #[error("/dev/nbd{0} is in use (or still being removed: retry)")]
    Busy(String),
    /// No such device (`ENOENT`, or `EINVAL` for an index past the last device).
    #[error("no NBD device {0}")]
    NoDevice(String),
    /// A reconfiguration the kernel refused: the device is attached to another backend,
    /// or not attached.
    #[error("the kernel refused to reconfigure /dev/nbd{0}: it is attached to another backend, or not attached")]
    OtherBackend(u32),
    /// Anything else the kernel or the netlink socket reported.
    #[error("NBD netlink {what}: {message}")]
    Netlink {
        /// The command.
        what: &'static str,
        /// The error.
        message: String,
    },
}

type Router = NlRouter;
type Multicast = neli::router::synchronous::NlRouterReceiverHandle<u16, Genlmsghdr<u8, u16>>;

fn open() -> Result<(Router, u16), KernelError> {
    open_with_multicast().map(|(r, f, _)| (r, f))
}

fn open_with_multicast() -> Result<(Router, u16, Multicast), KernelError> {
    let (router, multicast) = NlRouter::connect(NlFamily::Generic, Some(0), Groups::empty())
        .map_err(|e| KernelError::Netlink { what: "socket", message: e.to_string() })?;
    let family = router.resolve_genl_family(FAMILY).map_err(|_| KernelError::NoDriver)?;
    Ok((router, family, multicast))
}

fn attr<P: neli::ToBytes + neli::Size>(t: u16, payload: P) -> Result<Nlattr<u16, Buffer>, KernelError> {
    let ser = |e: &dyn std::fmt::Display| KernelError::Netlink { what: "message", message: e.to_string() };
    NlattrBuilder::default()
        .nla_type(AttrTypeBuilder::default().nla_type(t).build().map_err(|e| ser(&e))?)
        .nla_payload(payload)
        .build()
        .map_err(|e| ser(&e))
}

fn nested(t: u16, inner: &[Nlattr<u16, Buffer>]) -> Result<Nlattr<u16, Buffer>, KernelError> {
    let mut a = attr(t, Vec::<u8>::new())?;
    for i in inner {
        a = a.nest(i).map_err(|e| KernelError::Netlink { what: "message", message: e.to_string() })?;
    }
    Ok(a)
}

/// Sends `cmd` with `attrs` and collects the replies' attributes.
fn call(
    what: &'static str,
    cmd: u8,
    attrs: Vec<Nlattr<u16, Buffer>>,
    on_errno: impl Fn(i32) -> Option<KernelError>,
) -> Result<Vec<Genlmsghdr<u8, u16>>, KernelError> {
    let (router, family) = open()?;
    let msg = GenlmsghdrBuilder::default()
        .cmd(cmd)
        .version(VERSION)
        .attrs(attrs.into_iter().collect::<GenlBuffer<u16, Buffer>>())
        .build()
        .map_err(|e| KernelError::Netlink { what, message: e.to_string() })?;
    let replies = router
        .send::<_, _, u16, Genlmsghdr<u8, u16>>(family, NlmF::ACK, NlPayload::Payload(msg))
        .map_err(|e| KernelError::Netlink { what, message: e.to_string() })?;
    let mut out = Vec::new();
    for r in replies {
        match r {
            Ok(m) => {
                if let NlPayload::Payload(p) = m.nl_payload() {
                    out.push(p.clone());
                }
            }
            Err(neli::err::RouterError::Nlmsgerr(e)) => {
                let errno = -*e.error();
                return Err(on_errno(errno).unwrap_or_else(|| match errno {
                    libc::EPERM | libc::EACCES => KernelError::Permission,
                    _ => KernelError::Netlink { what, message: std::io::Error::from_raw_os_error(errno).to_string() },
                }));
            }
            Err(e) => return Err(KernelError::Netlink { what, message: e.to_string() }),
        }
    }
    Ok(out)
}

/// Attaches `a.sockets` as an NBD device (`NBD_CMD_CONNECT`); returns its index `N`
/// (`/dev/nbdN`). The device is removed again when it is disconnected.
///
/// Errors: [`KernelError::NoDriver`], [`KernelError::Permission`],
/// [`KernelError::Busy`] (the device asked for is attached), [`KernelError::Netlink`]
/// (a refused configuration: bad size or block size, a socket that is not one).
pub fn connect(a: &Attach) -> Result<u32, KernelError> {
    let mut attrs = vec![
        attr(ATTR_SIZE_BYTES, a.size)?,
        attr(ATTR_BLOCK_SIZE_BYTES, a.block_size)?,
        attr(ATTR_SERVER_FLAGS, u64::from(a.server_flags))?,
        attr(ATTR_CLIENT_FLAGS, 0u64)?,
        attr(ATTR_TIMEOUT, 0u64)?,
        attr(ATTR_BACKEND_IDENTIFIER, a.backend.as_str())?,
    ];
    if let Some(i) = a.index {
        attrs.push(attr(ATTR_INDEX, i)?);
    }
    if let Some(t) = a.dead_conn_timeout {
        attrs.push(attr(ATTR_DEAD_CONN_TIMEOUT, t.min(MAX_DEAD_CONN_TIMEOUT).as_secs().max(1))?);
    }
    let mut items = Vec::new();
    for fd in &a.sockets {
        items.push(nested(SOCK_ITEM, &[attr(SOCK_FD, *fd as u32)?])?);
    }
    attrs.push(nested(ATTR_SOCKETS, &items)?);
    let shown = a.index.map(|i| i.to_string()).unwrap_or_else(|| "N".into());
    let asked = a.index.is_some();
    let replies = call("connect", CMD_CONNECT, attrs, |errno| match errno {
        libc::EBUSY => Some(KernelError::Busy(shown.clone())),
        libc::EINVAL if asked => Some(KernelError::Busy(shown.clone())),
        _ => None,
    })?;
    for r in &replies {
        let h = r.attrs().get_attr_handle();
        if let Ok(i) = h.get_attr_payload_as::<u32>(ATTR_INDEX) {
            return Ok(i);
        }
    }
    // The kernel attached the device but its answer (best effort) did not say which:
    // find it by its backend and detach it rather than leave it behind.
    if let Ok(devs) = status(a.index) {
        for d in devs.iter().filter(|d| d.connected && d.backend.as_deref() == Some(a.backend.as_str())) {
            let _ = disconnect(d.index);
        }
    }
    Err(KernelError::Netlink { what: "connect", message: "the kernel answered without the device's index".into() })
}

/// What to change on an attached device (`NBD_CMD_RECONFIGURE`).
#[derive(Debug, Clone)]
pub struct Reconfigure {
    /// `N` of `/dev/nbdN`.
    pub index: u32,
    /// The device's backend identifier as given at attach: the kernel refuses the
    /// change if it names another backend (drivers/block/nbd.c, `nbd_genl_reconfigure`).
    pub backend: String,
    /// Sockets in the transmission phase; each takes the place of one dead connection
    /// (the kernel drops any beyond the dead ones, and the caller may close them after).
    pub sockets: Vec<RawFd>,
    /// A new size in bytes, seen at once by the device (and its users, through a
    /// capacity change uevent).
    pub size: Option<u64>,
}

/// Reconfigures an attached device (`NBD_CMD_RECONFIGURE`): new sockets for dead
/// connections, a new size.
///
/// Errors: [`KernelError::OtherBackend`] when the device is attached to another backend
/// (or to none, or not attached at all: the kernel answers both with `EINVAL`);
/// [`KernelError::NoDevice`]; as [`connect`].
pub fn reconfigure(r: &Reconfigure) -> Result<(), KernelError> {
    let mut attrs = vec![attr(ATTR_INDEX, r.index)?, attr(ATTR_BACKEND_IDENTIFIER, r.backend.as_str())?];
    if let Some(size) = r.size {
        attrs.push(attr(ATTR_SIZE_BYTES, size)?);
    }
    if !r.sockets.is_empty() {
        let mut items = Vec::new();
        for fd in &r.sockets {
            items.push(nested(SOCK_ITEM, &[attr(SOCK_FD, *fd as u32)?])?);
        }
        attrs.push(nested(ATTR_SOCKETS, &items)?);
    }
    let index = r.index;
    call("reconfigure", CMD_RECONFIGURE, attrs, |errno| match errno {
        libc::EINVAL => Some(KernelError::OtherBackend(index)),
        libc::ENOENT => Some(KernelError::NoDevice(index.to_string())),
        _ => None,
    })
    .map(|_| ())
}

/// The kernel's `NBD_CMD_LINK_DEAD` messages: a connection of device `N` died (its
/// socket failed or timed out). Subscribed to the `nbd_mc_group` multicast group.
pub struct LinkDeadEvents {
    // Keeps the socket and its processing thread alive.
    _router: Router,
    multicast: Multicast,
}

impl LinkDeadEvents {
    /// Joins the multicast group.
    ///
    /// Errors: as [`connect`].
    pub fn subscribe() -> Result<LinkDeadEvents, KernelError> {
        let (router, _, multicast) = open_with_multicast()?;
        let group = router
            .resolve_nl_mcast_group(FAMILY, MCAST_GROUP)
            .map_err(|e| KernelError::Netlink { what: "multicast group", message: e.to_string() })?;
        router
            .add_mcast_membership(Groups::new_groups(&[group]))
            .map_err(|e| KernelError::Netlink { what: "multicast membership", message: e.to_string() })?;
        Ok(LinkDeadEvents { _router: router, multicast })
    }

    /// Blocks for the next link-dead message; returns the device's index.
    ///
    /// Errors: [`KernelError::Netlink`] when the socket fails (messages may have been
    /// lost, `ENOBUFS`): subscribe again and look at every device.
    pub fn wait(&mut self) -> Result<u32, KernelError> {
        loop {
            match self.multicast.next_typed::<u16, Genlmsghdr<u8, u16>>() {
                None => return Err(KernelError::Netlink { what: "multicast", message: "the socket closed".into() }),
                Some(Err(e)) => return Err(KernelError::Netlink { what: "multicast", message: e.to_string() }),
                Some(Ok(m)) => {
                    let NlPayload::Payload(p) = m.nl_payload() else { continue };
                    if *p.cmd() != CMD_LINK_DEAD {
                        continue;
                    }
                    if let Ok(i) = p.attrs().get_attr_handle().get_attr_payload_as::<u32>(ATTR_INDEX) {
                        return Ok(i);
                    }
                }
            }
        }
    }
}

/// Detaches `/dev/nbd{index}` (`NBD_CMD_DISCONNECT`): requests in flight end; the
/// device stays, free.
///
/// Errors: [`KernelError::NoDevice`] (no such device, or not attached); as
/// [`connect`].
pub fn disconnect(index: u32) -> Result<(), KernelError> {
    if !status(Some(index))?.iter().any(|d| d.connected) {
        return Err(KernelError::NoDevice(format!("{index} attached")));
    }
    call("disconnect", CMD_DISCONNECT, vec![attr(ATTR_INDEX, index)?], |errno| match errno {
        libc::ENOENT | libc::EINVAL => Some(KernelError::NoDevice(index.to_string())),
        _ => None,
    })
    .map(|_| ())
}

/// The NBD devices (`NBD_CMD_STATUS`), or only `index`; with each one's backend
/// identifier from `/sys/block/nbdN/backend`. A device counts as attached when the
/// kernel has a configuration for it and it has a receiving task (`/sys/block/nbdN/pid`):
/// a device merely held open (by udev, blkid) has a configuration but no task.
///
/// Errors: [`KernelError::NoDevice`] for an `index` the kernel does not know; as
/// [`connect`].
pub fn status(index: Option<u32>) -> Result<Vec<Device>, KernelError> {
    let attrs = match index {
        Some(i) => vec![attr(ATTR_INDEX, i)?],
        None => Vec::new(),
    };
    let shown = index.map(|i| i.to_string()).unwrap_or_default();
    let replies = call("status", CMD_STATUS, attrs, |errno| match errno {
        libc::ENOENT | libc::EINVAL => Some(KernelError::NoDevice(shown.clone())),
        _ => None,
    })?;
    let bad = |e: &dyn std::fmt::Display| KernelError::Netlink { what: "status", message: e.to_string() };
    let mut out = Vec::new();
    for r in &replies {
        let h = r.attrs().get_attr_handle();
        let Ok(list) = h.get_nested_attributes::<u16>(ATTR_DEVICE_LIST) else { continue };
        for item in list.iter() {
            if *item.nla_type().nla_type() != DEVICE_ITEM {
                continue;
            }
            let dev = item.get_attr_handle::<u16>().map_err(|e| bad(&e))?;
            let index: u32 = dev.get_attr_payload_as(DEVICE_INDEX).map_err(|e| bad(&e))?;
            let connected: u8 = dev.get_attr_payload_as(DEVICE_CONNECTED).unwrap_or(0);
            let backend = std::fs::read_to_string(format!("/sys/block/nbd{index}/backend"))
                .ok()
                .map(|s| s.trim_end().to_string())
                .filter(|s| !s.is_empty());
            let running = std::path::Path::new(&format!("/sys/block/nbd{index}/pid")).exists();
            out.push(Device { index, connected: connected != 0 && running, backend });
        }
    }
    if let (Some(i), true) = (index, out.is_empty()) {
        return Err(KernelError::NoDevice(i.to_string()));
    }
    out.sort_by_key(|d| d.index);
    Ok(out)
}
