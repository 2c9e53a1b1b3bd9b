//! An NBD client's handshake (proto.md "Fixed newstyle negotiation" and
//! "NBD_OPT_GO"): connects over TCP or a unix socket, opens one export with
//! `NBD_OPT_GO` and hands back the connected socket, positioned at the start of the
//! transmission phase, with what the export offers. For a kernel attach (the socket is
//! given to the kernel's NBD driver) and for reconnects.
//!
//! Over TLS ([`Target::Tls`], proto.md "TLS support"): `NBD_OPT_STARTTLS` first, the
//! TLS 1.3 handshake (rustls, mutual: the client shows the certificate of
//! [`ClientTls`]), the option haggling inside it, then the session is handed to the
//! kernel ([`crate::ktls`]): the returned socket reads and writes plain NBD, and the
//! kernel's NBD driver can be given it.
//!
//! Blocking, on std sockets with timeouts: it runs once per connection, outside any
//! data path. Not here: the transmission phase (the kernel does it; tests speak it
//! themselves), the old-style and non-fixed handshakes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::proto::*;

/// Where an NBD server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `HOST:PORT` over TCP.
    Tcp(String),
    /// `HOST:PORT` over TCP with TLS (`nbds://`); `HOST` is the name the server's
    /// certificate must carry.
    Tls(String),
    /// A unix socket.
    Unix(PathBuf),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(a) => f.write_str(a),
            Target::Tls(a) => write!(f, "tls:{a}"),
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Block size constraints of an export (proto.md "Block size constraints"), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    /// Smallest addressable block.
    pub minimum: u32,
    /// Preferred block size.
    pub preferred: u32,
    /// Largest request payload.
    pub maximum: u32,
}

/// What an export offers, from the server's `NBD_INFO_EXPORT` and
/// `NBD_INFO_BLOCK_SIZE` replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// The export name opened.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// Block size constraints, if the server gave them.
    pub block_size: Option<BlockSize>,
    /// The server's description of the export (`NBD_INFO_DESCRIPTION`), if it gave one.
    pub description: Option<String>,
}

/// What a ferrovol storage host tells of its past in each export's description: its
/// pool and its *crash generation*, a number that grows each time the server starts
/// after a run that did not stop cleanly. Within one generation every write the server
/// acknowledged is still there after a restart (a clean stop commits everything); across
/// generations, writes acknowledged but not yet flushed may be lost. The reconnect
/// watcher hands a device new sockets only within its generation.
///
/// Written as `crash-generation POOL.N` (the pool's 12-hex-digit id) at the end of the
/// description; servers that are not ferrovol give none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashGeneration {
    /// The pool's short id.
    pub pool: String,
    /// Unclean restarts of this pool's server so far.
    pub generation: u64,
}

impl CrashGeneration {
    const TAG: &'static str = "crash-generation ";

    /// The text the server appends to its descriptions.
    pub fn tag(&self) -> String {
        format!("{}{}.{}", Self::TAG, self.pool, self.generation)
    }

    /// Finds the tag in a description.
    pub fn find(description: &str) -> Option<CrashGeneration> {
        let at = description.rfind(Self::TAG)? + Self::TAG.len();
        let word = description[at..].split_whitespace().next()?;
        let (pool, generation) = word.rsplit_once('.')?;
        if pool.is_empty() || !pool.chars().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        Some(CrashGeneration { pool: pool.to_string(), generation: generation.parse().ok()? })
    }

    /// Parses `POOL.N`, as [`std::fmt::Display`] writes it.
    pub fn parse(s: &str) -> Option<CrashGeneration> {
        CrashGeneration::find(&format!("{}{s}", Self::TAG))
    }
}

impl std::fmt::Display for CrashGeneration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.pool, self.generation)
    }
}

/// What a ferrovol storage host writes in the description of a volume created empty
/// and never written since (it reads as zeros and holds no file system, so a node may
/// format it).
pub const NEVER_WRITTEN: &str = "never written";

