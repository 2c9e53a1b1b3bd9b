//! Volume attributes: the QoS limits a storage class or a VolumeAttributesClass sets
//! (spec.md CreateVolume `parameters` and `mutable_parameters`,
//! ControllerModifyVolume), read into the management API's `Qos`. Not here: storing
//! and enforcing them (the storage host's SetVolumeQos and its data path).
//!
//! The keys, each a limit per volume whatever the number of connections, `"0"` for
//! none:
//! - `readIOPS`, `writeIOPS`: requests per second (TRIM and WRITE_ZEROES are writes);
//! - `readBytesPerSecond`, `writeBytesPerSecond`: bytes per second, a whole number or
//!   a Kubernetes quantity with a binary or decimal suffix (`100Mi`, `50M`), at least
//!   1Mi;
//! - `burstMilliseconds`: how far ahead of its limits a volume that was idle may run
//!   (0 to 60000).
//!
//! A key not given leaves its limit as it is (spec.md ControllerModifyVolume: "SPs
//! MUST NOT modify volumes based on the absence of keys").

use std::collections::HashMap;

use mgmt_api::pb as api;

use crate::CsiError;

/// READ requests per second.
pub const READ_IOPS: &str = "readIOPS";
/// WRITE, TRIM and WRITE_ZEROES requests per second.
pub const WRITE_IOPS: &str = "writeIOPS";
/// Bytes read per second.
pub const READ_BYTES_PER_SECOND: &str = "readBytesPerSecond";
/// Bytes written per second.
pub const WRITE_BYTES_PER_SECOND: &str = "writeBytesPerSecond";
/// The burst, in milliseconds.
pub const BURST_MILLISECONDS: &str = "burstMilliseconds";

/// Every QoS key.
pub const KEYS: [&str; 5] = [READ_IOPS, WRITE_IOPS, READ_BYTES_PER_SECOND, WRITE_BYTES_PER_SECOND, BURST_MILLISECONDS];

/// The longest burst a storage host takes, in milliseconds.
const MAX_BURST_MS: u64 = 60_000;

/// The lowest byte rate a storage host takes, in bytes per second.
const MIN_BYTES_PER_SECOND: u64 = 1 << 20;

/// Whether `key` is one of ferrovol's QoS parameters.
pub fn is_qos_key(key: &str) -> bool {
    KEYS.contains(&key)
}

/// A whole number of bytes: digits with an optional suffix (k M G T P E, or Ki Mi Gi
/// Ti Pi Ei), as Kubernetes writes quantities.
fn bytes(v: &str) -> Option<u64> {
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, suffix) = v.split_at(digits);
    let n: u64 = n.parse().ok()?;
    let scale: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => return None,
    };
    n.checked_mul(scale)
}

