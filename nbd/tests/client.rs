//! The NBD client's handshake (`nbd::client`) against real servers: this crate's own
//! server on a TCP port and on a unix socket, qemu-nbd, and nbdkit in old-style mode;
//! each refusal is its own error; the socket handed back is in the transmission phase
//! (a WRITE and a READ go through it).

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::mem_export::{MemExport, MemRegistry};
use nbd::client::{connect, HandshakeError, Stream, Target};
use nbd::proto::*;
use nbd::ServerConfig;

const T: Duration = Duration::from_secs(10);

/// This crate's server on a loopback port and a unix socket in `dir`, on a runtime
/// thread of its own (the client under test blocks).
fn serve(dir: &Path) -> (String, std::path::PathBuf) {
    let mut r = MemRegistry::default()
        .with("disk", MemExport::new(1 << 20))
        .with("ro", MemExport::new(2 << 20).read_only())
        .with("secret", MemExport::new(1 << 20));
    r.denied.push("secret".into());
    let registry = Arc::new(r);
    let sock = dir.join("nbd.sock");
    let (tx, rx) = std::sync::mpsc::channel();
    let sock2 = sock.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let unix = tokio::net::UnixListener::bind(&sock2).unwrap();
            tx.send(tcp.local_addr().unwrap().to_string()).unwrap();
            let config = Arc::new(ServerConfig::default());
            let never = std::future::pending::<()>();
            let _ = tokio::join!(
                nbd::serve_tcp(tcp, registry.clone(), config.clone(), std::future::pending::<()>()),
                nbd::serve_unix(unix, registry, config, never),
            );
        });
    });
    (rx.recv().unwrap(), sock)
}

/// One request on a transmission-phase socket; the simple reply's error and data.
fn request(s: &mut Stream, cmd: u16, offset: u64, len: u32, payload: &[u8]) -> (u32, Vec<u8>) {
    let mut h = Vec::with_capacity(28 + payload.len());
    h.extend_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h.extend_from_slice(&cmd.to_be_bytes());
    h.extend_from_slice(&7u64.to_be_bytes());
    h.extend_from_slice(&offset.to_be_bytes());
    h.extend_from_slice(&len.to_be_bytes());
    h.extend_from_slice(payload);
    s.write_all(&h).unwrap();
    let mut r = [0u8; 16];
    s.read_exact(&mut r).unwrap();
    assert_eq!(u32::from_be_bytes(r[0..4].try_into().unwrap()), NBD_SIMPLE_REPLY_MAGIC);
    assert_eq!(u64::from_be_bytes(r[8..16].try_into().unwrap()), 7, "handle");
    let err = u32::from_be_bytes(r[4..8].try_into().unwrap());
    let mut data = vec![0u8; if cmd == NBD_CMD_READ && err == 0 { len as usize } else { 0 }];
    s.read_exact(&mut data).unwrap();
    (err, data)
}

#[test]
fn go_opens_the_export_and_hands_back_a_socket_in_transmission() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, sock) = serve(dir.path());
    for target in [Target::Tcp(addr.clone()), Target::Unix(sock.clone())] {
        let (mut s, info) = connect(&target, "disk", T, None).unwrap();
        assert_eq!(info.size, 1 << 20);
        assert!(!info.read_only() && info.can_flush() && info.can_fua() && info.can_trim(), "{info:?}");
        let bs = info.block_size.expect("block size constraints");
        assert!(bs.minimum >= 1 && bs.minimum <= bs.preferred && bs.preferred <= bs.maximum, "{bs:?}");
        let (err, _) = request(&mut s, NBD_CMD_WRITE, 4096, 4096, &[0x5a; 4096]);
        assert_eq!(err, 0);
        let (err, data) = request(&mut s, NBD_CMD_READ, 4096, 4096, &[]);
        assert_eq!((err, data), (0, vec![0x5a; 4096]));
        let (err, _) = request(&mut s, NBD_CMD_READ, 1 << 20, 4096, &[]);
        assert_ne!(err, 0, "a read past the end must fail");
    }
    let (_, info) = connect(&Target::Tcp(addr), "ro", T, None).unwrap();
    assert!(info.read_only());
    assert_eq!(info.size, 2 << 20);
}