impl ExportInfo {
    /// The server says the export was created empty and never written since
    /// ([`NEVER_WRITTEN`] in its description; only a ferrovol storage host says it).
    pub fn never_written(&self) -> bool {
        self.description
            .as_deref()
            .is_some_and(|d| d.split(';').next().unwrap_or_default().contains(&format!(", {NEVER_WRITTEN}")))
    }

    /// The server's crash generation, if it tells it (a ferrovol storage host does).
    pub fn crash_generation(&self) -> Option<CrashGeneration> {
        self.description.as_deref().and_then(CrashGeneration::find)
    }
    /// `NBD_FLAG_READ_ONLY`.
    pub fn read_only(&self) -> bool {
        self.flags & NBD_FLAG_READ_ONLY != 0
    }
    /// `NBD_FLAG_CAN_MULTI_CONN`: several connections see each other's flushed writes.
    pub fn multi_conn(&self) -> bool {
        self.flags & NBD_FLAG_CAN_MULTI_CONN != 0
    }
    /// `NBD_FLAG_SEND_FLUSH`.
    pub fn can_flush(&self) -> bool {
        self.flags & NBD_FLAG_SEND_FLUSH != 0
    }
    /// `NBD_FLAG_SEND_FUA`.
    pub fn can_fua(&self) -> bool {
        self.flags & NBD_FLAG_SEND_FUA != 0
    }
    /// `NBD_FLAG_SEND_TRIM`.
    pub fn can_trim(&self) -> bool {
        self.flags & NBD_FLAG_SEND_TRIM != 0
    }
    /// `NBD_FLAG_SEND_WRITE_ZEROES`.
    pub fn can_write_zeroes(&self) -> bool {
        self.flags & NBD_FLAG_SEND_WRITE_ZEROES != 0
    }
}

/// A connected socket in the transmission phase.
#[derive(Debug)]
pub enum Stream {
    /// Over TCP (`TCP_NODELAY` set).
    Tcp(TcpStream),
    /// Over a unix socket.
    Unix(UnixStream),
}

impl Stream {
    fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
            Stream::Unix(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl IntoRawFd for Stream {
    fn into_raw_fd(self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.into_raw_fd(),
            Stream::Unix(s) => s.into_raw_fd(),
        }
    }
}

/// A handshake that did not open the export.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Connecting, reading or writing failed (refused, reset, timed out).
    #[error("NBD connection to {target} failed")]
    Io {
        /// Where.
        target: String,
        /// What.
        #[source]
        source: std::io::Error,
    },
    /// The peer does not speak the newstyle NBD handshake (wrong magic, old style, or
    /// not fixed newstyle).
    #[error("{target} is not an NBD server of the fixed newstyle handshake: {why}")]
    NotNbd {
        /// Where.
        target: String,
        /// What was wrong.
        why: String,
    },
    /// The server has no export of that name (`NBD_REP_ERR_UNKNOWN`).
    #[error("{target} has no export {name:?}{}", shown(.message))]
    UnknownExport {
        /// Where.
        target: String,
        /// The name asked for.
        name: String,
        /// The server's message.
        message: String,
    },
    /// The server refuses this client the export (`NBD_REP_ERR_POLICY`): for ferrovol,
    /// an export name without a valid attachment key, or a node the volume is not
    /// published to.
    #[error("{target} refuses export {name:?} to this client{}", shown(.message))]
    Refused {
        /// Where.
        target: String,
        /// The name asked for.
        name: String,
        /// The server's message.
        message: String,
    },
    /// The server requires TLS first (`NBD_REP_ERR_TLS_REQD`) and the URI was not an
    /// `nbds://` one.
    #[error("{target} requires TLS: use nbds:// with the client's TLS credentials")]
    TlsRequired {
        /// Where.
        target: String,
    },
    /// TLS failed: the server offers none, a certificate was refused (either side's), the
    /// credentials are missing, or the kernel cannot take the session ([`crate::ktls`]).
    #[error("{target}: {message}")]
    Tls {
        /// Where.
        target: String,
        /// What.
        message: String,
    },
    /// The server does not know `NBD_OPT_GO` (`NBD_REP_ERR_UNSUP`); this client needs it.
    #[error("{target} does not support NBD_OPT_GO (proto.md; a server older than 2016?)")]
    GoUnsupported {
        /// Where.
        target: String,
    },
    /// Any other error reply, or a reply this client cannot take.
    #[error("{target}: {message}")]
    Protocol {
        /// Where.
        target: String,
        /// What.
        message: String,
    },
}

