//! Volume properties kept with the metadata: *labels* (key-value pairs a client of the
//! management API sets when it creates a volume, such as the name a CSI driver knows
//! it by) and *attachments* (which node a volume is published to, read-only or not,
//! and the key that node presents to open its export). Lives here: the types, their
//! limits and checks, and their encoding in a `REC_PROPS` record
//! (docs/on-disk-format.md 3.4). Not here: changing them (the pool's catalogue) or
//! enforcing attachments on a wire (the server).

use std::collections::BTreeMap;
use std::fmt;

use zerocopy::{FromBytes, IntoBytes};

use crate::error::{Error, ErrorKind, Result};
use crate::format::*;

/// Labels of a volume or snapshot: key to value, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// Most labels one volume holds.
pub const MAX_LABELS: usize = 16;
/// Longest label key, in bytes.
pub const MAX_LABEL_KEY_LEN: usize = 63;
/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_LEN: usize = 255;
/// Most attachments one volume holds (one per node).
pub const MAX_ATTACHMENTS: usize = 64;
/// Longest node id, in bytes (CSI's limit for `node_id`).
pub const MAX_NODE_ID_LEN: usize = 256;
/// Largest property record, header included: labels and attachments together take at
/// most this (8 KiB: no larger than a full mapping page's record, so the checkpoint
/// bounds hold; 16 labels of the largest size leave room for ten attachments with
/// node ids of the largest size, or some sixty of 30 bytes).
pub const MAX_PROPS_BYTES: u64 = 8192;

/// The secret a node presents to open the export of a volume attached to it: 16
/// random bytes, written as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttachKey(pub [u8; 16]);

impl AttachKey {
    /// A fresh key from the operating system's random source.
    pub fn random() -> AttachKey {
        AttachKey(*uuid::Uuid::new_v4().as_bytes())
    }

    /// The key written as 32 lowercase hex digits, as clients present it.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 32 hex digits; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<AttachKey> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut k = [0u8; 16];
        for (i, byte) in k.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(AttachKey(k))
    }
}

/// Never prints the key itself.
impl fmt::Debug for AttachKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AttachKey(..)")
    }
}

/// A volume published to one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// The node (a CSI `node_id`): 1 to 256 bytes, no control characters.
    pub node_id: String,
    /// What the node presents to open the export.
    pub key: AttachKey,
    /// The node may only read: the export is served read-only to it.
    pub read_only: bool,
    /// No other node may be attached while this one is.
    pub exclusive: bool,
    /// When it was made, seconds since the Unix epoch.
    pub created: u64,
}

/// The properties of one volume, as the metadata keeps them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Props {
    pub labels: Labels,
    /// In the order they were made.
    pub attachments: Vec<Attachment>,
}

impl Props {
    /// Properties of a new volume or snapshot: `labels`, no attachments.
    pub fn with_labels(labels: &Labels) -> Props {
        Props { labels: labels.clone(), attachments: Vec::new() }
    }

    /// Bytes a volume named `name` with these properties counts in
    /// `MetaCounts::volume_bytes`: its name and this property record.
    pub fn volume_bytes(&self, name: &str) -> u64 {
        name.len() as u64 + self.record_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.attachments.is_empty()
    }

    /// Bytes of its `REC_PROPS` record, header included (0 when empty: no record).
    pub fn record_bytes(&self) -> u64 {
        if self.is_empty() {
            return 0;
        }
        let labels: usize = self.labels.iter().map(|(k, v)| size_of::<LabelHead>() + k.len() + v.len()).sum();
        let attachments: usize = self.attachments.iter().map(|a| size_of::<AttachmentHead>() + a.node_id.len()).sum();
        (size_of::<RecordHeader>() + size_of::<PropsRec>() + labels + attachments) as u64
    }

