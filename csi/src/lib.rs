//! ferrovol's CSI driver (Container Storage Interface, spec v1.12.0): the `csi.v1`
//! protocol generated from `proto/csi.proto`, the Identity service, and the Controller
//! service, which places volumes on the storage hosts of its configuration and talks to
//! them only through their management API (`mgmt-api`).
//!
//! The Node service ([`node`]) attaches published volumes through the kernel's NBD
//! client ([`nbd::attach`]), formats and mounts them ([`mounter`]). Not here: the
//! storage engine and the NBD server (neither service links them).
//! gRPC types stay at the edge: [`controller`] turns each request into calls on
//! [`hosts::Hosts`] and maps one error type, [`CsiError`], to a status once.

pub mod config;
pub mod controller;
mod error;
pub mod hosts;
pub mod identity;
pub mod ids;
mod inflight;
pub mod local;
pub mod mounter;
pub mod node;
pub mod serve;

pub use error::CsiError;

/// The generated `csi.v1` messages, clients and servers (prost and tonic).
///
/// Messages with a `csi_secret` field print it as `<redacted: N entries>` in `Debug`
/// (spec.md "Secrets Requirements").
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("csi.v1");
    include!(concat!(env!("OUT_DIR"), "/csi_redacted_debug.rs"));
}

/// The name this driver registers under (spec.md GetPluginInfo `name`).
pub const DRIVER_NAME: &str = "csi.ferrovol.io";

/// The topology key of a storage host's zone (spec.md "Topology").
pub const ZONE_KEY: &str = "topology.ferrovol.io/zone";

/// The topology of one zone: the single segment [`ZONE_KEY`] = `zone`.
pub fn zone_topology(zone: &str) -> pb::Topology {
    pb::Topology { segments: [(ZONE_KEY.to_string(), zone.to_string())].into_iter().collect() }
}

/// The topology key of one storage host, by its configured name.
pub const HOST_KEY: &str = "topology.ferrovol.io/host";

#[cfg(test)]
mod tests {
    #[test]
    fn secrets_never_show_in_debug() {
        let mut r = crate::pb::CreateVolumeRequest { name: "pvc-1".into(), ..Default::default() };
        r.secrets.insert("password".into(), "hunter2".into());
        let shown = format!("{r:?}");
        assert!(shown.contains("pvc-1") && shown.contains("<redacted: 1 entries>"), "{shown}");
        assert!(!shown.contains("hunter2") && !shown.contains("password"), "{shown}");
        let mut s = crate::pb::NodeStageVolumeRequest::default();
        s.secrets.insert("key".into(), "s3cr3t".into());
        assert!(!format!("{s:?}").contains("s3cr3t"));
    }
}