fn shown(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

/// The largest option reply this client reads, in bytes: far above any `NBD_REP_INFO`.
const MAX_REPLY: u32 = 64 * 1024;

/// The most replies to `NBD_OPT_GO` this client reads before it gives up.
const MAX_REPLIES: usize = 64;

/// A client's credentials for NBD over TLS, from a directory in the layout of a
/// Kubernetes TLS Secret (what cert-manager writes): `ca.crt`, the CA certificates the
/// server's certificate must chain to; `tls.crt`, the client's certificate chain, leaf
/// first; `tls.key`, its private key. The session is TLS 1.3 with
/// ChaCha20-Poly1305 only, so that it can be handed to the kernel ([`crate::ktls`]).
#[derive(Clone)]
pub struct ClientTls {
    config: std::sync::Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// The CA file's name in a credentials directory.
    pub const CA: &'static str = "ca.crt";
    /// The certificate file's name.
    pub const CERT: &'static str = "tls.crt";
    /// The private key file's name.
    pub const KEY: &'static str = "tls.key";

    /// Loads the credentials in `dir` (read afresh by each call: a renewed certificate
    /// is used from the next connection on).
    ///
    /// Errors: `InvalidInput` naming the file that is missing or does not load.
    pub fn load(dir: &std::path::Path) -> std::io::Result<ClientTls> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what} {}: {e}", path.display()))
        };
        let certs = |path: &std::path::Path| -> std::io::Result<Vec<CertificateDer<'static>>> {
            let v = CertificateDer::pem_file_iter(path)
                .map_err(|e| bad("read", path, &e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("parse", path, &e))?;
            if v.is_empty() {
                return Err(bad("no certificate in", path, &"empty"));
            }
            Ok(v)
        };
        let (ca, cert, key) = (dir.join(Self::CA), dir.join(Self::CERT), dir.join(Self::KEY));
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&ca)? {
            roots.add(c).map_err(|e| bad("CA certificate in", &ca, &e))?;
        }
        let chain = certs(&cert)?;
        let private = PrivateKeyDer::from_pem_file(&key).map_err(|e| bad("read a private key from", &key, &e))?;
        let provider = rustls::crypto::CryptoProvider {
            cipher_suites: vec![crate::ktls::cipher_suite()],
            ..rustls::crypto::ring::default_provider()
        };
        let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| bad("TLS 1.3 for", &cert, &e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, private)
            .map_err(|e| bad("the key does not suit the certificate", &key, &e))?;
        config.enable_secret_extraction = true;
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls { config: std::sync::Arc::new(config) })
    }
}

/// The host of `HOST:PORT` (`[V6]:PORT` too), as the server's certificate must name it.
fn server_name(addr: &str) -> Option<rustls::pki_types::ServerName<'static>> {
    let host = match addr.strip_prefix('[') {
        Some(rest) => rest.split_once(']')?.0,
        None => addr.rsplit_once(':').map_or(addr, |(h, _)| h),
    };
    rustls::pki_types::ServerName::try_from(host.to_string()).ok()
}

