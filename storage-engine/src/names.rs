//! Names and sizes of volumes and snapshots: the rules ([`validate_name`], sizes) and
//! their limits. Not here: the registry they name (the store).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::format::BLOCK_SIZE;
use crate::store::VolState;

/// Largest volume: 1 PiB.
pub const MAX_VOLUME_SIZE: u64 = 1 << 50;
/// Longest volume name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Refuses a new volume `name` while snapshots of a deleted volume of that name remain
/// (they would otherwise appear to belong to the new one).
pub(crate) fn check_no_orphan_snapshots(vols: &BTreeMap<String, Arc<VolState>>, name: &str) -> Result<()> {
    let prefix = format!("{name}@");
    match vols.range(prefix.clone()..).next() {
        Some((k, _)) if k.starts_with(&prefix) => Err(Error::new(
            ErrorKind::AlreadyExists,
            format!("snapshots of an earlier volume '{name}' remain (e.g. {k}); delete them or choose another name"),
        )),
        _ => Ok(()),
    }
}

/// Checks a volume name: 1..=128 bytes of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        && !name.starts_with('.')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "name '{}' is invalid: use 1 to {MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ - (not starting with . or -)",
                crate::error::shown_name(name)
            ),
        ))
    }
}

pub(crate) fn validate_size(size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(BLOCK_SIZE) || size > MAX_VOLUME_SIZE {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("volume size {size} must be a non-zero multiple of 4096 bytes and at most 1 PiB"),
        ));
    }
    Ok(())
}
