//! Fuzz target body for the management API: arbitrary protobuf requests against the
//! service over a live pool (used by `fuzz/` and by the corpus replay test).
//!
//! Lives here: [`management`]. Not here: the service itself ([`crate::mgmt`]).

use std::sync::OnceLock;

use prost::Message;
use storage_engine::{Pool, PoolOptions};
use tonic::Request;

use crate::mgmt::ManagementService;
use mgmt_api::pb;
use pb::management_server::Management;

struct Fixture {
    rt: tokio::runtime::Runtime,
    service: ManagementService,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ferrovol-fuzz-mgmt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("fuzz dir");
        let pool = Pool::create(
            &dir.join("pool.img"),
            &PoolOptions { size: 64 << 20, unit_size: 16 * 1024, ..Default::default() },
        )
        .expect("fuzz pool");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(pool.create_volume("v", 1 << 20)).expect("volume");
        Fixture { rt, service: ManagementService::service(pool, crate::mgmt::HostIdentity::detached()) }
    })
}

/// Fuzz target body: `data` is a sequence of requests, each a selector byte (which RPC),
/// a length byte, and that many bytes decoded as the RPC's protobuf request (skipped if
/// they do not decode). Every request is answered with a response or a status; a panic
/// is a bug. The pool persists across calls (state builds up, as on a real server).
pub fn management(data: &[u8]) {
    let f = fixture();
    let s = &f.service;
    let mut rest = data;
    while rest.len() >= 2 {
        let (sel, len) = (rest[0], usize::from(rest[1]));
        let body = &rest[2..(2 + len).min(rest.len())];
        rest = &rest[(2 + len).min(rest.len())..];
        f.rt.block_on(async {
            macro_rules! call {
                ($method:ident, $ty:ty) => {
                    if let Ok(m) = <$ty>::decode(body) {
                        let _ = s.$method(Request::new(m)).await;
                    }
                };
            }
            match sel % 16 {
                0 => call!(create_volume, pb::CreateVolumeRequest),
                1 => call!(delete_volume, pb::DeleteVolumeRequest),
                2 => call!(resize_volume, pb::ResizeVolumeRequest),
                3 => call!(get_volume, pb::GetVolumeRequest),
                4 => call!(list_volumes, pb::ListVolumesRequest),
                5 => call!(create_snapshot, pb::CreateSnapshotRequest),
                6 => call!(delete_snapshot, pb::DeleteSnapshotRequest),
                7 => call!(list_snapshots, pb::ListSnapshotsRequest),
                8 => call!(clone_volume, pb::CloneVolumeRequest),
                9 => call!(diff_snapshots, pb::DiffSnapshotsRequest),
                10 => call!(get_pool_status, pb::GetPoolStatusRequest),
                11 => call!(publish_volume, pb::PublishVolumeRequest),
                12 => call!(unpublish_volume, pb::UnpublishVolumeRequest),
                13 => call!(set_volume_qos, pb::SetVolumeQosRequest),
                14 => {
                    // Within 1 GiB: a grown pool holds memory for its units, as a created one.
                    if let Ok(mut m) = pb::GrowPoolRequest::decode(body) {
                        m.size_bytes %= 1 << 30;
                        let _ = s.grow_pool(Request::new(m)).await;
                    }
                }
                _ => call!(get_host_info, pb::GetHostInfoRequest),
            }
        });
    }
}
