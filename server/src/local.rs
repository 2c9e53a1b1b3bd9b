//! Volumes served as local block devices on the storage host, `/dev/ublkbN`, through
//! Linux's ublk driver (`volume attach-local`), beside NBD.
//!
//! Lives here: [`LocalDevices`], the host's devices by volume name, and (feature
//! `ublk`) the `ublk::Backend` implementation over [`VolumeExport`], so that a local
//! device goes through the same QoS limits, metrics and engine calls as an NBD
//! connection. Not here: the driver protocol (the `ublk` crate), the management calls
//! (mgmt.rs). Without the feature every attach answers that this build has no ublk.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use storage_engine::Pool;

use crate::exports::PoolRegistry;

/// The ublk target name of this server's devices.
#[cfg(feature = "ublk")]
const UBLK_TARGET: &str = "ferrovol";

/// Why a local attach or detach failed, for the management API to map.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// No volume or snapshot of that name.
    #[error("{0}")]
    NotFound(String),
    /// Attached already (attach), or not attached (detach).
    #[error("{0}")]
    Exists(String),
    /// Being attached or deleted by another call: retry.
    #[error("{0}")]
    Busy(String),
    /// This build, this kernel or this process cannot make ublk devices.
    #[error("{0}")]
    Unavailable(String),
    /// The driver failed.
    #[error("{0}")]
    Failed(String),
}

/// A volume's local device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalDevice {
    /// The volume (or snapshot, `VOLUME@SNAPSHOT`).
    pub name: String,
    /// `/dev/ublkbN`.
    pub path: String,
    /// Writes are refused (a snapshot).
    pub read_only: bool,
}

struct Attached {
    info: LocalDevice,
    /// The node it was made for (AttachLocal's node_id), which unpublishing the
    /// volume from removes it ([`LocalDevices::detach_for`]).
    node: Option<String>,
    #[cfg(feature = "ublk")]
    device: ublk::Device,
}

/// A volume's place in the table: its device, or one being added (the driver starts
/// it without the table's lock held, as that takes a while).
#[cfg_attr(not(feature = "ublk"), allow(dead_code))]
enum Slot {
    Starting,
    /// The volume is being deleted: no attach may start.
    Deleting,
    Attached(Attached),
}

#[derive(Default)]
struct Table {
    devices: BTreeMap<String, Slot>,
    /// The host is stopping: an attach still starting removes its device again.
    closed: bool,
}

/// The host's local devices, by volume name; at most one per volume.
pub struct LocalDevices {
    /// Exports the devices' volumes as NBD connections get them.
    registry: Option<Arc<PoolRegistry>>,
    /// The data-plane runtimes the devices' requests run on.
    #[cfg_attr(not(feature = "ublk"), allow(dead_code))]
    runtimes: Vec<tokio::runtime::Handle>,
    /// Held to read or change the table and through a resize's driver command (quick),
    /// never while a device starts or stops.
    table: Mutex<Table>,
}

impl LocalDevices {
    /// Devices served from `registry`'s volumes on `runtimes`.
    /// Deletes first the devices a server killed before left behind
    /// ([`ublk::remove_stale`]).
    pub fn new(registry: Arc<PoolRegistry>, runtimes: Vec<tokio::runtime::Handle>) -> LocalDevices {
        #[cfg(feature = "ublk")]
        for id in ublk::remove_stale(UBLK_TARGET) {
            tracing::info!(device = format!("/dev/ublkb{id}"), "deleted a local device a killed server left behind");
        }
        LocalDevices { registry: Some(registry), runtimes, table: Mutex::default() }
    }

