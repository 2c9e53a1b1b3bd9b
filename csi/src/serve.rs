//! Serving the CSI services on a CSI endpoint: `unix:///PATH` (what the Kubernetes
//! sidecars use) or `tcp://HOST:PORT` (for trying things by hand).

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::Config;
use crate::controller::Controller;
use crate::hosts::Hosts;
use crate::identity::Identity;
use crate::node::Node;
use crate::pb;

/// Where the services listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A unix socket (any stale socket file there is replaced).
    Unix(PathBuf),
    /// A TCP address, `HOST:PORT`.
    Tcp(String),
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    /// Parses `unix:///PATH`, `unix:/PATH`, `/PATH` or `tcp://HOST:PORT`.
    fn from_str(s: &str) -> Result<Endpoint, String> {
        if let Some(p) = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")) {
            let p = if p.starts_with("//") { &p[1..] } else { p };
            if !p.starts_with('/') {
                return Err(format!("{s:?}: a unix endpoint is unix:///ABSOLUTE/PATH"));
            }
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        if s.starts_with('/') {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        if let Some(a) = s.strip_prefix("tcp://") {
            if a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) {
                return Ok(Endpoint::Tcp(a.to_string()));
            }
        }
        Err(format!("{s:?} is not a CSI endpoint: unix:///PATH or tcp://HOST:PORT"))
    }
}

/// Serves Identity, Controller, GroupController and SnapshotMetadata over the hosts of `config` on `endpoint` until
/// `shutdown` resolves; calls in flight then have up to
/// [`mgmt_api::drain::DRAIN_LIMIT`] to finish, and a unix socket's file is removed.
///
/// Errors: the endpoint cannot be bound (its directory missing, the address taken).
pub async fn serve_controller(
    config: &Config,
    endpoint: &Endpoint,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let hosts = Arc::new(Hosts::new(config));
    let controller = Controller::new(hosts.clone());
    let router = tonic::transport::Server::builder()
        .add_service(pb::identity_server::IdentityServer::new(Identity::new(hosts)))
        .add_service(pb::controller_server::ControllerServer::new(controller.clone()))
        .add_service(pb::group_controller_server::GroupControllerServer::new(controller.clone()))
        .add_service(pb::snapshot_metadata_server::SnapshotMetadataServer::new(controller));
    serve(router, endpoint, shutdown, &format!("CSI controller over {} storage hosts", config.hosts.len())).await
}

/// Serves Identity and Node for `node` on `endpoint` until `shutdown` resolves.
///
/// Errors: as [`serve_controller`].
pub async fn serve_node(
    node: Node,
    endpoint: &Endpoint,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let what = format!("CSI node {}", node.node_id());
    let router = tonic::transport::Server::builder()
        .add_service(pb::identity_server::IdentityServer::new(NodeIdentity))
        .add_service(pb::node_server::NodeServer::new(node));
    serve(router, endpoint, shutdown, &what).await
}

/// The Identity service of a node plugin: no controller capabilities; always ready.
#[derive(Debug, Clone, Copy)]
struct NodeIdentity;

#[tonic::async_trait]
impl pb::identity_server::Identity for NodeIdentity {
    async fn get_plugin_info(
        &self,
        _req: tonic::Request<pb::GetPluginInfoRequest>,
    ) -> Result<tonic::Response<pb::GetPluginInfoResponse>, tonic::Status> {
        Ok(tonic::Response::new(crate::identity::plugin_info()))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: tonic::Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<tonic::Response<pb::GetPluginCapabilitiesResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::GetPluginCapabilitiesResponse { capabilities: Vec::new() }))
    }

    async fn probe(
        &self,
        _req: tonic::Request<pb::ProbeRequest>,
    ) -> Result<tonic::Response<pb::ProbeResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::ProbeResponse { ready: Some(true) }))
    }
}

async fn serve(
    router: tonic::transport::server::Router,
    endpoint: &Endpoint,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    what: &str,
) -> std::io::Result<()> {
    use mgmt_api::drain::{serve_with_drain_limit, Stopped, DRAIN_LIMIT};
    let stopped = match endpoint {
        Endpoint::Unix(path) => {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(std::io::Error::new(e.kind(), format!("remove the old socket {}: {e}", path.display())))
                }
            }
            let l = tokio::net::UnixListener::bind(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("bind {}: {e}", path.display())))?;
            tracing::info!(endpoint = %path.display(), "{what} serving");
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(l);
            let served = serve_with_drain_limit(shutdown, DRAIN_LIMIT, |stop| {
                router.serve_with_incoming_shutdown(incoming, stop)
            })
            .await;
            // A clean stop leaves no socket behind for a client to find dead.
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(endpoint = %path.display(), error = %e, "could not remove the socket");
            }
            served
        }
        Endpoint::Tcp(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| std::io::Error::new(e.kind(), format!("bind {addr}: {e}")))?;
            tracing::info!(endpoint = %addr, "{what} serving");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
            serve_with_drain_limit(shutdown, DRAIN_LIMIT, |stop| router.serve_with_incoming_shutdown(incoming, stop))
                .await
        }
    }
    .map_err(std::io::Error::other)?;
    if stopped == Stopped::LimitReached {
        tracing::warn!(limit = ?DRAIN_LIMIT, "{what}: connections still open at the end of the drain; closed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!("unix:///csi/csi.sock".parse(), Ok(Endpoint::Unix("/csi/csi.sock".into())));
        assert_eq!("unix:/csi/csi.sock".parse(), Ok(Endpoint::Unix("/csi/csi.sock".into())));
        assert_eq!("/csi/csi.sock".parse(), Ok(Endpoint::Unix("/csi/csi.sock".into())));
        assert_eq!("tcp://127.0.0.1:10000".parse(), Ok(Endpoint::Tcp("127.0.0.1:10000".into())));
        for bad in ["unix://csi.sock", "127.0.0.1:1", "tcp://x", "http://a:1"] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }
}