#[test]
fn each_refusal_is_its_own_error() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, _sock) = serve(dir.path());
    let tcp = Target::Tcp(addr);
    match connect(&tcp, "nothing", T, None) {
        Err(HandshakeError::UnknownExport { name, .. }) => assert_eq!(name, "nothing"),
        other => panic!("{other:?}"),
    }
    match connect(&tcp, "secret", T, None) {
        Err(e @ HandshakeError::Refused { .. }) => assert!(e.to_string().contains("refuses export \"secret\""), "{e}"),
        other => panic!("{other:?}"),
    }
    // Nobody listening (a socket bound but not listening holds the port, so no other
    // test can take it meanwhile, and connections to it are refused); something that
    // is not NBD.
    let bound = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    bound.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
    let port = bound.local_addr().unwrap().as_socket().unwrap().port();
    assert!(matches!(
        connect(&Target::Tcp(format!("127.0.0.1:{port}")), "disk", T, None),
        Err(HandshakeError::Io { .. })
    ));
    drop(bound);
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http_addr = http.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = http.accept() {
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        }
    });
    match connect(&Target::Tcp(http_addr), "disk", T, None) {
        Err(e @ HandshakeError::NotNbd { .. }) => assert!(e.to_string().contains("not NBDMAGIC"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// Waits until `sock` accepts connections (or the child exits).
fn wait_socket(child: &mut Child, sock: &Path) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "the server exited");
        assert!(t.elapsed() < Duration::from_secs(20), "the server does not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(program: &str, args: &[&str]) -> Killed {
    match Command::new(program).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
        Ok(c) => Killed(c),
        Err(e) => panic!("{program} does not run ({e}): install it (scripts/install-test-deps.sh)"),
    }
}

#[test]
fn qemu_nbd_exports_open_with_their_flags() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 3 << 20]).unwrap();
    let sock = dir.path().join("q.sock");
    let img_s = img.to_str().unwrap();
    let sock_s = sock.to_str().unwrap();
    let mut q = spawn("qemu-nbd", &["--persistent", "--shared=4", "-x", "exp", "-f", "raw", "-k", sock_s, img_s]);
    wait_socket(&mut q.0, &sock);
    let (mut s, info) = connect(&Target::Unix(sock.clone()), "exp", T, None).unwrap();
    assert_eq!(info.size, 3 << 20);
    assert!(info.multi_conn() && !info.read_only() && info.can_write_zeroes(), "{info:?}");
    assert_eq!(request(&mut s, NBD_CMD_WRITE, 0, 512, &[9; 512]).0, 0);
    assert_eq!(request(&mut s, NBD_CMD_READ, 0, 512, &[]).1, vec![9; 512]);
    assert!(matches!(connect(&Target::Unix(sock), "other", T, None), Err(HandshakeError::UnknownExport { .. })));
    drop(q);
    let ro_sock = dir.path().join("r.sock");
    let mut r =
        spawn("qemu-nbd", &["--persistent", "-r", "-x", "exp", "-f", "raw", "-k", ro_sock.to_str().unwrap(), img_s]);
    wait_socket(&mut r.0, &ro_sock);
    assert!(connect(&Target::Unix(ro_sock), "exp", T, None).unwrap().1.read_only());
}

#[test]
fn an_old_style_server_is_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("k.sock");
    let mut k = spawn("nbdkit", &["-f", "--oldstyle", "-U", sock.to_str().unwrap(), "memory", "1M"]);
    wait_socket(&mut k.0, &sock);
    match connect(&Target::Unix(sock), "", T, None) {
        Err(e @ HandshakeError::NotNbd { .. }) => assert!(e.to_string().contains("old-style"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// A scripted server: greets, reads the client's flags and its option, then sends
/// `replies` (type, data) to NBD_OPT_GO (or to `option` when given) and closes.
fn scripted(replies: Vec<(u32, Vec<u8>)>, option: u32) -> Target {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let _ = c.write_all(&encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES));
        let mut flags = [0u8; 4];
        let mut header = [0u8; OPTION_HEADER_LEN];
        if c.read_exact(&mut flags).is_err() || c.read_exact(&mut header).is_err() {
            return;
        }
        let h = OptionHeader::parse(&header).unwrap();
        let mut data = vec![0u8; h.length as usize];
        let _ = c.read_exact(&mut data);
        for (t, d) in replies {
            if c.write_all(&encode_option_reply(option, t, &d)).is_err() {
                return;
            }
        }
    });
    Target::Tcp(addr)
}