    /// The body of its `REC_PROPS` record for `volume`.
    pub fn encode(&self, volume: u64) -> Vec<u8> {
        let head = PropsRec {
            volume: volume.into(),
            labels: (self.labels.len() as u16).into(),
            attachments: (self.attachments.len() as u16).into(),
            pad: 0.into(),
        };
        let mut out = head.as_bytes().to_vec();
        for (k, v) in &self.labels {
            out.extend_from_slice(LabelHead { key_len: k.len() as u8, value_len: v.len() as u8 }.as_bytes());
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(v.as_bytes());
        }
        for a in &self.attachments {
            let flags = (if a.read_only { ATTACH_FLAG_READ_ONLY } else { 0 })
                | (if a.exclusive { ATTACH_FLAG_EXCLUSIVE } else { 0 });
            let h = AttachmentHead {
                key: a.key.0,
                created: (a.created.min(u64::from(u32::MAX)) as u32).into(),
                node_len: (a.node_id.len() as u16).into(),
                flags: flags.into(),
            };
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(a.node_id.as_bytes());
        }
        out
    }

    /// Decodes a `REC_PROPS` body: `(volume, props)`, checked as [`validate_labels`]
    /// and [`validate_node_id`] check them.
    ///
    /// Errors: [`ErrorKind::Corrupt`].
    pub fn decode(body: &[u8]) -> Result<(u64, Props)> {
        let bad = |what: &str| Error::corrupt(format!("malformed properties record ({what})"));
        let (h, mut rest) = PropsRec::read_from_prefix(body).map_err(|_| bad("head"))?;
        let mut props = Props::default();
        for _ in 0..h.labels.get() {
            let (l, r) = LabelHead::read_from_prefix(rest).map_err(|_| bad("label"))?;
            let (k, v) = (l.key_len as usize, l.value_len as usize);
            if r.len() < k + v {
                return Err(bad("label"));
            }
            let key = String::from_utf8(r[..k].to_vec()).map_err(|_| bad("label key"))?;
            let value = String::from_utf8(r[k..k + v].to_vec()).map_err(|_| bad("label value"))?;
            if props.labels.insert(key, value).is_some() {
                return Err(bad("repeated label"));
            }
            rest = &r[k + v..];
        }
        for _ in 0..h.attachments.get() {
            let (a, r) = AttachmentHead::read_from_prefix(rest).map_err(|_| bad("attachment"))?;
            let n = a.node_len.get() as usize;
            if r.len() < n || a.flags.get() & !(ATTACH_FLAG_READ_ONLY | ATTACH_FLAG_EXCLUSIVE) != 0 {
                return Err(bad("attachment"));
            }
            let node_id = String::from_utf8(r[..n].to_vec()).map_err(|_| bad("node id"))?;
            props.attachments.push(Attachment {
                node_id,
                key: AttachKey(a.key),
                read_only: a.flags.get() & ATTACH_FLAG_READ_ONLY != 0,
                exclusive: a.flags.get() & ATTACH_FLAG_EXCLUSIVE != 0,
                created: u64::from(a.created.get()),
            });
            rest = &r[n..];
        }
        if !rest.is_empty() || h.pad.get() != 0 {
            return Err(bad("trailing bytes"));
        }
        validate_labels(&props.labels).map_err(|e| bad(e.message()))?;
        let mut nodes = std::collections::HashSet::new();
        for a in &props.attachments {
            validate_node_id(&a.node_id).map_err(|e| bad(e.message()))?;
            if !nodes.insert(a.node_id.as_str()) {
                return Err(bad("two attachments to one node"));
            }
        }
        if props.attachments.len() > MAX_ATTACHMENTS || props.record_bytes() > MAX_PROPS_BYTES {
            return Err(bad("too many attachments or labels"));
        }
        Ok((h.volume.get(), props))
    }
}

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

