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

pub(crate) fn split_host(id: &str) -> Option<(&str, &str)> {
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

/// The longest CSI name taken, in bytes (the value of [`NAME_LABEL`] on the host).
pub const MAX_CSI_NAME_LEN: usize = 255;

/// The longest volume name kept as is on a host; a longer (or otherwise unusable) CSI
/// name becomes `csi-` and 32 hex digits of its SHA-256. Keeps a volume ID within 77
/// bytes.
pub const MAX_PLAIN_VOLUME_NAME: usize = 64;

/// As [`MAX_PLAIN_VOLUME_NAME`] for a snapshot's own name (24 hex digits when hashed):
/// a snapshot ID stays within 126 bytes, under the 128 of spec.md "Size Limits".
pub const MAX_PLAIN_SNAPSHOT_NAME: usize = 48;

/// The label that holds a volume's or snapshot's CSI name on its host.
pub const NAME_LABEL: &str = "csi.ferrovol.io/name";

/// Whether the engine takes `name` as a volume or snapshot name: ASCII letters,
/// digits, `.`, `_` and `-`, not starting with `.` or `-`.
fn engine_valid(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.starts_with('.')
        && !name.starts_with('-')
}

fn hashed(name: &str, hex_digits: usize) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("csi-{}", &hex[..hex_digits])
}

/// The name on its host of the volume with CSI name `name`: the name itself when it is
/// a valid engine name of at most [`MAX_PLAIN_VOLUME_NAME`] bytes (Kubernetes'
/// `pvc-<uid>` always is), else `csi-` and 32 hex digits of its SHA-256.
pub fn volume_name(name: &str) -> String {
    if name.len() <= MAX_PLAIN_VOLUME_NAME && engine_valid(name) && !name.starts_with("csi-") {
        name.to_string()
    } else {
        hashed(name, 32)
    }
}

/// As [`volume_name`] for a snapshot's own name (at most [`MAX_PLAIN_SNAPSHOT_NAME`]
/// bytes kept; else 24 hex digits).
pub fn snapshot_name(name: &str) -> String {
    if name.len() <= MAX_PLAIN_SNAPSHOT_NAME && engine_valid(name) && !name.starts_with("csi-") {
        name.to_string()
    } else {
        hashed(name, 24)
    }
}

/// Checks a CSI `name` (of a volume or snapshot): 1 to [`MAX_CSI_NAME_LEN`] bytes
/// without control characters.
///
/// Errors: `INVALID_ARGUMENT` naming the rule.
pub fn check_name(what: &str, name: &str) -> Result<(), CsiError> {
    if name.is_empty() {
        return Err(CsiError::invalid(format!("{what} name is missing")));
    }
    if name.len() > MAX_CSI_NAME_LEN || name.chars().any(char::is_control) {
        return Err(CsiError::invalid(format!(
            "{what} name {name:?} is not valid: 1 to {MAX_CSI_NAME_LEN} bytes without control characters"
        )));
    }
    Ok(())
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

    #[test]
    fn long_or_odd_names_are_hashed_and_ids_stay_short() {
        let pvc = "pvc-6f1c2d4e-1b2a-4c3d-9e8f-0a1b2c3d4e5f";
        assert_eq!(volume_name(pvc), pvc);
        assert_eq!(
            snapshot_name("snapshot-6f1c2d4e-1b2a-4c3d-9e8f-0a1b2c3d4e5"),
            "snapshot-6f1c2d4e-1b2a-4c3d-9e8f-0a1b2c3d4e5"
        );
        let long = "x".repeat(128);
        for n in [long.as_str(), "has space", "csi-lookalike", "über"] {
            let v = volume_name(n);
            assert!(v.starts_with("csi-") && v.len() == 36, "{n}: {v}");
            assert_eq!(v, volume_name(n), "stable");
            let s = snapshot_name(n);
            assert!(s.starts_with("csi-") && s.len() == 28, "{n}: {s}");
        }
        assert_ne!(volume_name("a b"), volume_name("a c"));
        let id = SnapshotId { host: "3f2504e04f89".into(), volume: volume_name(&long), snapshot: snapshot_name(&long) };
        assert!(id.to_string().len() <= 128);
        let widest = SnapshotId { host: "3f2504e04f89".into(), volume: "v".repeat(64), snapshot: "s".repeat(48) };
        assert!(widest.to_string().len() <= 128, "{}", widest.to_string().len());
        assert!(check_name("volume", &"y".repeat(255)).is_ok());
        assert!(check_name("volume", &"y".repeat(256)).is_err());
        assert!(check_name("volume", "a\nb").is_err());
    }
}
