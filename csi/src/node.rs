//! The CSI Node service (spec.md "Node Service RPC"), so far only who the node is:
//! NodeGetInfo (its node ID, `ferrovol:NODE-NAME`, and its zone) and
//! NodeGetCapabilities (none yet); unstage and unpublish of paths where nothing is
//! mounted (idempotent cleanup). Attaching over NBD, formatting, mounting and expanding
//! come with the node's attach path; until then those calls answer UNIMPLEMENTED.

use tonic::{Request, Response, Status};

use crate::controller::NODE_ID_PREFIX;
use crate::pb;

/// The Node service of one node.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its Kubernetes node name.
    pub name: String,
    /// Its zone ([`crate::ZONE_KEY`]), if the cluster has zones.
    pub zone: Option<String>,
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
        Ok(Node { name, zone })
    }

    /// The node ID this node reports: [`NODE_ID_PREFIX`] and its name.
    pub fn node_id(&self) -> String {
        format!("{NODE_ID_PREFIX}{}", self.name)
    }
}

/// Checks the arguments of an unstage or unpublish, and that nothing is mounted at
/// `path` (this plugin mounts nothing yet, so whatever is there is not its own).
///
/// Errors: INVALID_ARGUMENT for a missing volume ID or path; FAILED_PRECONDITION when
/// something is mounted there.
fn nothing_mounted(volume_id: &str, what: &str, path: &str) -> Result<(), Status> {
    if volume_id.is_empty() {
        return Err(Status::invalid_argument("volume_id is missing"));
    }
    if path.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is missing")));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // mountinfo's fifth field is the mount point (spaces written as \040).
    let shown = path.trim_end_matches('/').replace(' ', "\\040");
    if mounts.lines().any(|l| l.split(' ').nth(4) == Some(shown.as_str())) {
        return Err(Status::failed_precondition(format!(
            "{path} is a mount point, and this node plugin unmounts nothing yet"
        )));
    }
    Ok(())
}

fn not_yet(call: &str) -> Status {
    Status::unimplemented(format!("{call}: this node plugin does not attach volumes yet"))
}

#[tonic::async_trait]
impl pb::node_server::Node for Node {
    async fn node_stage_volume(
        &self,
        _r: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        Err(not_yet("NodeStageVolume"))
    }

    /// Nothing this plugin staged can be there yet: OK when nothing is mounted at the
    /// staging path (spec.md NodeUnstageVolume is idempotent).
    async fn node_unstage_volume(
        &self,
        r: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        let r = r.into_inner();
        nothing_mounted(&r.volume_id, "staging_target_path", &r.staging_target_path)?;
        Ok(Response::new(pb::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        _r: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        Err(not_yet("NodePublishVolume"))
    }

    /// As [`Node::node_unstage_volume`], for the target path.
    async fn node_unpublish_volume(
        &self,
        r: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        nothing_mounted(&r.volume_id, "target_path", &r.target_path)?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _r: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        Err(not_yet("NodeGetVolumeStats"))
    }

    async fn node_expand_volume(
        &self,
        _r: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        Err(not_yet("NodeExpandVolume"))
    }

    async fn node_get_capabilities(
        &self,
        _r: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(pb::NodeGetCapabilitiesResponse { capabilities: Vec::new() }))
    }

    async fn node_get_info(
        &self,
        _r: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        let accessible_topology = self.zone.as_deref().map(crate::zone_topology);
        Ok(Response::new(pb::NodeGetInfoResponse {
            node_id: self.node_id(),
            max_volumes_per_node: 0,
            accessible_topology,
        }))
    }
}