/// Checks labels: at most 16; keys of 1 to 63 bytes of `[A-Za-z0-9._/-]` starting with
/// a letter or digit; values of at most 255 bytes of UTF-8 without control characters.
///
/// Errors: [`ErrorKind::InvalidArgument`] naming the label.
pub fn validate_labels(labels: &Labels) -> Result<()> {
    if labels.len() > MAX_LABELS {
        // Settings the server keeps as labels (`ferrovol/...`: QoS limits, a clone's
        // origin) count too: say so, or a user who gave 16 is left wondering.
        let own = labels.keys().filter(|k| k.starts_with("ferrovol/")).count();
        let note = if own > 0 { format!(", {own} of them named ferrovol/...") } else { String::new() };
        return Err(invalid(format!("{} labels{note}: at most {MAX_LABELS} are kept", labels.len())));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= MAX_LABEL_KEY_LEN
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b))
            && k.as_bytes()[0].is_ascii_alphanumeric();
        if !key_ok {
            return Err(invalid(format!(
                "label key '{}' is invalid: use 1 to {MAX_LABEL_KEY_LEN} characters of A-Z a-z 0-9 . _ / - \
                 starting with a letter or digit",
                crate::error::shown_name(k)
            )));
        }
        if v.len() > MAX_LABEL_VALUE_LEN || v.chars().any(char::is_control) {
            return Err(invalid(format!(
                "the value of label '{k}' is invalid: at most {MAX_LABEL_VALUE_LEN} bytes, no control characters"
            )));
        }
    }
    Ok(())
}

/// Checks a node id: 1 to 256 bytes of UTF-8 without control characters.
///
/// Errors: [`ErrorKind::InvalidArgument`].
pub fn validate_node_id(node_id: &str) -> Result<()> {
    if node_id.is_empty() || node_id.len() > MAX_NODE_ID_LEN || node_id.chars().any(char::is_control) {
        return Err(invalid(format!(
            "node id '{}' is invalid: use 1 to {MAX_NODE_ID_LEN} bytes without control characters",
            crate::error::shown_name(node_id)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Props {
        let mut labels = Labels::new();
        labels.insert("csi.ferrovol.io/name".into(), "pvc-1234".into());
        labels.insert("empty".into(), String::new());
        let attachments = vec![
            Attachment {
                node_id: "node-a".into(),
                key: AttachKey([7; 16]),
                read_only: false,
                exclusive: true,
                created: 1_700_000_000,
            },
            Attachment {
                node_id: "ノード-b".into(),
                key: AttachKey([9; 16]),
                read_only: true,
                exclusive: false,
                created: 5,
            },
        ];
        Props { labels, attachments }
    }

    #[test]
    fn props_round_trip_and_count_their_bytes() {
        let p = sample();
        let body = p.encode(42);
        assert_eq!(body.len() as u64 + size_of::<RecordHeader>() as u64, p.record_bytes());
        assert_eq!(Props::decode(&body).unwrap(), (42, p));
        assert_eq!(Props::default().record_bytes(), 0);
    }

    #[test]
    fn damaged_props_are_corrupt_not_a_panic() {
        let body = sample().encode(1);
        for cut in 0..body.len() {
            assert!(Props::decode(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = body.clone();
        longer.push(0);
        assert!(Props::decode(&longer).is_err());
        // A label key of a control character.
        let mut p = sample();
        p.labels.insert("\u{7}".into(), "x".into());
        assert_eq!(Props::decode(&p.encode(1)).unwrap_err().kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn keys_print_as_hex_and_never_in_debug() {
        let k = AttachKey([0xab; 16]);
        assert_eq!(k.to_hex(), "ab".repeat(16));
        assert_eq!(AttachKey::from_hex(&k.to_hex()), Some(k));
        assert_eq!(AttachKey::from_hex("ab"), None);
        assert_eq!(AttachKey::from_hex(&"zz".repeat(16)), None);
        assert!(!format!("{k:?}").contains("ab"));
        assert_ne!(AttachKey::random(), AttachKey::random());
    }

    #[test]
    fn label_and_node_rules() {
        let mut l = Labels::new();
        l.insert("a".repeat(64), "v".into());
        assert_eq!(validate_labels(&l).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let mut l = Labels::new();
        l.insert("/x".into(), "v".into());
        assert!(validate_labels(&l).is_err());
        let mut l = Labels::new();
        l.insert("k".into(), "v".repeat(256));
        assert!(validate_labels(&l).is_err());
        let l: Labels = (0..17).map(|i| (format!("k{i}"), String::new())).collect();
        assert!(validate_labels(&l).is_err());
        assert!(validate_node_id("").is_err());
        assert!(validate_node_id(&"n".repeat(257)).is_err());
        assert!(validate_node_id("a\nb").is_err());
        validate_node_id(&"n".repeat(256)).unwrap();
    }
}
