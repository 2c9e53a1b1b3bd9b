//! The CSI Identity service (spec.md "Identity Service RPC"): the driver's name and
//! version, its plugin capabilities, and Probe, ready when a storage host answers.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::hosts::Hosts;
use crate::pb;

/// How long Probe waits for the storage hosts.
pub const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(800);

/// The Identity service of the controller.
#[derive(Clone)]
pub struct Identity {
    hosts: Arc<Hosts>,
}

impl Identity {
    /// The Identity service over `hosts` (Probe asks them).
    pub fn new(hosts: Arc<Hosts>) -> Identity {
        Identity { hosts }
    }
}

/// GetPluginInfo's answer: [`crate::DRIVER_NAME`] and this crate's version.
pub fn plugin_info() -> pb::GetPluginInfoResponse {
    pb::GetPluginInfoResponse {
        name: crate::DRIVER_NAME.into(),
        vendor_version: env!("CARGO_PKG_VERSION").into(),
        manifest: Default::default(),
    }
}

#[tonic::async_trait]
impl pb::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _req: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(plugin_info()))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        use pb::plugin_capability::{service, volume_expansion, Service, Type, VolumeExpansion};
        let service =
            |t: service::Type| pb::PluginCapability { r#type: Some(Type::Service(Service { r#type: t as i32 })) };
        let mut capabilities = vec![
            service(service::Type::ControllerService),
            service(service::Type::GroupControllerService),
            service(service::Type::SnapshotMetadataService),
        ];
        // Topology only when the hosts have zones: a volume then names its zone, which
        // the nodes must report too (`ferrovol csi node --zone`).
        if self.hosts.all().iter().any(|h| h.config.zone.is_some()) {
            capabilities.push(service(service::Type::VolumeAccessibilityConstraints));
        }
        capabilities.extend([pb::PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion { r#type: volume_expansion::Type::Online as i32 })),
        }]);
        Ok(Response::new(pb::GetPluginCapabilitiesResponse { capabilities }))
    }

    /// Ready whenever it answers: the controller serves with no host reachable (calls on
    /// their volumes are UNAVAILABLE, and the sidecars retry them), and a liveness probe
    /// that restarted it for an unreachable host would only lose its memory of recent
    /// creates. Each host that does not answer is logged.
    async fn probe(&self, _req: Request<pb::ProbeRequest>) -> Result<Response<pb::ProbeResponse>, Status> {
        for s in self.hosts.survey().await {
            if let Err(e) = s.answer {
                tracing::warn!(host = s.host.name(), error = %e.message, "Probe: storage host does not answer");
            }
        }
        let ready = true;
        Ok(Response::new(pb::ProbeResponse { ready: Some(ready) }))
    }
}
