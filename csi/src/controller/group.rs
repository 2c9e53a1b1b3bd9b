//! The CSI GroupController service (spec.md "GroupController Service RPC", spec v1.11):
//! a group snapshot of volumes of one storage host is one group snapshot on that host
//! (`CreateGroupSnapshot`: writes to every member held back together, one commit), so
//! all its members hold the same instant. A group spanning storage hosts is refused
//! (FAILED_PRECONDITION): no instant is common to two hosts.
//!
//! A group snapshot ID is `HOST/*@SNAPSHOT`: its members are the snapshots `SNAPSHOT` of
//! its volumes on host `HOST`, labelled with the group's CSI name, and by the host
//! with its size (which tells a group a crash cut short, taken again whole). Not here:
//! the single-volume calls ([`super`]).

use std::collections::HashMap;

use mgmt_api::pb as api;
use tonic::{Code, Request, Response, Status};

use super::{answer, check_parameters, csi_snapshot, timestamp, Controller, Res};
use crate::ids::{check_name, parse_volume_id, snapshot_name, split_host};
use crate::{pb, CsiError};

/// The label that names a member's group (its CSI name); the storage host adds
/// [`mgmt_api::GROUP_SIZE_LABEL`].
pub const GROUP_LABEL: &str = "csi.ferrovol.io/group";

/// A parsed group snapshot ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSnapshotId {
    /// Short host id.
    pub host: String,
    /// The members' snapshot name.
    pub snapshot: String,
}