    /// No local devices (a management service without a data plane: tests, fuzzing).
    pub fn none() -> LocalDevices {
        LocalDevices { registry: None, runtimes: Vec::new(), table: Mutex::default() }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device of volume `name`, if it has one (not while it is being added).
    pub fn get(&self, name: &str) -> Option<LocalDevice> {
        match self.table().devices.get(name) {
            Some(Slot::Attached(a)) => Some(a.info.clone()),
            _ => None,
        }
    }

    /// Whether volume `name` has a device, or one being added.
    pub fn holds(&self, name: &str) -> bool {
        self.table().devices.contains_key(name)
    }

    /// Exposes volume `name` of `pool` as `/dev/ublkbN` (a snapshot read-only), for
    /// node `node` if given (removed when the volume is unpublished from it,
    /// [`Self::detach_for`]). Blocks while the driver starts the device: call it off
    /// the async runtimes.
    ///
    /// Errors: [`LocalError::NotFound`], [`LocalError::Exists`] when it has a device
    /// already (or one being added), [`LocalError::Unavailable`] without ublk (this
    /// build, the kernel, or the rights) or once the host is stopping,
    /// [`LocalError::Failed`].
    pub fn attach(&self, pool: &Pool, name: &str, node: Option<&str>) -> Result<LocalDevice, LocalError> {
        let Some(registry) = &self.registry else {
            return Err(LocalError::Unavailable("this service has no data plane to serve a device from".into()));
        };
        #[cfg(not(feature = "ublk"))]
        {
            let vol = pool.volume(name).map_err(|e| LocalError::NotFound(e.to_string()))?;
            let _ = (registry, vol, node);
            Err(LocalError::Unavailable(
                "this ferrovol was built without ublk (cargo build --features ublk, which needs libclang)".into(),
            ))
        }
        #[cfg(feature = "ublk")]
        {
            {
                let mut t = self.table();
                if t.closed {
                    return Err(LocalError::Unavailable("the server is stopping".into()));
                }
                match t.devices.get(name) {
                    Some(Slot::Attached(a)) => {
                        let m = format!("volume '{name}' is attached locally already, as {}", a.info.path);
                        return Err(LocalError::Exists(m));
                    }
                    Some(Slot::Starting) => {
                        return Err(LocalError::Busy(format!("volume '{name}' is being attached locally")));
                    }
                    Some(Slot::Deleting) => {
                        return Err(LocalError::Busy(format!("volume '{name}' is being deleted")));
                    }
                    None => {}
                }
                t.devices.insert(name.to_owned(), Slot::Starting);
            }
            // Looked up with its place held: a delete waits for the attach, or the
            // attach for the delete (`reserve`).
            let vol = match pool.volume(name) {
                Ok(v) => v,
                Err(e) => {
                    self.table().devices.remove(name);
                    return Err(LocalError::NotFound(e.to_string()));
                }
            };
            let read_only = vol.is_snapshot();
            let export = registry.export(vol, read_only, None);
            let opts = ublk::Options {
                name: UBLK_TARGET.to_owned(),
                queues: u16::try_from(self.runtimes.len().clamp(1, 32)).unwrap_or(1),
                read_only,
                ..Default::default()
            };
            // The device's requests enter the volume's export as an NBD request does.
            let added = ublk::Device::add(Arc::new(Local(export)), self.runtimes.clone(), &opts);
            let mut t = self.table();
            let device = match added {
                Ok(d) if !t.closed => d,
                Ok(d) => {
                    t.devices.remove(name);
                    drop(t);
                    d.remove();
                    return Err(LocalError::Unavailable("the server is stopping".into()));
                }
                Err(e) => {
                    t.devices.remove(name);
                    return Err(match e {
                        ublk::Error::NotSupported | ublk::Error::Denied(_) => LocalError::Unavailable(e.to_string()),
                        ublk::Error::Invalid(_) | ublk::Error::Driver(_) | ublk::Error::NoOnlineResize => {
                            LocalError::Failed(e.to_string())
                        }
                    });
                }
            };
            let info = LocalDevice { name: name.to_owned(), path: device.path().display().to_string(), read_only };
            tracing::info!(volume = name, device = info.path, read_only, "attached locally");
            let node = node.map(str::to_owned);
            t.devices.insert(name.to_owned(), Slot::Attached(Attached { info: info.clone(), node, device }));
            Ok(info)
        }
    }

    /// After volume `name` was resized to `size` bytes: its device, if it has one,
    /// takes the new size online where the kernel allows it (Linux 6.16); elsewhere
    /// it keeps the old one until attached again, which the log says. Blocks on the
    /// driver: call it off the async runtimes.
    pub fn resized(&self, name: &str, size: u64) {
        let t = self.table();
        let Some(Slot::Attached(a)) = t.devices.get(name) else { return };
        #[cfg(feature = "ublk")]
        match a.device.set_size(size) {
            Ok(()) => tracing::info!(volume = name, device = a.info.path, size, "local device resized"),
            Err(e) => tracing::warn!(
                volume = name,
                device = a.info.path,
                error = %e,
                "the local device keeps its old size until it is detached and attached again"
            ),
        }
        #[cfg(not(feature = "ublk"))]
        let _ = (a, size);
    }

    /// Removes volume `name`'s device: requests in flight in the kernel fail, and a
    /// file system still mounted on it sees I/O errors.
    ///
    /// Errors: [`LocalError::Exists`] when it has none (or it is being added).
    pub fn detach(&self, name: &str) -> Result<LocalDevice, LocalError> {
        let a = {
            let mut t = self.table();
            match t.devices.remove(name) {
                Some(Slot::Attached(a)) => a,
                Some(other @ (Slot::Starting | Slot::Deleting)) => {
                    t.devices.insert(name.to_owned(), other);
                    return Err(LocalError::Busy(format!("volume '{name}' is being attached locally or deleted")));
                }
                None => return Err(LocalError::Exists(format!("volume '{name}' is not attached locally"))),
            }
        };
        #[cfg(feature = "ublk")]
        a.device.remove();
        tracing::info!(volume = name, device = a.info.path, "detached locally");
        Ok(a.info)
    }

    /// Removes volume `name`'s device if it was made for node `node` (the volume is
    /// unpublished from that node: fencing, as its NBD connections are closed); the
    /// device removed, if any.
    pub fn detach_for(&self, name: &str, node: &str) -> Option<LocalDevice> {
        let a = {
            let mut t = self.table();
            if !matches!(t.devices.get(name), Some(Slot::Attached(a)) if a.node.as_deref() == Some(node)) {
                return None;
            }
            let Some(Slot::Attached(a)) = t.devices.remove(name) else { return None };
            a
        };
        #[cfg(feature = "ublk")]
        a.device.remove();
        tracing::info!(volume = name, device = a.info.path, node, "detached locally: unpublished from the node");
        Some(a.info)
    }

    /// Holds volume (or snapshot) `name`'s place while it is deleted, so that no attach
    /// starts meanwhile; released when the guard drops.
    ///
    /// Errors: [`LocalError::Exists`] when it has a device, [`LocalError::Busy`] when
    /// one is being added or another delete holds it.
    pub fn reserve(&self, name: &str) -> Result<Reserved<'_>, LocalError> {
        let mut t = self.table();
        match t.devices.get(name) {
            Some(Slot::Attached(a)) => Err(LocalError::Exists(format!(
                "'{name}' is attached locally as {}: detach it first (DetachLocal)",
                a.info.path
            ))),
            Some(Slot::Starting | Slot::Deleting) => {
                Err(LocalError::Busy(format!("'{name}' is being attached locally or deleted")))
            }
            None => {
                t.devices.insert(name.to_owned(), Slot::Deleting);
                Ok(Reserved { devices: self, name: name.to_owned() })
            }
        }
    }