/// `base` with the QoS keys of `params` applied over it; other keys are left to the
/// caller. `what` names the map in messages (`mutable_parameters`).
///
/// Errors: INVALID_ARGUMENT naming every key whose value is not a valid limit, and a
/// burst with no limit to apply it to.
pub fn apply(base: api::Qos, params: &HashMap<String, String>, what: &str) -> Result<api::Qos, CsiError> {
    let mut q = base;
    let mut bad: Vec<String> = Vec::new();
    let mut keys: Vec<(&String, &String)> = params.iter().filter(|(k, _)| is_qos_key(k)).collect();
    keys.sort();
    for (k, v) in keys {
        let v = v.trim();
        match k.as_str() {
            READ_IOPS | WRITE_IOPS => match v.parse::<u64>() {
                Ok(n) if k == READ_IOPS => q.read_iops = n,
                Ok(n) => q.write_iops = n,
                Err(_) => bad.push(format!("{k}={v:?} (a whole number of requests per second)")),
            },
            READ_BYTES_PER_SECOND | WRITE_BYTES_PER_SECOND => match bytes(v) {
                Some(n) if k == READ_BYTES_PER_SECOND => q.read_bytes_per_second = n,
                Some(n) => q.write_bytes_per_second = n,
                None => bad.push(format!("{k}={v:?} (bytes per second: a whole number, or with Ki, Mi, Gi, k, M, G)")),
            },
            _ => match v.parse::<u64>() {
                Ok(n) if n <= MAX_BURST_MS => q.burst_ms = n as u32,
                _ => bad.push(format!("{k}={v:?} (milliseconds, 0 to {MAX_BURST_MS})")),
            },
        }
    }
    if !bad.is_empty() {
        return Err(CsiError::invalid(format!("invalid {what}: {}", bad.join(", "))));
    }
    if q.burst_ms > 0 && is_unlimited(&q) {
        if params.contains_key(BURST_MILLISECONDS) {
            return Err(CsiError::invalid(format!(
                "invalid {what}: {BURST_MILLISECONDS} without a limit to apply it to"
            )));
        }
        // The last limit removed: its burst goes with it.
        q.burst_ms = 0;
    }
    for (k, r) in [(READ_BYTES_PER_SECOND, q.read_bytes_per_second), (WRITE_BYTES_PER_SECOND, q.write_bytes_per_second)]
    {
        if r != 0 && r < MIN_BYTES_PER_SECOND {
            return Err(CsiError::invalid(format!("invalid {what}: {k} below {MIN_BYTES_PER_SECOND} (1Mi)")));
        }
    }
    Ok(q)
}

/// The keys of `params` that are neither QoS keys nor the sidecars' own
/// (`csi.storage.k8s.io/...`), sorted (for an INVALID_ARGUMENT).
pub fn unknown_keys(params: &HashMap<String, String>) -> Vec<&str> {
    let mut k: Vec<&str> =
        params.keys().map(String::as_str).filter(|k| !is_qos_key(k) && !k.starts_with("csi.storage.k8s.io/")).collect();
    k.sort_unstable();
    k
}

/// Whether `q` limits nothing.
pub fn is_unlimited(q: &api::Qos) -> bool {
    q.read_iops == 0 && q.write_iops == 0 && q.read_bytes_per_second == 0 && q.write_bytes_per_second == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn keys_given_change_their_limit_and_others_stay() {
        let base = api::Qos { read_iops: 10, write_iops: 20, ..Default::default() };
        let q = apply(base, &params(&[("writeIOPS", "0"), ("readBytesPerSecond", "100Mi"), ("x", "y")]), "p").unwrap();
        assert_eq!(
            q,
            api::Qos { read_iops: 10, write_iops: 0, read_bytes_per_second: 100 << 20, ..Default::default() }
        );
        assert_eq!(bytes("50M"), Some(50_000_000));
        assert_eq!(bytes("1Ki"), Some(1024));
        assert_eq!(bytes("20Ei"), None, "overflows");
    }

    #[test]
    fn bad_values_are_all_named() {
        let e = apply(
            api::Qos::default(),
            &params(&[("readIOPS", "-1"), ("writeBytesPerSecond", "1.5Gi"), ("burstMilliseconds", "60001")]),
            "mutable_parameters",
        )
        .unwrap_err();
        assert_eq!(e.code, tonic::Code::InvalidArgument);
        for k in ["readIOPS", "writeBytesPerSecond", "burstMilliseconds"] {
            assert!(e.message.contains(k), "{}", e.message);
        }
        let e = apply(api::Qos::default(), &params(&[("burstMilliseconds", "100")]), "p").unwrap_err();
        assert!(e.message.contains("without a limit"), "{}", e.message);
        let e = apply(api::Qos::default(), &params(&[("readBytesPerSecond", "1000")]), "p").unwrap_err();
        assert!(e.message.contains("below"), "{}", e.message);
        // Removing the last limit takes its burst with it.
        let base = api::Qos { write_iops: 5, burst_ms: 100, ..Default::default() };
        assert_eq!(apply(base, &params(&[("writeIOPS", "0")]), "p").unwrap(), api::Qos::default());
    }
}