/// Connects to `target`, opens export `name` with `NBD_OPT_GO` (asking for its block
/// size constraints), and returns the socket in the transmission phase with what the
/// export offers. Each read, write and the connect itself may take `timeout`; the
/// socket is returned without timeouts. A [`Target::Tls`] needs `tls` (ignored for the
/// others) and the kernel's TLS: its socket is returned with the session handed to the
/// kernel.
///
/// Errors: [`HandshakeError`], one variant per way a handshake fails.
pub fn connect(
    target: &Target,
    name: &str,
    timeout: Duration,
    tls: Option<&ClientTls>,
) -> Result<(Stream, ExportInfo), HandshakeError> {
    let where_ = target.to_string();
    let io = |source: std::io::Error| HandshakeError::Io { target: where_.clone(), source };
    let tls_err = |message: String| HandshakeError::Tls { target: where_.clone(), message };
    let mut s = match target {
        Target::Tcp(addr) | Target::Tls(addr) => {
            use std::net::ToSocketAddrs;
            let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the address resolves to nothing");
            let mut got = None;
            for a in addr.to_socket_addrs().map_err(io)? {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        got = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            let s = got.ok_or_else(|| io(last))?;
            s.set_nodelay(true).map_err(io)?;
            // A peer that vanishes without a word (a host powered off, a cut network)
            // is noticed: keepalive probes after 30 s of silence, and unacknowledged data
            // fails the socket after 60 s.
            let sock = socket2::SockRef::from(&s);
            let ka = socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(30))
                .with_interval(Duration::from_secs(10))
                .with_retries(3);
            sock.set_tcp_keepalive(&ka).map_err(io)?;
            sock.set_tcp_user_timeout(Some(Duration::from_secs(60))).map_err(io)?;
            Stream::Tcp(s)
        }
        Target::Unix(p) => Stream::Unix(UnixStream::connect(p).map_err(io)?),
    };
    s.set_timeout(Some(timeout)).map_err(io)?;
    let info = match (target, s) {
        (Target::Tls(addr), Stream::Tcp(tcp)) => {
            let tls = tls.ok_or_else(|| tls_err("nbds:// needs the client's TLS credentials".into()))?;
            let sn = server_name(addr).ok_or_else(|| tls_err(format!("{addr:?} names no host")))?;
            let (tcp, info) = handshake_tls(tcp, &where_, name, tls, sn)?;
            s = Stream::Tcp(tcp);
            info
        }
        (_, mut plain) => {
            let info = handshake(&mut plain, &where_, name)?;
            s = plain;
            info
        }
    };
    s.set_timeout(None).map_err(io)?;
    Ok((s, info))
}

/// The greeting, `NBD_OPT_STARTTLS`, the TLS handshake, `NBD_OPT_GO` inside it, and the
/// session handed to the kernel.
fn handshake_tls(
    mut tcp: TcpStream,
    target: &str,
    name: &str,
    tls: &ClientTls,
    server_name: rustls::pki_types::ServerName<'static>,
) -> Result<(TcpStream, ExportInfo), HandshakeError> {
    let io = |source: std::io::Error| HandshakeError::Io { target: target.to_string(), source };
    let tls_err = |message: String| HandshakeError::Tls { target: target.to_string(), message };
    // A TLS failure surfaces as an I/O error carrying rustls's; named as what it is.
    let named = |e: HandshakeError| match e {
        HandshakeError::Io { source, .. } if source.get_ref().is_some_and(|i| i.is::<rustls::Error>()) => {
            tls_err(format!("TLS: {source}"))
        }
        other => other,
    };
    let client_flags = greet(&mut tcp, target)?;
    send_option(&mut tcp, target, &client_flags.to_be_bytes(), NBD_OPT_STARTTLS, &[])?;
    let (reply_type, data) = read_reply(&mut tcp, target, NBD_OPT_STARTTLS, "NBD_OPT_STARTTLS")?;
    if reply_type != NBD_REP_ACK {
        return Err(tls_err(format!(
            "the server does not offer TLS (reply {reply_type:#x} to NBD_OPT_STARTTLS{})",
            shown(&String::from_utf8_lossy(&data))
        )));
    }
    let conn = rustls::ClientConnection::new(std::sync::Arc::clone(&tls.config), server_name)
        .map_err(|e| tls_err(format!("TLS: {e}")))?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock).map_err(|e| named(io(e)))?;
    }
    let info = options(&mut stream, target, name, &[]).map_err(named)?;
    let rustls::StreamOwned { mut conn, sock } = stream;
    // Nothing may be left in rustls: the server says nothing after NBD_OPT_GO's
    // acknowledgement until the first request, and what rustls holds would be lost.
    let mut probe = [0u8; 1];
    let leftover = match std::io::Read::read(&mut conn.reader(), &mut probe) {
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        Ok(_) => true,
    };
    if leftover || conn.wants_write() {
        return Err(HandshakeError::Protocol {
            target: target.to_string(),
            message: "data after the acknowledgement of NBD_OPT_GO".into(),
        });
    }
    let secrets = conn.dangerous_extract_secrets().map_err(|e| tls_err(format!("TLS: {e}")))?;
    crate::ktls::enable(std::os::fd::AsFd::as_fd(&sock), secrets).map_err(|e| tls_err(e.to_string()))?;
    Ok((sock, info))
}