impl std::fmt::Display for GroupSnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/*@{}", self.host, self.snapshot)
    }
}

/// Parses a group snapshot ID; `None` for a string no ferrovol controller made.
pub fn parse_group_snapshot_id(id: &str) -> Option<GroupSnapshotId> {
    let (host, rest) = split_host(id)?;
    let snapshot = rest.strip_prefix("*@")?;
    (!snapshot.is_empty() && !snapshot.contains(['@', '/', '*']))
        .then(|| GroupSnapshotId { host: host.into(), snapshot: snapshot.into() })
}

/// The members of group `name` among `snaps` (snapshots of one host): those whose name
/// is `VOLUME@snapshot` and whose group label is `name`.
fn members<'a>(snaps: &'a [api::Volume], snapshot: &str, name: Option<&str>) -> Vec<&'a api::Volume> {
    snaps
        .iter()
        .filter(|v| v.name.split_once('@').is_some_and(|(_, s)| s == snapshot))
        .filter(|v| v.labels.get(GROUP_LABEL).is_some_and(|g| name.is_none_or(|n| g == n)))
        .collect()
}

/// Whether `members` is the whole group its size label says.
fn whole(members: &[&api::Volume]) -> bool {
    !members.is_empty()
        && members
            .iter()
            .all(|m| m.labels.get(mgmt_api::GROUP_SIZE_LABEL).and_then(|n| n.parse().ok()) == Some(members.len()))
}

/// The CSI group snapshot of `members` on the host of `conn`.
fn csi_group(conn: &crate::hosts::Conn, snapshot: &str, members: &[&api::Volume]) -> Res<pb::VolumeGroupSnapshot> {
    let id = GroupSnapshotId { host: conn.short.clone(), snapshot: snapshot.to_string() }.to_string();
    let mut snapshots = Vec::with_capacity(members.len());
    for m in members {
        let mut s = csi_snapshot(conn, m).ok_or_else(|| CsiError::new(Code::Internal, "a snapshot without '@'"))?;
        s.group_snapshot_id = id.clone();
        snapshots.push(s);
    }
    let created = members.iter().map(|m| m.created_unix).min().unwrap_or_default();
    Ok(pb::VolumeGroupSnapshot {
        group_snapshot_id: id,
        snapshots,
        creation_time: Some(timestamp(created)),
        ready_to_use: true,
    })
}

/// INVALID_ARGUMENT unless `asked` (member snapshot IDs a call names; none: not
/// checked) are exactly `group`'s members.
fn check_members(group: &pb::VolumeGroupSnapshot, asked: &[String]) -> Res<()> {
    if asked.is_empty() {
        return Ok(());
    }
    let mut asked: Vec<&str> = asked.iter().map(String::as_str).collect();
    let mut have: Vec<&str> = group.snapshots.iter().map(|s| s.snapshot_id.as_str()).collect();
    asked.sort_unstable();
    have.sort_unstable();
    if asked != have {
        return Err(CsiError::invalid(format!(
            "snapshot_ids {asked:?} are not the members of group snapshot {} ({have:?})",
            group.group_snapshot_id
        )));
    }
    Ok(())
}

impl Controller {
    async fn create_group(
        &self,
        r: pb::CreateVolumeGroupSnapshotRequest,
    ) -> Res<pb::CreateVolumeGroupSnapshotResponse> {
        check_name("group snapshot", &r.name)?;
        if r.source_volume_ids.is_empty() {
            return Err(CsiError::invalid("source_volume_ids is empty"));
        }
        check_parameters(&r.parameters, "group snapshot classes", &[])?;
        let mut ids = Vec::with_capacity(r.source_volume_ids.len());
        for id in &r.source_volume_ids {
            ids.push(parse_volume_id(id).ok_or_else(|| CsiError::not_found(format!("volume {id:?} does not exist")))?);
        }
        let mut wanted: Vec<&str> = r.source_volume_ids.iter().map(String::as_str).collect();
        wanted.sort_unstable();
        if wanted.windows(2).any(|w| w[0] == w[1]) {
            return Err(CsiError::invalid("source_volume_ids names a volume twice"));
        }
        if ids.iter().any(|i| i.host != ids[0].host) {
            // spec.md CreateVolumeGroupSnapshot: "Cannot snapshot multiple volumes
            // together" is FAILED_PRECONDITION.
            return Err(CsiError::new(
                Code::FailedPrecondition,
                "the volumes are on different storage hosts: a group snapshot is one instant of one host \
                 (snapshot them one by one, or place the volumes together)",
            ));
        }
        let _guard = self.inflight.take(format!("group/{}", r.name))?;
        let snap_name = snapshot_name(&r.name);
        // The name first, on every host: the same name of other sources is refused.
        for s in self.hosts.survey().await {
            let Ok(view) = s.answer else { continue };
            let snaps = s.host.call("list the snapshots", |c| async move { c.list_snapshots(None).await }).await?;
            let found = members(&snaps, &snap_name, Some(&r.name));
            if found.is_empty() || !whole(&found) {
                continue; // none, or a group cut short: taken again below
            }
            let group = csi_group(&view.conn, &snap_name, &found)?;
            let mut have: Vec<&str> = group.snapshots.iter().map(|s| s.source_volume_id.as_str()).collect();
            have.sort_unstable();
            if have != wanted {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!("group snapshot {} exists with other source volumes ({})", r.name, have.join(", ")),
                ));
            }
            return Ok(pb::CreateVolumeGroupSnapshotResponse { group_snapshot: Some(group) });
        }
        let (h, conn) = self.host_of(&ids[0].host, "volume").await?;
        let labels: HashMap<String, String> = [(GROUP_LABEL.to_string(), r.name.clone())].into();
        let req = api::CreateGroupSnapshotRequest {
            volumes: ids.iter().map(|i| i.name.clone()).collect(),
            snapshot: snap_name.clone(),
            labels,
            exist_ok: true,
        };
        let made = h
            .call("take the group snapshot", |c| async move { c.create_group_snapshot(req).await })
            .await
            .map_err(|e| match e.code {
                Code::NotFound => CsiError::not_found(format!("a source volume does not exist: {}", e.message)),
                _ => e,
            })?;
        let made: Vec<&api::Volume> = made.iter().collect();
        let group = csi_group(&conn, &snap_name, &made)?;
        Ok(pb::CreateVolumeGroupSnapshotResponse { group_snapshot: Some(group) })
    }

    /// The members of the group `id` names, with its host's connection; NOT_FOUND when
    /// there is no whole group of that ID.
    async fn group_members(&self, id: &str) -> Res<(crate::hosts::Conn, Vec<api::Volume>, GroupSnapshotId)> {
        let missing = || CsiError::not_found(format!("group snapshot {id:?} does not exist"));
        let gid = parse_group_snapshot_id(id).ok_or_else(missing)?;
        let (h, conn) = self.host_of(&gid.host, &format!("group snapshot {id}")).await?;
        let snaps = h.call("list the snapshots", |c| async move { c.list_snapshots(None).await }).await?;
        let found: Vec<api::Volume> = members(&snaps, &gid.snapshot, None).into_iter().cloned().collect();
        Ok((conn, found, gid))
    }

    async fn get_group(&self, r: pb::GetVolumeGroupSnapshotRequest) -> Res<pb::GetVolumeGroupSnapshotResponse> {
        if r.group_snapshot_id.is_empty() {
            return Err(CsiError::invalid("group_snapshot_id is empty"));
        }
        let (conn, found, gid) = self.group_members(&r.group_snapshot_id).await?;
        let found: Vec<&api::Volume> = found.iter().collect();
        if !whole(&found) {
            return Err(CsiError::not_found(format!("group snapshot {:?} does not exist", r.group_snapshot_id)));
        }
        let group = csi_group(&conn, &gid.snapshot, &found)?;
        check_members(&group, &r.snapshot_ids)?;
        Ok(pb::GetVolumeGroupSnapshotResponse { group_snapshot: Some(group) })
    }

    async fn delete_group(
        &self,
        r: pb::DeleteVolumeGroupSnapshotRequest,
    ) -> Res<pb::DeleteVolumeGroupSnapshotResponse> {
        if r.group_snapshot_id.is_empty() {
            return Err(CsiError::invalid("group_snapshot_id is empty"));
        }
        let done = pb::DeleteVolumeGroupSnapshotResponse {};
        let Some(gid) = parse_group_snapshot_id(&r.group_snapshot_id) else { return Ok(done) };
        let _guard = self.inflight.take(format!("group-id/{}", r.group_snapshot_id))?;
        if self.hosts.by_short_id(&gid.host).await?.is_none() {
            return Ok(done);
        }
        let (conn, found, gid) = self.group_members(&r.group_snapshot_id).await?;
        // spec.md DeleteVolumeGroupSnapshot: snapshot_ids that are not the group's
        // members while it exists are INVALID_ARGUMENT.
        if !found.is_empty() {
            check_members(&csi_group(&conn, &gid.snapshot, &found.iter().collect::<Vec<_>>())?, &r.snapshot_ids)?;
        }
        for m in found {
            let Some((vol, _)) = m.name.split_once('@') else { continue };
            let (vol, snap) = (vol.to_string(), gid.snapshot.clone());
            let (h, _) = self.host_of(&gid.host, "group snapshot").await?;
            match h.call("delete a member snapshot", |c| async move { c.delete_snapshot(&vol, &snap).await }).await {
                Ok(()) => {}
                Err(e) if e.code == Code::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

#[tonic::async_trait]
impl pb::group_controller_server::GroupController for Controller {
    async fn group_controller_get_capabilities(
        &self,
        _req: Request<pb::GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::GroupControllerGetCapabilitiesResponse>, Status> {
        use pb::group_controller_service_capability::{rpc::Type, Rpc, Type as Cap};
        let cap = pb::GroupControllerServiceCapability {
            r#type: Some(Cap::Rpc(Rpc { r#type: Type::CreateDeleteGetVolumeGroupSnapshot as i32 })),
        };
        Ok(Response::new(pb::GroupControllerGetCapabilitiesResponse { capabilities: vec![cap] }))
    }

    async fn create_volume_group_snapshot(
        &self,
        req: Request<pb::CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::CreateVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let subject = format!("{} of {:?}", r.name, r.source_volume_ids);
        answer("CreateVolumeGroupSnapshot", &subject, self.create_group(r).await)
    }

    async fn delete_volume_group_snapshot(
        &self,
        req: Request<pb::DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::DeleteVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let id = r.group_snapshot_id.clone();
        answer("DeleteVolumeGroupSnapshot", &id, self.delete_group(r).await)
    }

    async fn get_volume_group_snapshot(
        &self,
        req: Request<pb::GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<pb::GetVolumeGroupSnapshotResponse>, Status> {
        let r = req.into_inner();
        let id = r.group_snapshot_id.clone();
        answer("GetVolumeGroupSnapshot", &id, self.get_group(r).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_snapshot_ids_round_trip_and_refuse_what_no_controller_made() {
        let id = GroupSnapshotId { host: "0123456789ab".into(), snapshot: "gs-1".into() };
        assert_eq!(id.to_string(), "0123456789ab/*@gs-1");
        assert_eq!(parse_group_snapshot_id(&id.to_string()), Some(id));
        for bad in ["0123456789ab/vol@s", "0123456789ab/*@", "0123456789ab/*@a@b", "xyz/*@s", "*@s", ""] {
            assert_eq!(parse_group_snapshot_id(bad), None, "{bad}");
        }
    }
}
