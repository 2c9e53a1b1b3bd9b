//! Wire format of the NBD protocol, as laid out in the NetworkBlockDevice `doc/proto.md`.
//!
//! Lives here: magic numbers, handshake and transmission flags, option codes, option
//! reply types, `NBD_INFO_*` types, command codes and command flags, structured reply
//! chunk types and flags, the typed transmission [`Request`], fixed-size headers with
//! explicit big-endian encoding and parsing, and the encoders for option replies and
//! structured reply chunks.
//! Not here: any I/O, policy or state (which option is allowed when, validation of a
//! request against an export) — that is in `handshake` and `transmission`.
//!
//! Every multi-byte field is big-endian ("network byte order", proto.md "Conventions").
//! Encoders never panic; parsers never panic and take fixed-size arrays or
//! length-checked slices.

use crate::export::{Errno, Extent};

// ---------------------------------------------------------------------------------------
// Magic numbers
// ---------------------------------------------------------------------------------------

/// `NBDMAGIC` (also `INIT_PASSWD`), first 8 bytes the server sends (proto.md, "Newstyle
/// negotiation").
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second 8 bytes of the server greeting, and the first 8 bytes of every
/// option request (proto.md, "Newstyle negotiation").
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply during fixed newstyle option haggling (proto.md, "Fixed
/// newstyle negotiation").
pub const NBD_OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// `NBD_REQUEST_MAGIC`, first 4 bytes of every transmission request (proto.md, "Request
/// message").
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// `NBD_SIMPLE_REPLY_MAGIC` (proto.md, "Simple reply message").
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// `NBD_STRUCTURED_REPLY_MAGIC` (proto.md, "Structured reply chunk message").
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------------------
// Handshake flags (16 bits, server) and client flags (32 bits)
// ---------------------------------------------------------------------------------------

/// Handshake flag bit 0: the server supports fixed newstyle negotiation.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag bit 1: the server can omit the 124 zero bytes after
/// `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

/// Client flag bit 0: the client speaks fixed newstyle.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag bit 1: the server MUST NOT send the 124 zero bytes after
/// `NBD_OPT_EXPORT_NAME`.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------------------
// Transmission flags (16 bits), proto.md "Transmission flags"
// ---------------------------------------------------------------------------------------

/// Bit 0: MUST always be set.
pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Bit 1: the export is read-only.
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
/// Bit 2: `NBD_CMD_FLUSH` is supported.
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Bit 3: `NBD_CMD_FLAG_FUA` is supported.
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
/// Bit 4: the export behaves like a rotational medium.
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
/// Bit 5: `NBD_CMD_TRIM` is supported.
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
/// Bit 6: `NBD_CMD_WRITE_ZEROES` and `NBD_CMD_FLAG_NO_HOLE` are supported.
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Bit 7: `NBD_CMD_FLAG_DF` is supported on `NBD_CMD_READ` (structured replies only).
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
/// Bit 8: multi-conn: flush and FUA are visible across all connections to the export.
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Bit 9: `NBD_CMD_RESIZE` (experimental `RESIZE` extension; not implemented here).
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
/// Bit 10: `NBD_CMD_CACHE` is understood.
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
/// Bit 11: `NBD_CMD_FLAG_FAST_ZERO` is supported on `NBD_CMD_WRITE_ZEROES`.
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------------------
// Option types, proto.md "Option types"
// ---------------------------------------------------------------------------------------

/// Choose an export and enter transmission; errors can only be signalled by closing.
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
/// Soft disconnect during option haggling.
pub const NBD_OPT_ABORT: u32 = 2;
/// List exports (`NBD_REP_SERVER` replies, then `NBD_REP_ACK`).
pub const NBD_OPT_LIST: u32 = 3;
/// Withdrawn `PEEK_EXPORT` extension; answered with `NBD_REP_ERR_UNSUP`.
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
/// Upgrade to TLS; this server runs in NOTLS mode and answers `NBD_REP_ERR_UNSUP`.
pub const NBD_OPT_STARTTLS: u32 = 5;
/// Describe an export without entering transmission.
pub const NBD_OPT_INFO: u32 = 6;
/// Describe an export and enter transmission.
pub const NBD_OPT_GO: u32 = 7;
/// Negotiate structured replies.
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
/// List metadata contexts.
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
/// Select metadata contexts for `NBD_CMD_BLOCK_STATUS`.
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
/// Extended headers; not implemented here (answered with `NBD_REP_ERR_UNSUP`).
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------------------------------
// Option reply types, proto.md "Option reply types"
// ---------------------------------------------------------------------------------------

/// The option succeeded (or a list has ended). No data.
pub const NBD_REP_ACK: u32 = 1;
/// One export in reply to `NBD_OPT_LIST`: 32-bit name length, name, description.
pub const NBD_REP_SERVER: u32 = 2;
/// One piece of information in reply to `NBD_OPT_INFO`/`NBD_OPT_GO`: 16-bit
/// `NBD_INFO_*` type, then its payload.
pub const NBD_REP_INFO: u32 = 3;
/// One metadata context: 32-bit context id, then the context name.
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Bit 31 marks every error reply type.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
/// The option is unknown to this server.
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
/// Forbidden by server policy.
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
/// Syntactically or semantically invalid option.
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
/// Not supported on this platform.
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
/// TLS required first.
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
/// The requested export is not available.
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
/// The server is shutting down.
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
/// The client must request `NBD_INFO_BLOCK_SIZE` first.
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
/// The request or reply is too large.
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

// ---------------------------------------------------------------------------------------
// NBD_INFO types, proto.md "`NBD_REP_INFO`"
// ---------------------------------------------------------------------------------------

/// Size (64 bits, bytes) and transmission flags (16 bits); payload length 12.
pub const NBD_INFO_EXPORT: u16 = 0;
/// Canonical export name.
pub const NBD_INFO_NAME: u16 = 1;
/// Human-readable description.
pub const NBD_INFO_DESCRIPTION: u16 = 2;
/// Minimum, preferred and maximum block size (32 bits each, bytes); payload length 14.
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------------------
// Commands and command flags, proto.md "Request types" and "Command flags"
// ---------------------------------------------------------------------------------------

/// `NBD_CMD_READ` wire value.
pub const NBD_CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE` wire value.
pub const NBD_CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC` wire value.
pub const NBD_CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH` wire value.
pub const NBD_CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM` wire value.
pub const NBD_CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE` wire value.
pub const NBD_CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES` wire value.
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS` wire value.
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;

/// Command flag bit 0: force unit access (durable before the reply).
pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag bit 1: `NBD_CMD_WRITE_ZEROES` must not create a hole.
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag bit 2: don't fragment the structured reply to `NBD_CMD_READ`.
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag bit 3: `NBD_CMD_BLOCK_STATUS` wants exactly one extent.
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag bit 4: fail `NBD_CMD_WRITE_ZEROES` with `NBD_ENOTSUP` unless it is fast.
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// ---------------------------------------------------------------------------------------
// Structured replies, proto.md "Structured reply flags" and "Structured reply types"
// ---------------------------------------------------------------------------------------

/// Structured reply flag bit 0: this is the final chunk of the reply.
pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;

/// Final chunk with no payload.
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
/// 64-bit offset, then data.
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// 64-bit offset, 32-bit hole size: that range reads as zeros.
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// 32-bit metadata context id, then (32-bit length, 32-bit status) descriptors.
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Bit 15 marks every error chunk type.
pub const NBD_REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
/// 32-bit error, 16-bit message length, message.
pub const NBD_REPLY_TYPE_ERROR: u16 = NBD_REPLY_TYPE_FLAG_ERROR | 1;
/// Like `NBD_REPLY_TYPE_ERROR`, followed by a 64-bit offset.
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = NBD_REPLY_TYPE_FLAG_ERROR | 2;

/// `base:allocation` status bit 0: the extent is a hole.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status bit 1: the extent reads as zeros.
pub const NBD_STATE_ZERO: u32 = 1 << 1;

/// Name of the one metadata context this crate serves (proto.md, "`base:allocation`
/// metadata context").
pub const BASE_ALLOCATION: &str = "base:allocation";

/// The longest string the protocol allows (export names, descriptions, error messages),
/// in bytes (proto.md, "Conventions").
pub const MAX_STRING_LEN: usize = 4096;

// ---------------------------------------------------------------------------------------
// Errors found while parsing
// ---------------------------------------------------------------------------------------

/// A fixed-size header that could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The magic number did not match; carries what was received.
    #[error("bad magic {found:#x}, expected {expected:#x}")]
    BadMagic {
        /// The magic the protocol requires at this point.
        expected: u64,
        /// The magic received.
        found: u64,
    },
}

// ---------------------------------------------------------------------------------------
// Big-endian helpers
// ---------------------------------------------------------------------------------------

fn be_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_be_bytes(a)
}

fn be_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// A cursor over option data that never reads past the end (used for the variable
/// length option payloads of `NBD_OPT_INFO`, `NBD_OPT_GO` and the meta context options).
struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn u16(&mut self) -> Option<u16> {
        let (head, rest) = self.data.split_first_chunk::<2>()?;
        self.data = rest;
        Some(u16::from_be_bytes(*head))
    }

    fn u32(&mut self) -> Option<u32> {
        let (head, rest) = self.data.split_first_chunk::<4>()?;
        self.data = rest;
        Some(u32::from_be_bytes(*head))
    }

    fn bytes(&mut self, len: usize) -> Option<&'a [u8]> {
        if len > self.data.len() {
            return None;
        }
        let (head, rest) = self.data.split_at(len);
        self.data = rest;
        Some(head)
    }
}

// ---------------------------------------------------------------------------------------
// Handshake messages
// ---------------------------------------------------------------------------------------

/// Length in bytes of the server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub const GREETING_LEN: usize = 18;

/// The server greeting of newstyle negotiation (proto.md, "Newstyle negotiation"):
/// 64-bit `NBDMAGIC`, 64-bit `IHAVEOPT`, 16-bit handshake flags.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    b
}

/// Length in bytes of an option request header.
pub const OPTION_HEADER_LEN: usize = 16;

/// An option request header (proto.md, "Newstyle negotiation"): 64-bit `IHAVEOPT`,
/// 32-bit option, 32-bit length of the option data that follows (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// `NBD_OPT_*` code.
    pub option: u32,
    /// Length of the option data that follows, in bytes.
    pub length: u32,
}

impl OptionHeader {
    /// Parses a header; fails with [`WireError::BadMagic`] unless it starts with `IHAVEOPT`.
    pub fn parse(b: &[u8; OPTION_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u64(b, 0);
        if magic != IHAVEOPT {
            return Err(WireError::BadMagic { expected: IHAVEOPT, found: magic });
        }
        Ok(Self { option: be_u32(b, 8), length: be_u32(b, 12) })
    }

    /// Encodes the header (the option data is sent separately).
    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut b = [0u8; OPTION_HEADER_LEN];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Length in bytes of an option reply header.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;

/// An option reply header (proto.md, "Fixed newstyle negotiation"): 64-bit reply magic,
/// 32-bit option, 32-bit reply type, 32-bit length of the reply data (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// The option being answered.
    pub option: u32,
    /// `NBD_REP_*` type.
    pub reply_type: u32,
    /// Length of the reply data that follows, in bytes.
    pub length: u32,
}

impl OptionReplyHeader {
    /// Parses a header; fails with [`WireError::BadMagic`] on a wrong reply magic.
    pub fn parse(b: &[u8; OPTION_REPLY_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u64(b, 0);
        if magic != NBD_OPTION_REPLY_MAGIC {
            return Err(WireError::BadMagic { expected: NBD_OPTION_REPLY_MAGIC, found: magic });
        }
        Ok(Self { option: be_u32(b, 8), reply_type: be_u32(b, 12), length: be_u32(b, 16) })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; OPTION_REPLY_HEADER_LEN] {
        let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
        b[0..8].copy_from_slice(&NBD_OPTION_REPLY_MAGIC.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.reply_type.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// A complete option reply: header followed by `data`. `data` is at most a few KiB in
/// practice (strings are capped at [`MAX_STRING_LEN`]); a longer one is cut to
/// `u32::MAX` bytes so the header never lies.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let data = &data[..data.len().min(u32::MAX as usize)];
    let header = OptionReplyHeader { option, reply_type, length: data.len() as u32 };
    let mut out = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(data);
    out
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Data of an `NBD_REP_SERVER` reply (proto.md, "Option reply types"): 32-bit name
/// length, name, description. Both strings are cut to [`MAX_STRING_LEN`].
pub fn encode_rep_server(name: &str, description: &str) -> Vec<u8> {
    let name = truncate_str(name, MAX_STRING_LEN);
    let description = truncate_str(description, MAX_STRING_LEN);
    let mut out = Vec::with_capacity(4 + name.len() + description.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
    out
}

/// Data of `NBD_REP_INFO` / `NBD_INFO_EXPORT`: type, export size (bytes), transmission
/// flags. 12 bytes.
pub fn encode_info_export(size: u64, transmission_flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size.to_be_bytes());
    b[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    b
}

/// Data of `NBD_REP_INFO` / `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION` (`info_type`):
/// type, then the string cut to [`MAX_STRING_LEN`].
pub fn encode_info_string(info_type: u16, s: &str) -> Vec<u8> {
    let s = truncate_str(s, MAX_STRING_LEN);
    let mut out = Vec::with_capacity(2 + s.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
    out
}

/// Data of `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE`: type, minimum, preferred and maximum
/// block size in bytes (proto.md, "Block size constraints"). 14 bytes.
pub fn encode_info_block_size(minimum: u32, preferred: u32, maximum: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&minimum.to_be_bytes());
    b[6..10].copy_from_slice(&preferred.to_be_bytes());
    b[10..14].copy_from_slice(&maximum.to_be_bytes());
    b
}

/// Data of `NBD_REP_META_CONTEXT`: 32-bit context id, context name.
pub fn encode_meta_context(context_id: u32, name: &str) -> Vec<u8> {
    let name = truncate_str(name, MAX_STRING_LEN);
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Length in bytes of the reply to `NBD_OPT_EXPORT_NAME` without the trailing zeros.
pub const EXPORT_NAME_REPLY_LEN: usize = 10;
/// Number of reserved zero bytes after the `NBD_OPT_EXPORT_NAME` reply unless
/// `NBD_FLAG_C_NO_ZEROES` was negotiated.
pub const EXPORT_NAME_ZEROES: usize = 124;

/// Reply to `NBD_OPT_EXPORT_NAME` (proto.md, "Newstyle negotiation"): 64-bit export size
/// in bytes, 16-bit transmission flags, then 124 zero bytes unless `no_zeroes`.
pub fn encode_export_name_reply(size: u64, transmission_flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(EXPORT_NAME_REPLY_LEN + EXPORT_NAME_ZEROES);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.resize(EXPORT_NAME_REPLY_LEN + EXPORT_NAME_ZEROES, 0);
    }
    out
}

/// Why a variable-length option payload was rejected (`NBD_REP_ERR_INVALID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OptionDataError {
    /// A length field points past the end of the option data, or bytes are left over.
    #[error("option data length does not match its contents")]
    BadLength,
    /// A string is not UTF-8, contains NUL, or is longer than 4096 bytes.
    #[error("invalid string in option data")]
    BadString,
}

fn parse_string(b: &[u8]) -> Result<String, OptionDataError> {
    if b.len() > MAX_STRING_LEN || b.contains(&0) {
        return Err(OptionDataError::BadString);
    }
    std::str::from_utf8(b).map(str::to_owned).map_err(|_| OptionDataError::BadString)
}

/// Parses the name given with `NBD_OPT_EXPORT_NAME`: the whole option data.
pub fn parse_export_name(data: &[u8]) -> Result<String, OptionDataError> {
    parse_string(data)
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO` (proto.md, "`NBD_OPT_INFO` (6) and
/// `NBD_OPT_GO` (7)"): 32-bit name length, name, 16-bit number of information requests,
/// that many 16-bit `NBD_INFO_*` types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name ("" is the default export).
    pub name: String,
    /// Requested `NBD_INFO_*` types, in the order sent.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses option data; every length must match exactly.
    pub fn parse(data: &[u8]) -> Result<Self, OptionDataError> {
        let mut c = Cursor { data };
        let name_len = c.u32().ok_or(OptionDataError::BadLength)? as usize;
        let name = parse_string(c.bytes(name_len).ok_or(OptionDataError::BadLength)?)?;
        let count = c.u16().ok_or(OptionDataError::BadLength)?;
        if c.data.len() != usize::from(count) * 2 {
            return Err(OptionDataError::BadLength);
        }
        let mut requests = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            requests.push(c.u16().ok_or(OptionDataError::BadLength)?);
        }
        Ok(Self { name, requests })
    }

    /// Encodes option data (used by clients and tests).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(6 + self.name.len() + 2 * self.requests.len());
        out.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&(self.requests.len() as u16).to_be_bytes());
        for r in &self.requests {
            out.extend_from_slice(&r.to_be_bytes());
        }
        out
    }
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT` (proto.md,
/// "Option types"): 32-bit export name length, export name, 32-bit number of queries,
/// then per query a 32-bit length and the query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    /// Export the contexts are for.
    pub export_name: String,
    /// Query strings such as `base:allocation` or `base:`.
    pub queries: Vec<String>,
}

impl MetaContextRequest {
    /// Parses option data; every length must match exactly.
    pub fn parse(data: &[u8]) -> Result<Self, OptionDataError> {
        let mut c = Cursor { data };
        let name_len = c.u32().ok_or(OptionDataError::BadLength)? as usize;
        let export_name = parse_string(c.bytes(name_len).ok_or(OptionDataError::BadLength)?)?;
        let count = c.u32().ok_or(OptionDataError::BadLength)?;
        // Each query takes at least 4 bytes: a count larger than that is a lie, and
        // checking it first keeps the allocation below proportional to the data.
        if u64::from(count) * 4 > c.data.len() as u64 {
            return Err(OptionDataError::BadLength);
        }
        let mut queries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = c.u32().ok_or(OptionDataError::BadLength)? as usize;
            queries.push(parse_string(c.bytes(len).ok_or(OptionDataError::BadLength)?)?);
        }
        if !c.data.is_empty() {
            return Err(OptionDataError::BadLength);
        }
        Ok(Self { export_name, queries })
    }

    /// Encodes option data (used by clients and tests).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.export_name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.export_name.as_bytes());
        out.extend_from_slice(&(self.queries.len() as u32).to_be_bytes());
        for q in &self.queries {
            out.extend_from_slice(&(q.len() as u32).to_be_bytes());
            out.extend_from_slice(q.as_bytes());
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// Transmission requests
// ---------------------------------------------------------------------------------------

/// Length in bytes of a request header (proto.md, "Request message").
pub const REQUEST_HEADER_LEN: usize = 28;

/// The command of a request. Unknown wire values become [`Command::Unsupported`] so that
/// the server can answer them with `NBD_EINVAL` instead of failing to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE` (followed by `length` bytes of payload).
    Write,
    /// `NBD_CMD_DISC`: soft disconnect, no reply.
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_CACHE`.
    Cache,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus,
    /// Any other type value, as received.
    Unsupported(u16),
}

impl Command {
    /// The command for a wire type value.
    pub fn from_wire(value: u16) -> Self {
        match value {
            NBD_CMD_READ => Self::Read,
            NBD_CMD_WRITE => Self::Write,
            NBD_CMD_DISC => Self::Disc,
            NBD_CMD_FLUSH => Self::Flush,
            NBD_CMD_TRIM => Self::Trim,
            NBD_CMD_CACHE => Self::Cache,
            NBD_CMD_WRITE_ZEROES => Self::WriteZeroes,
            NBD_CMD_BLOCK_STATUS => Self::BlockStatus,
            other => Self::Unsupported(other),
        }
    }

    /// The wire type value.
    pub fn to_wire(self) -> u16 {
        match self {
            Self::Read => NBD_CMD_READ,
            Self::Write => NBD_CMD_WRITE,
            Self::Disc => NBD_CMD_DISC,
            Self::Flush => NBD_CMD_FLUSH,
            Self::Trim => NBD_CMD_TRIM,
            Self::Cache => NBD_CMD_CACHE,
            Self::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Self::BlockStatus => NBD_CMD_BLOCK_STATUS,
            Self::Unsupported(other) => other,
        }
    }
}

/// One transmission request (proto.md, "Request message"): 32-bit magic, 16-bit command
/// flags, 16-bit type, 64-bit handle, 64-bit offset (bytes), 32-bit length (bytes).
///
/// Not `Clone`: a parsed request is handed to exactly one handler and consumed there.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// `NBD_CMD_FLAG_*` bits, as received (validated later, per command).
    pub flags: u16,
    /// What to do.
    pub command: Command,
    /// Opaque value echoed in the reply.
    pub handle: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Length in bytes (for `NBD_CMD_WRITE` also the payload length that follows).
    pub length: u32,
}

impl Request {
    /// Parses a request header; a wrong magic is a [`WireError::BadMagic`] (the server
    /// then hard-disconnects, since the stream can no longer be framed).
    pub fn parse(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u32(b, 0);
        if magic != NBD_REQUEST_MAGIC {
            return Err(WireError::BadMagic { expected: u64::from(NBD_REQUEST_MAGIC), found: u64::from(magic) });
        }
        Ok(Self {
            flags: be_u16(b, 4),
            command: Command::from_wire(be_u16(b, 6)),
            handle: be_u64(b, 8),
            offset: be_u64(b, 16),
            length: be_u32(b, 24),
        })
    }

    /// Encodes the header (a write payload is sent separately).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

// ---------------------------------------------------------------------------------------
// Replies
// ---------------------------------------------------------------------------------------

/// Length in bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;

/// A simple reply (proto.md, "Simple reply message"): 32-bit magic, 32-bit error (0 for
/// success), 64-bit handle; followed by the data of a successful `NBD_CMD_READ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// `NBD_E*` value, 0 for success.
    pub error: u32,
    /// Handle of the request answered.
    pub handle: u64,
}

impl SimpleReply {
    /// Parses a simple reply header.
    pub fn parse(b: &[u8; SIMPLE_REPLY_LEN]) -> Result<Self, WireError> {
        let magic = be_u32(b, 0);
        if magic != NBD_SIMPLE_REPLY_MAGIC {
            return Err(WireError::BadMagic { expected: u64::from(NBD_SIMPLE_REPLY_MAGIC), found: u64::from(magic) });
        }
        Ok(Self { error: be_u32(b, 4), handle: be_u64(b, 8) })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; SIMPLE_REPLY_LEN] {
        let mut b = [0u8; SIMPLE_REPLY_LEN];
        b[0..4].copy_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&self.error.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b
    }
}

/// Length in bytes of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;

/// A structured reply chunk header (proto.md, "Structured reply chunk message"): 32-bit
/// magic, 16-bit flags, 16-bit type, 64-bit handle, 32-bit payload length (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// `NBD_REPLY_FLAG_*` bits.
    pub flags: u16,
    /// `NBD_REPLY_TYPE_*`.
    pub chunk_type: u16,
    /// Handle of the request answered.
    pub handle: u64,
    /// Payload length in bytes.
    pub length: u32,
}

impl ChunkHeader {
    /// Parses a chunk header.
    pub fn parse(b: &[u8; CHUNK_HEADER_LEN]) -> Result<Self, WireError> {
        let magic = be_u32(b, 0);
        if magic != NBD_STRUCTURED_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                expected: u64::from(NBD_STRUCTURED_REPLY_MAGIC),
                found: u64::from(magic),
            });
        }
        Ok(Self { flags: be_u16(b, 4), chunk_type: be_u16(b, 6), handle: be_u64(b, 8), length: be_u32(b, 16) })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        b[0..4].copy_from_slice(&NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.chunk_type.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

fn done_flag(done: bool) -> u16 {
    if done {
        NBD_REPLY_FLAG_DONE
    } else {
        0
    }
}

/// The largest data length one `NBD_REPLY_TYPE_OFFSET_DATA` chunk can carry, in bytes
/// (the 32-bit chunk length also covers the 8-byte offset).
pub const MAX_OFFSET_DATA_LEN: u32 = u32::MAX - 8;

/// Chunk header and 64-bit offset of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk carrying
/// `data_len` bytes (1 ..= [`MAX_OFFSET_DATA_LEN`]) read at byte `offset`; the data itself
/// follows. A larger `data_len` is clamped to [`MAX_OFFSET_DATA_LEN`], so callers split
/// first.
pub fn encode_offset_data_header(handle: u64, offset: u64, data_len: u32, done: bool) -> [u8; 28] {
    let header = ChunkHeader {
        flags: done_flag(done),
        chunk_type: NBD_REPLY_TYPE_OFFSET_DATA,
        handle,
        length: data_len.min(MAX_OFFSET_DATA_LEN) + 8,
    };
    let mut b = [0u8; 28];
    b[0..20].copy_from_slice(&header.encode());
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b
}

/// A complete `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: `hole_len` bytes (nonzero) starting at
/// byte `offset` read as zeros.
pub fn encode_offset_hole(handle: u64, offset: u64, hole_len: u32, done: bool) -> [u8; 32] {
    let header = ChunkHeader { flags: done_flag(done), chunk_type: NBD_REPLY_TYPE_OFFSET_HOLE, handle, length: 12 };
    let mut b = [0u8; 32];
    b[0..20].copy_from_slice(&header.encode());
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b[28..32].copy_from_slice(&hole_len.to_be_bytes());
    b
}

/// A complete `NBD_REPLY_TYPE_NONE` chunk; always carries `NBD_REPLY_FLAG_DONE`.
pub fn encode_none(handle: u64) -> [u8; CHUNK_HEADER_LEN] {
    ChunkHeader { flags: NBD_REPLY_FLAG_DONE, chunk_type: NBD_REPLY_TYPE_NONE, handle, length: 0 }.encode()
}

/// A complete `NBD_REPLY_TYPE_ERROR` chunk: 32-bit error, 16-bit message length,
/// message (cut to [`MAX_STRING_LEN`] bytes).
pub fn encode_error_chunk(handle: u64, error: Errno, message: &str, done: bool) -> Vec<u8> {
    let message = truncate_str(message, MAX_STRING_LEN);
    let header = ChunkHeader {
        flags: done_flag(done),
        chunk_type: NBD_REPLY_TYPE_ERROR,
        handle,
        length: 6 + message.len() as u32,
    };
    let mut out = Vec::with_capacity(CHUNK_HEADER_LEN + 6 + message.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&error.wire_value().to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// One block status descriptor (proto.md, "`NBD_REPLY_TYPE_BLOCK_STATUS`").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDescriptor {
    /// Length of the extent in bytes (nonzero).
    pub length: u32,
    /// Status flags, for `base:allocation` a combination of `NBD_STATE_HOLE` and
    /// `NBD_STATE_ZERO`.
    pub status: u32,
}

/// The `base:allocation` status flags of an extent.
pub fn allocation_status(extent: &Extent) -> u32 {
    let mut status = 0;
    if extent.hole {
        status |= NBD_STATE_HOLE;
    }
    if extent.zero {
        status |= NBD_STATE_ZERO;
    }
    status
}

/// A complete `NBD_REPLY_TYPE_BLOCK_STATUS` chunk: 32-bit metadata context id, then per
/// descriptor a 32-bit length and 32-bit status. `descriptors` must not be empty and has
/// fewer than 2^29 entries (the server caps it far lower).
pub fn encode_block_status(handle: u64, context_id: u32, descriptors: &[BlockDescriptor], done: bool) -> Vec<u8> {
    let payload_len = 4 + 8 * descriptors.len();
    let header = ChunkHeader {
        flags: done_flag(done),
        chunk_type: NBD_REPLY_TYPE_BLOCK_STATUS,
        handle,
        length: u32::try_from(payload_len).unwrap_or(u32::MAX),
    };
    let mut out = Vec::with_capacity(CHUNK_HEADER_LEN + payload_len);
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&context_id.to_be_bytes());
    for d in descriptors {
        out.extend_from_slice(&d.length.to_be_bytes());
        out.extend_from_slice(&d.status.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_bytes() {
        let g = encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
    }

    #[test]
    fn request_round_trip() {
        for cmd in [
            Command::Read,
            Command::Write,
            Command::Disc,
            Command::Flush,
            Command::Trim,
            Command::Cache,
            Command::WriteZeroes,
            Command::BlockStatus,
            Command::Unsupported(42),
        ] {
            let r = Request {
                flags: NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
                command: cmd,
                handle: 0x0102_0304_0506_0708,
                offset: 0x1122_3344_5566_7788,
                length: 0xdead_beef,
            };
            let b = r.encode();
            assert_eq!(Request::parse(&b), Ok(r));
        }
    }

    #[test]
    fn request_exact_bytes() {
        let r = Request { flags: 1, command: Command::Write, handle: 7, offset: 512, length: 4096 };
        let b = r.encode();
        assert_eq!(
            b,
            [0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0x10, 0]
        );
    }

    #[test]
    fn request_bad_magic() {
        let mut b = Request { flags: 0, command: Command::Read, handle: 1, offset: 0, length: 1 }.encode();
        b[0] ^= 0xff;
        assert!(matches!(Request::parse(&b), Err(WireError::BadMagic { .. })));
    }

    #[test]
    fn unknown_command_is_typed() {
        assert_eq!(Command::from_wire(8), Command::Unsupported(8));
        assert_eq!(Command::from_wire(0xffff).to_wire(), 0xffff);
    }

    #[test]
    fn option_header_round_trip() {
        let h = OptionHeader { option: NBD_OPT_GO, length: 77 };
        assert_eq!(OptionHeader::parse(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[3] = 0;
        assert!(OptionHeader::parse(&b).is_err());
    }

    #[test]
    fn option_reply_round_trip() {
        let bytes = encode_option_reply(NBD_OPT_LIST, NBD_REP_SERVER, b"abc");
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        h.copy_from_slice(&bytes[..20]);
        assert_eq!(
            OptionReplyHeader::parse(&h),
            Ok(OptionReplyHeader { option: NBD_OPT_LIST, reply_type: NBD_REP_SERVER, length: 3 })
        );
        assert_eq!(&bytes[..8], &[0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9]);
        assert_eq!(&bytes[20..], b"abc");
    }

    #[test]
    fn simple_reply_round_trip() {
        let r = SimpleReply { error: Errno::Einval.wire_value(), handle: 99 };
        let b = r.encode();
        assert_eq!(&b[..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(&b[4..8], &[0, 0, 0, 22]);
        assert_eq!(SimpleReply::parse(&b), Ok(r));
    }

    #[test]
    fn chunk_header_round_trip() {
        let h = ChunkHeader { flags: 1, chunk_type: NBD_REPLY_TYPE_ERROR, handle: 5, length: 9 };
        let b = h.encode();
        assert_eq!(&b[..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(ChunkHeader::parse(&b), Ok(h));
    }

    fn header_of(b: &[u8]) -> ChunkHeader {
        let mut h = [0u8; CHUNK_HEADER_LEN];
        h.copy_from_slice(&b[..CHUNK_HEADER_LEN]);
        ChunkHeader::parse(&h).unwrap()
    }

    #[test]
    fn offset_data_and_hole_chunks() {
        let d = encode_offset_data_header(3, 4096, 512, false);
        let h = header_of(&d);
        assert_eq!(h, ChunkHeader { flags: 0, chunk_type: 1, handle: 3, length: 520 });
        assert_eq!(&d[20..], &4096u64.to_be_bytes());

        let hole = encode_offset_hole(3, 8192, 1024, true);
        let h = header_of(&hole);
        assert_eq!(h, ChunkHeader { flags: 1, chunk_type: 2, handle: 3, length: 12 });
        assert_eq!(&hole[20..28], &8192u64.to_be_bytes());
        assert_eq!(&hole[28..], &1024u32.to_be_bytes());
    }

    #[test]
    fn none_and_error_chunks() {
        let n = encode_none(8);
        assert_eq!(header_of(&n), ChunkHeader { flags: 1, chunk_type: 0, handle: 8, length: 0 });

        let e = encode_error_chunk(8, Errno::Enospc, "full", true);
        let h = header_of(&e);
        assert_eq!(h, ChunkHeader { flags: 1, chunk_type: 0x8001, handle: 8, length: 10 });
        assert_eq!(&e[20..24], &28u32.to_be_bytes());
        assert_eq!(&e[24..26], &4u16.to_be_bytes());
        assert_eq!(&e[26..], b"full");

        let long = "é".repeat(3000); // 6000 bytes, cut on a char boundary
        let e = encode_error_chunk(1, Errno::Eio, &long, true);
        let h = header_of(&e);
        assert_eq!(h.length as usize, e.len() - CHUNK_HEADER_LEN);
        assert!(h.length as usize - 6 <= MAX_STRING_LEN);
    }

    #[test]
    fn block_status_chunk() {
        let d = [
            BlockDescriptor { length: 4096, status: NBD_STATE_HOLE | NBD_STATE_ZERO },
            BlockDescriptor { length: 512, status: 0 },
        ];
        let b = encode_block_status(4, 1, &d, true);
        let h = header_of(&b);
        assert_eq!(h, ChunkHeader { flags: 1, chunk_type: 5, handle: 4, length: 20 });
        assert_eq!(&b[20..24], &1u32.to_be_bytes());
        assert_eq!(&b[24..28], &4096u32.to_be_bytes());
        assert_eq!(&b[28..32], &3u32.to_be_bytes());
        assert_eq!(&b[32..36], &512u32.to_be_bytes());
        assert_eq!(&b[36..40], &0u32.to_be_bytes());
    }

    #[test]
    fn info_request_round_trip_and_validation() {
        let r = InfoRequest { name: "vol".into(), requests: vec![NBD_INFO_BLOCK_SIZE, 99] };
        let b = r.encode();
        assert_eq!(InfoRequest::parse(&b), Ok(r));
        // name length past the end
        assert_eq!(InfoRequest::parse(&[0, 0, 0, 9, b'a', 0, 0]), Err(OptionDataError::BadLength));
        // count does not match the remaining bytes
        assert_eq!(InfoRequest::parse(&[0, 0, 0, 0, 0, 2, 0, 3]), Err(OptionDataError::BadLength));
        // trailing byte
        assert_eq!(InfoRequest::parse(&[0, 0, 0, 0, 0, 0, 1]), Err(OptionDataError::BadLength));
        // too short for the fixed fields
        assert_eq!(InfoRequest::parse(&[0, 0]), Err(OptionDataError::BadLength));
        // NUL in name
        assert_eq!(InfoRequest::parse(&[0, 0, 0, 1, 0, 0, 0]), Err(OptionDataError::BadString));
        // invalid UTF-8
        assert_eq!(InfoRequest::parse(&[0, 0, 0, 1, 0xff, 0, 0]), Err(OptionDataError::BadString));
    }

    #[test]
    fn meta_context_round_trip_and_validation() {
        let r = MetaContextRequest { export_name: "e".into(), queries: vec!["base:allocation".into(), "base:".into()] };
        assert_eq!(MetaContextRequest::parse(&r.encode()), Ok(r));
        // huge count with no data
        assert_eq!(MetaContextRequest::parse(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]), Err(OptionDataError::BadLength));
        // query length past the end
        assert_eq!(
            MetaContextRequest::parse(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5, b'a']),
            Err(OptionDataError::BadLength)
        );
        // trailing garbage
        assert_eq!(MetaContextRequest::parse(&[0, 0, 0, 0, 0, 0, 0, 0, 1]), Err(OptionDataError::BadLength));
    }

    #[test]
    fn info_payloads() {
        let e = encode_info_export(1 << 30, 0x0d);
        assert_eq!(&e[..2], &[0, 0]);
        assert_eq!(&e[2..10], &(1u64 << 30).to_be_bytes());
        assert_eq!(&e[10..], &[0, 0x0d]);
        let b = encode_info_block_size(1, 4096, 1 << 25);
        assert_eq!(&b[..2], &[0, 3]);
        assert_eq!(&b[2..6], &1u32.to_be_bytes());
        assert_eq!(&b[6..10], &4096u32.to_be_bytes());
        assert_eq!(&b[10..], &(1u32 << 25).to_be_bytes());
        let n = encode_info_string(NBD_INFO_NAME, "x");
        assert_eq!(n, vec![0, 1, b'x']);
        let s = encode_rep_server("ab", "desc");
        assert_eq!(s, [&[0u8, 0, 0, 2][..], b"ab", b"desc"].concat());
        let m = encode_meta_context(1, BASE_ALLOCATION);
        assert_eq!(&m[..4], &[0, 0, 0, 1]);
        assert_eq!(&m[4..], BASE_ALLOCATION.as_bytes());
    }

    #[test]
    fn export_name_reply() {
        let r = encode_export_name_reply(4096, 1, false);
        assert_eq!(r.len(), 134);
        assert!(r[10..].iter().all(|&b| b == 0));
        let r = encode_export_name_reply(4096, 1, true);
        assert_eq!(r, [0, 0, 0, 0, 0, 0, 0x10, 0, 0, 1]);
    }

    #[test]
    fn truncation_on_char_boundary() {
        assert_eq!(truncate_str("abc", 2), "ab");
        assert_eq!(truncate_str("aé", 2), "a");
        assert_eq!(truncate_str("aé", 3), "aé");
    }
}