/// The handshake on a connected stream `s` (any `Read + Write`), for export `name`.
///
/// Errors: as [`connect`].
pub fn handshake<S: Read + Write>(s: &mut S, target: &str, name: &str) -> Result<ExportInfo, HandshakeError> {
    let client_flags = greet(s, target)?;
    options(s, target, name, &client_flags.to_be_bytes())
}

/// Reads the server's greeting and returns the client flags to answer it with.
fn greet<S: Read>(s: &mut S, target: &str) -> Result<u32, HandshakeError> {
    let io = |source: std::io::Error| HandshakeError::Io { target: target.to_string(), source };
    let not_nbd = |why: String| HandshakeError::NotNbd { target: target.to_string(), why };
    let mut greeting = [0u8; GREETING_LEN];
    s.read_exact(&mut greeting).map_err(io)?;
    let magic = u64::from_be_bytes(greeting[0..8].try_into().expect("8 bytes"));
    if magic != NBDMAGIC {
        return Err(not_nbd(format!("it greets with {magic:#018x}, not NBDMAGIC")));
    }
    let second = u64::from_be_bytes(greeting[8..16].try_into().expect("8 bytes"));
    if second != IHAVEOPT {
        return Err(not_nbd("it speaks the old-style handshake".into()));
    }
    let flags = u16::from_be_bytes([greeting[16], greeting[17]]);
    if flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(not_nbd("it does not offer the fixed newstyle handshake".into()));
    }
    Ok(NBD_FLAG_C_FIXED_NEWSTYLE | if flags & NBD_FLAG_NO_ZEROES != 0 { NBD_FLAG_C_NO_ZEROES } else { 0 })
}

/// Sends `prefix` (the client flags, or nothing once they went) and option `option`
/// with `data`.
fn send_option<S: Write>(
    s: &mut S,
    target: &str,
    prefix: &[u8],
    option: u32,
    data: &[u8],
) -> Result<(), HandshakeError> {
    let io = |source: std::io::Error| HandshakeError::Io { target: target.to_string(), source };
    let mut out = Vec::with_capacity(prefix.len() + OPTION_HEADER_LEN + data.len());
    out.extend_from_slice(prefix);
    out.extend_from_slice(&OptionHeader { option, length: data.len() as u32 }.encode());
    out.extend_from_slice(data);
    s.write_all(&out).map_err(io)?;
    s.flush().map_err(io)
}

/// Reads one reply to option `option` (`name` in messages): its type and data.
///
/// Errors: [`HandshakeError::Io`]; [`HandshakeError::Protocol`] for a malformed header, a
/// reply to another option, or one longer than [`MAX_REPLY`].
fn read_reply<S: Read>(s: &mut S, target: &str, option: u32, name: &str) -> Result<(u32, Vec<u8>), HandshakeError> {
    let io = |source: std::io::Error| HandshakeError::Io { target: target.to_string(), source };
    let proto = |message: String| HandshakeError::Protocol { target: target.to_string(), message };
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).map_err(io)?;
    let h = OptionReplyHeader::parse(&h).map_err(|e| proto(format!("option reply: {e}")))?;
    if h.option != option {
        return Err(proto(format!("a reply to option {} while waiting for {name}", h.option)));
    }
    if h.length > MAX_REPLY {
        return Err(proto(format!("an option reply of {} bytes", h.length)));
    }
    let mut data = vec![0u8; h.length as usize];
    s.read_exact(&mut data).map_err(io)?;
    Ok((h.reply_type, data))
}