    /// Removes every device (the host is stopping, before its data plane does); an
    /// attach still starting removes its own when it ends.
    pub fn remove_all(&self) {
        let all = {
            let mut t = self.table();
            t.closed = true;
            std::mem::take(&mut t.devices)
        };
        for (name, slot) in all {
            if let Slot::Attached(a) = slot {
                #[cfg(feature = "ublk")]
                a.device.remove();
                tracing::info!(volume = name, device = a.info.path, "detached locally: the server is stopping");
            }
        }
    }
}

/// A volume's place held through its delete ([`LocalDevices::reserve`]).
pub struct Reserved<'a> {
    devices: &'a LocalDevices,
    name: String,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut t = self.devices.table();
        if matches!(t.devices.get(&self.name), Some(Slot::Deleting)) {
            t.devices.remove(&self.name);
        }
    }
}

/// A volume's export as a ublk backend.
#[cfg(feature = "ublk")]
struct Local(Arc<crate::exports::VolumeExport>);

#[cfg(feature = "ublk")]
impl ublk::Backend for Local {
    type Buf = storage_engine::AlignedBuf;

    fn size(&self) -> u64 {
        nbd::Export::size(&*self.0)
    }

    fn alloc_buf(&self, offset: u64, len: usize) -> storage_engine::AlignedBuf {
        nbd::Export::alloc_write_buf(&*self.0, offset, len as u32)
    }

    async fn read(&self, offset: u64, len: u32) -> Result<storage_engine::AlignedBuf, i32> {
        nbd::Export::read(&*self.0, offset, len).await.map(|r| r.data).map_err(errno)
    }

    async fn write(&self, offset: u64, buf: storage_engine::AlignedBuf, fua: bool) -> Result<(), i32> {
        nbd::Export::write(&*self.0, offset, buf, fua).await.map_err(errno)
    }

    async fn flush(&self) -> Result<(), i32> {
        nbd::Export::flush(&*self.0).await.map_err(errno)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), i32> {
        nbd::Export::trim(&*self.0, offset, len, false).await.map_err(errno)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool, fua: bool) -> Result<(), i32> {
        nbd::Export::write_zeroes(&*self.0, offset, len, may_unmap, false, fua).await.map_err(errno)
    }
}

/// NBD's errno values are Linux's.
#[cfg(feature = "ublk")]
fn errno(e: nbd::Errno) -> i32 {
    e.wire_value() as i32
}