#[test]
fn a_hostile_or_odd_server_is_refused_with_a_reason() {
    let export = |size: u64| encode_info_export(size, NBD_FLAG_HAS_FLAGS).to_vec();
    let protocol =
        |replies: Vec<(u32, Vec<u8>)>, option: u32, want: &str| match connect(&scripted(replies, option), "x", T, None)
        {
            Err(e @ HandshakeError::Protocol { .. }) => assert!(e.to_string().contains(want), "{e}: want {want:?}"),
            other => panic!("want a protocol error with {want:?}, got {other:?}"),
        };
    protocol(
        vec![(NBD_REP_INFO, export(1 << 20)), (NBD_REP_INFO, export(2 << 20)), (NBD_REP_ACK, vec![])],
        NBD_OPT_GO,
        "two different NBD_INFO_EXPORT",
    );
    protocol(vec![(NBD_REP_INFO, vec![0, 99, 1, 2]); 100], NBD_OPT_GO, "more than 64 replies");
    protocol(vec![(NBD_REP_ACK, vec![])], NBD_OPT_GO, "without NBD_INFO_EXPORT");
    protocol(vec![(NBD_REP_ACK, vec![])], NBD_OPT_LIST, "while waiting for NBD_OPT_GO");
    protocol(vec![(NBD_REP_INFO, export(u64::MAX)), (NBD_REP_ACK, vec![])], NBD_OPT_GO, "an export of");
    protocol(
        vec![(NBD_REP_INFO, encode_info_block_size(3, 4096, 1 << 20).to_vec()), (NBD_REP_ACK, vec![])],
        NBD_OPT_GO,
        "block size constraints",
    );
    assert!(matches!(
        connect(&scripted(vec![(NBD_REP_ERR_TLS_REQD, vec![])], NBD_OPT_GO), "x", T, None),
        Err(HandshakeError::TlsRequired { .. })
    ));
    assert!(matches!(
        connect(&scripted(vec![(NBD_REP_ERR_UNSUP, vec![])], NBD_OPT_GO), "x", T, None),
        Err(HandshakeError::GoUnsupported { .. })
    ));
    // Unknown info types are skipped; a good answer after them opens the export.
    let (_, info) = connect(
        &scripted(vec![(NBD_REP_INFO, vec![0, 99]), (NBD_REP_INFO, export(4096)), (NBD_REP_ACK, vec![])], NBD_OPT_GO),
        "x",
        T,
        None,
    )
    .unwrap();
    assert_eq!(info.size, 4096);
}

/// A server like [`serve`]'s on TCP only, with TLS required and the test certificate
/// (`nbd::testing::TEST_CERT_PEM`, a self-signed CA certificate, which no verifier
/// takes as a server's own).
fn serve_tls_required() -> String {
    let registry = Arc::new(MemRegistry::default().with("disk", MemExport::new(1 << 20)));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _ = rt.block_on(async move {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(tcp.local_addr().unwrap().to_string()).unwrap();
            let tls = nbd::NbdTls {
                mode: nbd::TlsMode::Required,
                source: Arc::new(nbd::testing::test_tls_config()) as Arc<dyn nbd::TlsSource>,
            };
            let config = Arc::new(ServerConfig { tls: Some(tls), ..ServerConfig::default() });
            nbd::serve_tcp(tcp, registry, config, std::future::pending::<()>()).await
        });
    });
    rx.recv().unwrap()
}

/// `nbds://` (`Target::Tls`): without credentials, against a server that offers no TLS,
/// and against a certificate the client cannot verify, each a `Tls` error that says
/// which; a plain client of a TLS-only server gets `TlsRequired`. (The success path
/// needs the kernel's TLS: server/tests/nbd_tls.rs runs it in a VM.)
#[test]
fn tls_refusals_are_errors_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("creds");
    std::fs::create_dir_all(&creds).unwrap();
    for f in ["ca.crt", "tls.crt"] {
        std::fs::write(creds.join(f), nbd::testing::TEST_CERT_PEM).unwrap();
    }
    std::fs::write(creds.join("tls.key"), nbd::testing::TEST_KEY_PEM).unwrap();
    let tls = nbd::client::ClientTls::load(&creds).unwrap();
    let tls_message = |r: Result<(Stream, nbd::client::ExportInfo), HandshakeError>| match r {
        Err(HandshakeError::Tls { message, .. }) => message,
        other => panic!("not a TLS error: {other:?}"),
    };

    let (plain, _) = serve(dir.path());
    let m = tls_message(connect(&Target::Tls(plain.clone()), "disk", T, None));
    assert!(m.contains("credentials"), "{m}");
    let m = tls_message(connect(&Target::Tls(plain), "disk", T, Some(&tls)));
    assert!(m.contains("does not offer TLS"), "{m}");

    let required = serve_tls_required();
    assert!(matches!(
        connect(&Target::Tcp(required.clone()), "disk", T, None),
        Err(HandshakeError::TlsRequired { .. })
    ));
    let m = tls_message(connect(&Target::Tls(required), "disk", T, Some(&tls)));
    assert!(m.starts_with("TLS: ") && m.contains("certificate"), "{m}");

    // Files that do not load are named.
    std::fs::write(creds.join("tls.key"), "not a key").unwrap();
    let e = nbd::client::ClientTls::load(&creds).unwrap_err();
    assert!(e.to_string().contains("tls.key"), "{e}");
}