/// Sends `prefix` (the client flags, or nothing once they went) and `NBD_OPT_GO` for
/// `name`, and reads the replies.
fn options<S: Read + Write>(s: &mut S, target: &str, name: &str, prefix: &[u8]) -> Result<ExportInfo, HandshakeError> {
    let proto = |message: String| HandshakeError::Protocol { target: target.to_string(), message };
    let go = InfoRequest { name: name.to_string(), requests: vec![NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION] }.encode();
    send_option(s, target, prefix, NBD_OPT_GO, &go)?;
    let (mut size_flags, mut block_size, mut description) = (None, None, None);
    for _ in 0..MAX_REPLIES {
        let (reply_type, data) = read_reply(s, target, NBD_OPT_GO, "NBD_OPT_GO")?;
        let message = || String::from_utf8_lossy(&data).into_owned();
        match reply_type {
            NBD_REP_INFO => {
                if data.len() < 2 {
                    return Err(proto("an NBD_REP_INFO without its type".into()));
                }
                match u16::from_be_bytes([data[0], data[1]]) {
                    NBD_INFO_EXPORT if data.len() == 12 => {
                        let size = u64::from_be_bytes(data[2..10].try_into().expect("8 bytes"));
                        let got = (size, u16::from_be_bytes([data[10], data[11]]));
                        if size > i64::MAX as u64 {
                            return Err(proto(format!("an export of {size} bytes")));
                        }
                        if size_flags.is_some_and(|f| f != got) {
                            return Err(proto("two different NBD_INFO_EXPORT replies".into()));
                        }
                        size_flags = Some(got);
                    }
                    NBD_INFO_BLOCK_SIZE if data.len() == 14 => {
                        let at = |i: usize| u32::from_be_bytes(data[i..i + 4].try_into().expect("4 bytes"));
                        let b = BlockSize { minimum: at(2), preferred: at(6), maximum: at(10) };
                        // proto.md "Block size constraints".
                        let sane = b.minimum.is_power_of_two()
                            && b.minimum <= 65536
                            && b.preferred.is_power_of_two()
                            && b.preferred >= b.minimum
                            && (b.maximum == u32::MAX || b.maximum.is_multiple_of(b.minimum))
                            && b.maximum >= b.minimum;
                        if !sane {
                            return Err(proto(format!("block size constraints that break proto.md: {b:?}")));
                        }
                        block_size = Some(b);
                    }
                    NBD_INFO_EXPORT | NBD_INFO_BLOCK_SIZE => {
                        return Err(proto(format!("an NBD_REP_INFO of the wrong length ({} bytes)", data.len())))
                    }
                    NBD_INFO_DESCRIPTION => description = Some(String::from_utf8_lossy(&data[2..]).into_owned()),
                    _ => {} // the name and later types: not needed
                }
            }
            NBD_REP_ACK => {
                let Some((size, flags)) = size_flags else {
                    return Err(proto("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into()));
                };
                return Ok(ExportInfo { name: name.to_string(), size, flags, block_size, description });
            }
            NBD_REP_ERR_UNKNOWN => {
                return Err(HandshakeError::UnknownExport {
                    target: target.to_string(),
                    name: name.to_string(),
                    message: message(),
                })
            }
            NBD_REP_ERR_POLICY => {
                return Err(HandshakeError::Refused {
                    target: target.to_string(),
                    name: name.to_string(),
                    message: message(),
                })
            }
            NBD_REP_ERR_TLS_REQD => return Err(HandshakeError::TlsRequired { target: target.to_string() }),
            NBD_REP_ERR_UNSUP => return Err(HandshakeError::GoUnsupported { target: target.to_string() }),
            t if t & NBD_REP_FLAG_ERROR != 0 => {
                return Err(proto(format!("the server refused NBD_OPT_GO with error {:#x}: {}", t, message())))
            }
            t => return Err(proto(format!("an unexpected reply type {t} to NBD_OPT_GO"))),
        }
    }
    Err(proto(format!("more than {MAX_REPLIES} replies to NBD_OPT_GO")))
}
