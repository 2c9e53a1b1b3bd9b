//! The CSI SnapshotMetadata service (spec.md "SnapshotMetadata Service RPC", spec
//! v1.10, alpha): which blocks a snapshot holds (GetMetadataAllocated) and which
//! changed between two snapshots of one volume (GetMetadataDelta), for backup tools
//! that read only those. Both come from the storage host's mappings alone
//! (`DiffSnapshots`): no data is read. Ranges are 4 KiB-aligned extents
//! (`VARIABLE_LENGTH`), ascending and disjoint, streamed `max_results` at a time
//! (256 when 0), from `starting_offset` rounded down to 4 KiB (a range that holds it
//! starts there).
//!
//! How tight the delta is: a 4 KiB block is listed when it is written in one snapshot
//! and not the other, or both map it to different data units. Every block written or
//! trimmed since the base is listed; so is every other written block of a data unit
//! (64 KiB by default) that was copied on write after the base: at most one data unit
//! more than what changed, around each write.

use std::pin::Pin;

use futures_util::Stream;
use mgmt_api::pb as api;
use tonic::{Request, Response, Status};

use super::{answer, Controller, Res};
use crate::ids::{parse_snapshot_id, SnapshotId};
use crate::{pb, CsiError};

/// Ranges per message when the caller leaves it to the plugin.
pub const DEFAULT_RESULTS: usize = 256;

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The ranges of `ranges` from `start` on (the one that holds `start` cut to begin
/// there), as CSI block metadata.
fn from_offset(ranges: &[api::ByteRange], start: u64) -> Vec<pb::BlockMetadata> {
    ranges
        .iter()
        .filter(|r| r.offset + r.length > start)
        .map(|r| {
            let off = r.offset.max(start);
            pb::BlockMetadata { byte_offset: off as i64, size_bytes: (r.offset + r.length - off) as i64 }
        })
        .collect()
}

/// `max_results` as a chunk size.
///
/// Errors: INVALID_ARGUMENT for a negative value.
fn chunk_size(max_results: i32) -> Res<usize> {
    match max_results {
        0 => Ok(DEFAULT_RESULTS),
        n if n > 0 => Ok(n as usize),
        n => Err(CsiError::invalid(format!("max_results {n} is negative"))),
    }
}

impl Controller {
    /// The snapshot an ID names, with its host's size of it.
    async fn metadata_snapshot(&self, field: &str, id: &str) -> Res<(&crate::hosts::Host, SnapshotId, u64)> {
        if id.is_empty() {
            return Err(CsiError::invalid(format!("{field} is empty")));
        }
        let missing = || CsiError::not_found(format!("snapshot {id:?} does not exist"));
        let sid = parse_snapshot_id(id).ok_or_else(missing)?;
        let (h, _) = self.host_of(&sid.host, &format!("snapshot {id}")).await?;
        let full = sid.full_name();
        let v = h.call("look up the snapshot", |c| async move { c.volume(&full).await }).await.map_err(|e| {
            if e.code == tonic::Code::NotFound {
                missing()
            } else {
                e
            }
        })?;
        Ok((h, sid, v.size_bytes))
    }

    /// The ranges of `to` from `start` (or of its difference from `from`), in chunks of
    /// `max_results`, each chunk made into a message by `message`.
    async fn metadata_stream<T: Send + 'static>(
        &self,
        from: Option<&str>,
        to: &str,
        start: i64,
        max_results: i32,
        message: impl Fn(i64, Vec<pb::BlockMetadata>) -> T,
    ) -> Res<Vec<T>> {
        let chunk = chunk_size(max_results)?;
        if start < 0 {
            return Err(CsiError::invalid(format!("starting_offset {start} is negative")));
        }
        let (h, target, size) =
            self.metadata_snapshot(if from.is_some() { "target_snapshot_id" } else { "snapshot_id" }, to).await?;
        let base = match from {
            Some(base_id) => {
                let (_, base, _) = self.metadata_snapshot("base_snapshot_id", base_id).await?;
                if base.host != target.host || base.volume != target.volume {
                    return Err(CsiError::invalid(format!(
                        "base snapshot {base_id} and target snapshot {to} are not of the same volume"
                    )));
                }
                base.full_name()
            }
            None => String::new(),
        };
        if start as u64 >= size {
            return Err(CsiError::new(
                tonic::Code::OutOfRange,
                format!("starting_offset {start} is not below the snapshot's size ({size} bytes)"),
            ));
        }
        let full = target.full_name();
        let ranges = h.call("read the snapshot's mappings", |c| async move { c.diff(&base, &full).await }).await?;
        let metadata = from_offset(&ranges, start as u64 & !4095);
        Ok(metadata.chunks(chunk).map(|c| message(size as i64, c.to_vec())).collect())
    }
}

#[tonic::async_trait]
impl pb::snapshot_metadata_server::SnapshotMetadata for Controller {
    type GetMetadataAllocatedStream = Streamed<pb::GetMetadataAllocatedResponse>;
    type GetMetadataDeltaStream = Streamed<pb::GetMetadataDeltaResponse>;

    async fn get_metadata_allocated(
        &self,
        req: Request<pb::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let r = req.into_inner();
        let subject = format!("{} from {}", r.snapshot_id, r.starting_offset);
        let messages = self
            .metadata_stream(None, &r.snapshot_id, r.starting_offset, r.max_results, |size, block_metadata| {
                pb::GetMetadataAllocatedResponse {
                    block_metadata_type: pb::BlockMetadataType::VariableLength as i32,
                    volume_capacity_bytes: size,
                    block_metadata,
                }
            })
            .await;
        let messages = answer("GetMetadataAllocated", &subject, messages)?.into_inner();
        Ok(Response::new(Box::pin(futures_util::stream::iter(messages.into_iter().map(Ok)))))
    }

    async fn get_metadata_delta(
        &self,
        req: Request<pb::GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let r = req.into_inner();
        let subject = format!("{} to {} from {}", r.base_snapshot_id, r.target_snapshot_id, r.starting_offset);
        if r.base_snapshot_id.is_empty() {
            return Err(answer::<()>(
                "GetMetadataDelta",
                &subject,
                Err(CsiError::invalid("base_snapshot_id is empty")),
            )
            .unwrap_err());
        }
        let messages = self
            .metadata_stream(
                Some(&r.base_snapshot_id),
                &r.target_snapshot_id,
                r.starting_offset,
                r.max_results,
                |size, block_metadata| pb::GetMetadataDeltaResponse {
                    block_metadata_type: pb::BlockMetadataType::VariableLength as i32,
                    volume_capacity_bytes: size,
                    block_metadata,
                },
            )
            .await;
        let messages = answer("GetMetadataDelta", &subject, messages)?.into_inner();
        Ok(Response::new(Box::pin(futures_util::stream::iter(messages.into_iter().map(Ok)))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_start_at_the_offset_asked_for() {
        let r = |offset, length| api::ByteRange { offset, length };
        let ranges = [r(0, 8192), r(65536, 4096), r(131072, 65536)];
        let got: Vec<(i64, i64)> = from_offset(&ranges, 70000).iter().map(|b| (b.byte_offset, b.size_bytes)).collect();
        assert_eq!(got, vec![(131072, 65536)]);
        let got: Vec<(i64, i64)> = from_offset(&ranges, 4096).iter().map(|b| (b.byte_offset, b.size_bytes)).collect();
        assert_eq!(got, vec![(4096, 4096), (65536, 4096), (131072, 65536)]);
        assert_eq!(chunk_size(0).unwrap(), DEFAULT_RESULTS);
        assert!(chunk_size(-1).is_err());
    }
}
