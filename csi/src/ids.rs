//! Volume and snapshot IDs: what the controller hands to Kubernetes so that it can find
//! a volume again without any state of its own.
//!
//! - volume ID: `HOST/NAME`, where `HOST` is the short id of the storage host's pool
//!   ([`short_host_id`]: 12 hex digits of its UUID) and `NAME` the volume's name there
//!   (the CSI name, e.g. `pvc-<uid>`);
//! - snapshot ID: `HOST/VOLUME@SNAPSHOT`, the engine's full snapshot name, which names
//!   its source volume.
//!
//! IDs name a host by its pool, not its address, so a host may move. A short id keeps a
//! snapshot ID of Kubernetes names (`pvc-<uid>`, `snapshot-<uid>`) under the 128 bytes
//! spec.md "Size Limits" asks of IDs.

use crate::CsiError;

/// Hex digits of a pool UUID kept in IDs.
pub const SHORT_HOST_ID_LEN: usize = 12;

/// The short id of a storage host whose pool UUID is `host_id`: its first 12 hex digits.
pub fn short_host_id(host_id: &str) -> String {
    host_id.chars().filter(|c| c.is_ascii_hexdigit()).take(SHORT_HOST_ID_LEN).collect::<String>().to_ascii_lowercase()
}

/// A parsed volume ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeId {
    /// Short host id.
    pub host: String,
    /// The volume's name on its host.
    pub name: String,
}

/// A parsed snapshot ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotId {
    /// Short host id.
    pub host: String,
    /// The source volume's name on its host.
    pub volume: String,
    /// The snapshot's own name (the CSI name it was created with).
    pub snapshot: String,
}

impl std::fmt::Display for VolumeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.host, self.name)
    }
}

impl std::fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}@{}", self.host, self.volume, self.snapshot)
    }
}

impl SnapshotId {
    /// The engine's full name of the snapshot on its host, `VOLUME@SNAPSHOT`.
    pub fn full_name(&self) -> String {
        format!("{}@{}", self.volume, self.snapshot)
    }
}

fn split_host(id: &str) -> Option<(&str, &str)> {
    let (host, rest) = id.split_once('/')?;
    let ok = host.len() == SHORT_HOST_ID_LEN && host.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    (ok && !rest.is_empty()).then_some((host, rest))
}

/// Parses a volume ID. `None` for a string that no ferrovol controller made (such a
/// volume does not exist: callers answer `NOT_FOUND`, or OK for a delete).
pub fn parse_volume_id(id: &str) -> Option<VolumeId> {
    let (host, name) = split_host(id)?;
    (!name.contains('@') && !name.contains('/')).then(|| VolumeId { host: host.into(), name: name.into() })
}

/// Parses a snapshot ID; `None` as for [`parse_volume_id`].
pub fn parse_snapshot_id(id: &str) -> Option<SnapshotId> {
    let (host, full) = split_host(id)?;
    let (volume, snapshot) = full.split_once('@')?;
    (!volume.is_empty() && !snapshot.is_empty() && !snapshot.contains('@') && !full.contains('/')).then(|| SnapshotId {
        host: host.into(),
        volume: volume.into(),
        snapshot: snapshot.into(),
    })
}

/// The longest volume or snapshot name the engine takes, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Checks that a CSI `name` can name a volume or snapshot on a storage host: 1 to 128
/// bytes of ASCII letters, digits, `.`, `_` and `-`, not starting with `.` or `-`
/// (Kubernetes' `pvc-<uid>` and `snapshot-<uid>` always are).
///
/// Errors: `INVALID_ARGUMENT` naming the rule.
pub fn check_name(what: &str, name: &str) -> Result<(), CsiError> {
    if name.is_empty() {
        return Err(CsiError::invalid(format!("{what} name is missing")));
    }
    let ok = name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.starts_with('.')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(CsiError::invalid(format!(
            "{what} name {name:?} is not valid: 1 to {MAX_NAME_LEN} bytes of letters, digits, '.', '_' and '-', not \
             starting with '.' or '-'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_strangers_do_not_parse() {
        let h = short_host_id("3F2504E0-4F89-11D3-9A0C-0305E82C3301");
        assert_eq!(h, "3f2504e04f89");
        let v = VolumeId { host: h.clone(), name: "pvc-1".into() };
        assert_eq!(parse_volume_id(&v.to_string()), Some(v));
        let s = SnapshotId { host: h.clone(), volume: "pvc-1".into(), snapshot: "snap-1".into() };
        assert_eq!(s.to_string(), "3f2504e04f89/pvc-1@snap-1");
        assert_eq!(parse_snapshot_id(&s.to_string()), Some(s));
        for bad in
            ["", "pvc-1", "some-fake-volume-id", "3f2504e04f89/", "3F2504E04F89/x", "3f2504e04f8/x", "3f2504e04f89/a@b"]
        {
            assert_eq!(parse_volume_id(bad), None, "{bad}");
        }
        for bad in ["3f2504e04f89/pvc-1", "3f2504e04f89/@s", "3f2504e04f89/v@", "x/v@s", "3f2504e04f89/v@s@t"] {
            assert_eq!(parse_snapshot_id(bad), None, "{bad}");
        }
    }
}
