//! The management API's server side: the `Management` service of the `mgmt-api` crate
//! (gRPC, proto/ferrovol.proto there) implemented over a [`Pool`].
//!
//! Lives here: [`ManagementService`] and the conversion of engine types to the API's.
//! Not here: the protocol and its client (`mgmt-api`), listening (host.rs), the engine.

use mgmt_api::pb;
use pb::management_server::{Management, ManagementServer};
use storage_engine::{Pool, VolumeInfo};
use tonic::{Request, Response, Status};

use crate::errors::grpc_status;

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
