//! The management API: gRPC (tonic) on a unix socket, the server's public control
//! surface (proto/ferrovol.proto). Used by the `ferrovol volume ...` CLI and, later,
//! by the CSI controller.
//!
//! Lives here: the service implementation over a [`Pool`], and [`connect`], a client
//! over the unix socket. Not here: argument parsing (main.rs), the engine.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use storage_engine::{Pool, VolumeInfo};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

use crate::errors::grpc_status;

/// Generated protobuf and gRPC code for package `ferrovol.v1`.
pub mod pb {
    tonic::include_proto!("ferrovol.v1");
}

use pb::management_server::{Management, ManagementServer};

/// The management service over one pool.
pub struct ManagementService {
    pool: Pool,
    endpoints: Vec<String>,
}

impl ManagementService {
    /// A gRPC server for `pool`; `endpoints` are the NBD URIs reported by GetPoolStatus.
    pub fn new(pool: Pool, endpoints: Vec<String>) -> ManagementServer<ManagementService> {
        ManagementServer::new(ManagementService::service(pool, endpoints))
    }

    /// The service itself, to call its methods in-process.
    pub fn service(pool: Pool, endpoints: Vec<String>) -> ManagementService {
        ManagementService { pool, endpoints }
    }
}

fn volume(v: VolumeInfo) -> pb::Volume {
    pb::Volume {
        export_name: v.name.clone(),
        name: v.name,
        id: v.id,
        size_bytes: v.size,
        allocated_bytes: v.allocated,
        created_unix: v.created,
        snapshot: v.snapshot,
        exclusive_bytes: v.exclusive,
        shared_bytes: v.shared,
    }
}

#[tonic::async_trait]
impl Management for ManagementService {
    async fn create_volume(&self, req: Request<pb::CreateVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        let v = self.pool.create_volume(&r.name, r.size_bytes).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(volume(v)))
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        self.pool.delete_volume(&req.into_inner().name).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(pb::DeleteVolumeResponse {}))
    }

    async fn resize_volume(&self, req: Request<pb::ResizeVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        let v = self.pool.resize_volume(&r.name, r.size_bytes).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(volume(v)))
    }

    async fn get_volume(&self, req: Request<pb::GetVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let v = self.pool.volume_info(&req.into_inner().name).map_err(|e| grpc_status(&e))?;
        Ok(Response::new(volume(v)))
    }

    async fn list_volumes(
        &self,
        _req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let volumes = self.pool.list_volumes().into_iter().map(volume).collect();
        Ok(Response::new(pb::ListVolumesResponse { volumes }))
    }

    async fn create_snapshot(&self, req: Request<pb::CreateSnapshotRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        let v = self.pool.create_snapshot(&r.volume, &r.snapshot).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(volume(v)))
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        self.pool.delete_snapshot(&r.volume, &r.snapshot).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(pb::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let vol = (!r.volume.is_empty()).then_some(r.volume.as_str());
        let snapshots: Vec<_> = self.pool.list_snapshots(vol).into_iter().map(volume).collect();
        // A deleted volume's snapshots stay listed under its name; a name that has
        // neither a volume nor snapshots is a mistake worth saying so.
        if let Some(v) = vol {
            if snapshots.is_empty() && self.pool.volume(v).is_err() {
                return Err(Status::not_found(format!("no volume and no snapshots named '{v}'")));
            }
        }
        Ok(Response::new(pb::ListSnapshotsResponse { snapshots }))
    }

    async fn clone_volume(&self, req: Request<pb::CloneVolumeRequest>) -> Result<Response<pb::Volume>, Status> {
        let r = req.into_inner();
        let v = self.pool.clone_volume(&r.source, &r.name).await.map_err(|e| grpc_status(&e))?;
        Ok(Response::new(volume(v)))
    }

    async fn diff_snapshots(
        &self,
        req: Request<pb::DiffSnapshotsRequest>,
    ) -> Result<Response<pb::DiffSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let ranges = self.pool.diff(&r.from, &r.to).map_err(|e| grpc_status(&e))?;
        let ranges = ranges.into_iter().map(|(offset, length)| pb::ByteRange { offset, length }).collect();
        Ok(Response::new(pb::DiffSnapshotsResponse { ranges }))
    }

    async fn get_pool_status(
        &self,
        _req: Request<pb::GetPoolStatusRequest>,
    ) -> Result<Response<pb::PoolStatus>, Status> {
        let s = self.pool.status();
        Ok(Response::new(pb::PoolStatus {
            uuid: s.uuid,
            path: s.path.display().to_string(),
            capacity_bytes: s.capacity,
            used_bytes: s.used,
            metadata_bytes: s.metadata,
            free_bytes: s.free,
            unit_size_bytes: s.unit_size,
            volume_count: s.volumes,
            direct_io: s.direct_io,
            failed: s.failed,
            nbd_endpoints: self.endpoints.clone(),
            reserved_bytes: s.reserved,
        }))
    }
}

/// A client connected to the management socket at `path`.
///
/// Errors: the socket does not exist or nobody listens (is `ferrovol serve` running
/// with this data dir?).
pub async fn connect(path: &Path) -> anyhow::Result<pb::management_client::ManagementClient<Channel>> {
    if !path.exists() {
        anyhow::bail!(
            "no management socket at {} (is `ferrovol serve` running with this --data-dir or --socket?)",
            path.display()
        );
    }
    let path_shown = path.display().to_string();
    let path: PathBuf = path.to_owned();
    let channel = Endpoint::try_from("http://ferrovol.invalid")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| {
            // The innermost cause only: the layers above it repeat it.
            let mut cause: &dyn std::error::Error = &e;
            while let Some(inner) = cause.source() {
                cause = inner;
            }
            anyhow::anyhow!(
                "cannot connect to the management socket {path_shown}: {cause} (is `ferrovol serve` running with \
                 this --data-dir or --socket? A server that is stopping no longer takes calls, and one that was \
                 killed leaves its socket behind)"
            )
        })?;
    // Replies are not paged: a listing of tens of thousands of volumes, or the diff of
    // a fragmented volume, passes gRPC's default limit of 4 MiB per message.
    Ok(pb::management_client::ManagementClient::new(channel).max_decoding_message_size(MAX_REPLY_BYTES))
}

/// The largest management reply [`connect`]'s client accepts, in bytes: about four
/// million volumes in a listing, or a hundred million ranges in a diff.
pub const MAX_REPLY_BYTES: usize = 1 << 30;
