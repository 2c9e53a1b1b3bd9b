//! NBD over TLS (proto.md, "TLS support") against a real `ferrovol serve --nbd-tls`,
//! with qemu-io (gnutls, `tls-creds-x509`) and nbdinfo (libnbd, `nbds://` with
//! `tls-certificates`) as clients: data written over TLS reads back; in `required`
//! mode a client without TLS, with no certificate, or with a certificate of another CA
//! is refused and nothing it asked for runs; in `optional` mode plain and TLS clients
//! are both served.

mod common;

use std::path::{Path, PathBuf};

use common::certs::{ca, expired_client_leaf, leaf, write, Ca};
use common::*;

/// A client's credentials directory in gnutls's layout (what qemu's `tls-creds-x509`
/// and libnbd's `tls-certificates` read): `ca-cert.pem` to verify the server, and
/// with `signer` a `client-cert.pem` and `client-key.pem` it signed. The signer's CA
/// is in `ca-cert.pem` too: qemu refuses to present a certificate it cannot verify
/// itself, and the server, not the client, must be the one that refuses.
fn client_dir(root: &Path, tag: &str, trust: &Ca, signer: Option<&Ca>) -> PathBuf {
    let dir = root.join(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cas = trust.pem.clone();
    if let Some(signer) = signer.filter(|s| s.pem != trust.pem) {
        cas += &signer.pem;
    }
    write(&dir, "ca-cert.pem", &cas);
    if let Some(signer) = signer {
        let (cert, key) = leaf(signer, tag, &[], true);
        write(&dir, "client-cert.pem", &cert);
        write(&dir, "client-key.pem", &key);
    }
    dir
}

/// qemu-io on export `name` of the server at `port`, over TLS with the credentials in
/// `creds` (or in plain text with `None`).
fn qemu_io_tls(port: u16, name: &str, creds: Option<&Path>, cmds: &[&str]) -> std::process::Output {
    let mut c = peer("qemu-io");
    let mut opts = format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export={name}");
    if let Some(dir) = creds {
        c.args(["--object", &format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", dir.display())]);
        opts += ",tls-creds=tls0";
    }
    c.arg("--image-opts");
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(opts);
    output(&mut c)
}

/// Starts a server with `--nbd-tls MODE` and the TLS files of `ca1`.
fn start(td: &TestDir, mode: &str, ca1: &Ca) -> Server {
    start_with(td, mode, ca1, &[])
}

/// [`start`] with more arguments.
fn start_with(td: &TestDir, mode: &str, ca1: &Ca, more: &[&str]) -> Server {
    let dir = td.path();
    let (scert, skey) = leaf(ca1, "storage-1", &["127.0.0.1", "localhost"], false);
    let cert = write(dir, "server.pem", &scert);
    let key = write(dir, "server-key.pem", &skey);
    let client_ca = write(dir, "nodes-ca.pem", &ca1.pem);
    let mut args = vec![
        "--nbd-tls",
        mode,
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--nbd-tls-client-ca",
        client_ca.to_str().unwrap(),
    ];
    args.extend_from_slice(more);
    Server::start_with(&td.data(), "2GiB", &args)
}

#[test]
fn required_tls_serves_clients_of_the_configured_ca_and_refuses_the_rest() {
    require("qemu-io");
    require("nbdinfo");
    let td = TestDir::new();
    let (ca1, ca2) = (ca("ferrovol test CA"), ca("another CA"));
    let s = start(&td, "required", &ca1);
    s.create_volume("v", "8MiB");
    let good = client_dir(td.path(), "node-1", &ca1, Some(&ca1));
    let foreign = client_dir(td.path(), "intruder", &ca1, Some(&ca2));
    let anonymous = client_dir(td.path(), "anonymous", &ca1, None);

    // Written and read back over TLS by qemu (gnutls).
    let o = qemu_io_tls(s.port, "v", Some(&good), &["write -P 0x5a 0 64k", "flush", "read -P 0x5a 0 64k"]);
    assert!(qemu_io_succeeded(&o), "qemu-io over TLS: {}", text(&o));
    // nbdinfo (libnbd) over TLS sees the export.
    let uri = format!("nbds://127.0.0.1:{}/v?tls-certificates={}", s.port, good.display());
    let o = output(peer("nbdinfo").args(["--size", &uri]));
    assert!(o.status.success(), "nbdinfo over TLS: {}", text(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), (8u64 << 20).to_string());
    // nbdcopy (libnbd) writes over TLS what qemu-io then reads back; qemu-img reads the
    // export's size over TLS.
    require("nbdcopy");
    let src = td.path().join("pattern.bin");
    std::fs::write(&src, vec![0x3cu8; 1 << 20]).unwrap();
    let o = output(peer("nbdcopy").arg(&src).arg(&uri));
    assert!(o.status.success(), "nbdcopy over TLS: {}", text(&o));
    let o = qemu_io_tls(s.port, "v", Some(&good), &["read -P 0x3c 0 1M", "read -P 0 1M 64k"]);
    assert!(qemu_io_succeeded(&o), "nbdcopy's data over TLS: {}", text(&o));
    let o = output(peer("qemu-img").args([
        "info",
        "--object",
        &format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", good.display()),
        "--image-opts",
        &format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export=v,tls-creds=tls0", s.port),
    ]));
    assert!(o.status.success() && text(&o).contains("8 MiB"), "qemu-img info over TLS: {}", text(&o));
    // nbdcopy over TLS wrote 1 MiB of 0x3c; qemu-io wrote 64 KiB of 0x5a over part of it.
    let o = qemu_io_tls(s.port, "v", Some(&good), &["write -P 0x5a 0 64k"]);
    assert!(qemu_io_succeeded(&o), "{}", text(&o));

    // Refused: plain text, no client certificate, a certificate of another CA. None
    // of their writes land.
    let o = qemu_io_tls(s.port, "v", None, &["write -P 0x11 0 4k"]);
    assert!(!o.status.success(), "a plain client was served: {}", text(&o));
    assert!(text(&o).contains("TLS"), "the refusal names TLS: {}", text(&o));
    let o = output(peer("nbdinfo").args(["--size", &format!("nbd://127.0.0.1:{}/v", s.port)]));
    assert!(!o.status.success(), "nbdinfo in plain text was served: {}", text(&o));
    for creds in [&anonymous, &foreign] {
        let o = qemu_io_tls(s.port, "v", Some(creds), &["write -P 0x22 0 4k"]);
        assert!(!o.status.success(), "{} was served: {}", creds.display(), text(&o));
    }
    let o = qemu_io_tls(s.port, "v", Some(&good), &["read -P 0x5a 0 64k"]);
    assert!(qemu_io_succeeded(&o), "the data is untouched: {}", text(&o));
    assert!(s.log_text().contains("TLS handshake failed"), "the refused handshakes are logged");

    // SIGHUP reads the files again: the client CA becomes the other one, for new
    // sessions.
    std::fs::write(td.path().join("nodes-ca.pem"), &ca2.pem).unwrap();
    let o = output(std::process::Command::new("kill").args(["-HUP", &s.pid().to_string()]));
    assert!(o.status.success());
    let t0 = std::time::Instant::now();
    loop {
        let o = qemu_io_tls(s.port, "v", Some(&foreign), &["read -P 0x5a 0 64k"]);
        if qemu_io_succeeded(&o) {
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the reloaded CA is not in force: {}", text(&o));
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let o = qemu_io_tls(s.port, "v", Some(&good), &["read 0 4k"]);
    assert!(!o.status.success(), "the old CA still admits: {}", text(&o));
}

#[test]
fn optional_tls_serves_plain_and_tls_clients() {
    require("qemu-io");
    let td = TestDir::new();
    let ca1 = ca("ferrovol test CA");
    let s = start(&td, "optional", &ca1);
    s.create_volume("v", "8MiB");
    assert_eq!(json(&s.cli_ok(&["host", "info", "--json"]))["nbd_tls"], "optional", "host info tells the mode");
    let good = client_dir(td.path(), "node-1", &ca1, Some(&ca1));
    let o = qemu_io_tls(s.port, "v", None, &["write -P 0x33 0 64k", "flush"]);
    assert!(qemu_io_succeeded(&o), "plain: {}", text(&o));
    let o = qemu_io_tls(s.port, "v", Some(&good), &["read -P 0x33 0 64k", "write -P 0x44 64k 64k", "flush"]);
    assert!(qemu_io_succeeded(&o), "TLS: {}", text(&o));
    let o = qemu_io_tls(s.port, "v", None, &["read -P 0x44 64k 64k"]);
    assert!(qemu_io_succeeded(&o), "plain again: {}", text(&o));
}

/// Over TLS an attachment is bound to its node's identity: the export name of a
/// volume published to node-1 opens for a client whose certificate names node-1 (its
/// common name, or a DNS name among its subject alternative names) and is refused to
/// node-2's certificate, key or not; unpublishing ends node-1's access.
#[test]
fn over_tls_a_published_volume_opens_only_for_its_nodes_certificate() {
    require("qemu-io");
    let td = TestDir::new();
    let ca1 = ca("ferrovol test CA");
    let s = start_with(&td, "required", &ca1, &["--nbd-access", "attached"]);
    s.create_volume("v", "8MiB");
    let published = json(&s.cli_ok(&["volume", "publish", "v", "--node", "node-1", "--json"]));
    let export = published["export_name"].as_str().unwrap().to_owned();
    let node1 = client_dir(td.path(), "node-1", &ca1, Some(&ca1));
    let node2 = client_dir(td.path(), "node-2", &ca1, Some(&ca1));
    // node-1 by a SAN: a certificate whose common name is something else.
    let by_san = td.path().join("by-san");
    std::fs::create_dir_all(&by_san).unwrap();
    write(&by_san, "ca-cert.pem", &ca1.pem);
    let (cert, key) = leaf(&ca1, "kubelet client", &["node-1"], true);
    write(&by_san, "client-cert.pem", &cert);
    write(&by_san, "client-key.pem", &key);

    let o = qemu_io_tls(s.port, &export, Some(&node1), &["write -P 0x77 0 64k", "flush"]);
    assert!(qemu_io_succeeded(&o), "node-1 over TLS: {}", text(&o));
    let o = qemu_io_tls(s.port, &export, Some(&by_san), &["read -P 0x77 0 64k"]);
    assert!(qemu_io_succeeded(&o), "node-1 by its SAN: {}", text(&o));
    let o = qemu_io_tls(s.port, &export, Some(&node2), &["write -P 0x88 0 4k"]);
    assert!(!o.status.success(), "node-2 opened node-1's export: {}", text(&o));
    assert!(text(&o).contains("another node"), "the refusal says why: {}", text(&o));
    assert!(s.log_text().contains("the certificate names another node"), "the refusal is logged");
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]);
    let o = qemu_io_tls(s.port, &export, Some(&node1), &["read 0 4k"]);
    assert!(!o.status.success(), "node-1 still opens after the unpublish: {}", text(&o));
    // The data node-2 tried to write is not there.
    let export2 = json(&s.cli_ok(&["volume", "publish", "v", "--node", "node-2", "--json"]))["export_name"]
        .as_str()
        .unwrap()
        .to_owned();
    let o = qemu_io_tls(s.port, &export2, Some(&node2), &["read -P 0x77 0 64k"]);
    assert!(qemu_io_succeeded(&o), "node-2 on its own attachment: {}", text(&o));
}

/// Refused at start: `--nbd-tls` without its files, and one CA for both the nodes and
/// the management API's callers (a node's certificate would call the API).
#[test]
fn nbd_tls_without_its_files_or_with_the_apis_ca_is_refused_at_start() {
    let td = TestDir::new();
    let o = cli(&td.data(), &["serve", "--nbd-tls", "required"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--tls-cert"), "{}", text(&o));
    let ca1 = ca("ferrovol test CA");
    let (scert, skey) = leaf(&ca1, "storage-1", &["127.0.0.1"], false);
    let cert = write(td.path(), "server.pem", &scert);
    let key = write(td.path(), "server-key.pem", &skey);
    let api_ca = write(td.path(), "api-ca.pem", &ca1.pem);
    let nodes_ca = write(td.path(), "nodes-ca.pem", &ca1.pem);
    let listen = format!("127.0.0.1:{}", free_port());
    let api = format!("127.0.0.1:{}", free_port());
    let o = cli(
        &td.data(),
        &[
            "serve",
            "--listen",
            &listen,
            "--api-listen",
            &api,
            "--nbd-tls",
            "required",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            api_ca.to_str().unwrap(),
            "--nbd-tls-client-ca",
            nodes_ca.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success(), "served with one CA for nodes and callers");
    assert!(text(&o).contains("name the same CA"), "{}", text(&o));
}

/// The option rules of FORCEDTLS on the wire (proto.md, "TLS support"), spoken by hand:
/// options before `NBD_OPT_STARTTLS` get `NBD_REP_ERR_TLS_REQD` (abort excepted),
/// `NBD_OPT_STARTTLS` with data or a second time gets `NBD_REP_ERR_INVALID`, after TLS
/// the options are served, and `NBD_OPT_EXPORT_NAME` before TLS ends the connection.
/// A client that stops halfway through its TLS handshake is closed, and others are
/// served meanwhile.
#[test]
fn the_forced_tls_option_rules_hold_on_the_wire() {
    use nbd::proto::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;

    fn greet(port: u16) -> TcpStream {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).unwrap();
        s.write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
        s
    }
    fn send(s: &mut impl Write, option: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m).unwrap();
        s.flush().unwrap();
    }
    /// The reply type to `option`, after skipping `NBD_REP_SERVER` and `NBD_REP_INFO`.
    fn reply(s: &mut impl Read, option: u32) -> u32 {
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h).unwrap();
            let (opt, ty) =
                (u32::from_be_bytes(h[8..12].try_into().unwrap()), u32::from_be_bytes(h[12..16].try_into().unwrap()));
            let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
            s.read_exact(&mut data).unwrap();
            assert_eq!(opt, option);
            if ty != NBD_REP_SERVER && ty != NBD_REP_INFO {
                return ty;
            }
        }
    }

    let td = TestDir::new();
    let ca1 = ca("ferrovol test CA");
    let s = start_with(&td, "required", &ca1, &["--handshake-timeout", "1"]);
    s.create_volume("v", "8MiB");
    let mut go = 1u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"v");
    go.extend_from_slice(&0u16.to_be_bytes());

    let mut c = greet(s.port);
    for (option, data) in [(NBD_OPT_LIST, &[][..]), (NBD_OPT_INFO, &go[..]), (NBD_OPT_STRUCTURED_REPLY, &[][..])] {
        send(&mut c, option, data);
        assert_eq!(reply(&mut c, option), NBD_REP_ERR_TLS_REQD, "option {option} before TLS");
    }
    send(&mut c, NBD_OPT_STARTTLS, b"x");
    assert_eq!(reply(&mut c, NBD_OPT_STARTTLS), NBD_REP_ERR_INVALID, "NBD_OPT_STARTTLS with data");
    send(&mut c, NBD_OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut c, NBD_OPT_STARTTLS), NBD_REP_ACK);
    // The TLS handshake, as node-1.
    use rustls::pki_types::pem::PemObject;
    let (cert, key) = leaf(&ca1, "node-1", &[], true);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from_pem_slice(ca1.pem.as_bytes()).unwrap()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            vec![rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
            rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        )
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut t = rustls::StreamOwned::new(conn, c);
    send(&mut t, NBD_OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut t, NBD_OPT_STARTTLS), NBD_REP_ERR_INVALID, "a second NBD_OPT_STARTTLS");
    send(&mut t, NBD_OPT_LIST, &[]);
    assert_eq!(reply(&mut t, NBD_OPT_LIST), NBD_REP_ACK, "NBD_OPT_LIST over TLS");
    send(&mut t, NBD_OPT_INFO, &go);
    assert_eq!(reply(&mut t, NBD_OPT_INFO), NBD_REP_ACK, "NBD_OPT_INFO over TLS");
    send(&mut t, NBD_OPT_ABORT, &[]);
    assert_eq!(reply(&mut t, NBD_OPT_ABORT), NBD_REP_ACK);
    // proto.md "Termination": the server ends TLS (close_notify) before the connection,
    // so the client sees a clean end rather than a truncated session.
    let mut rest = Vec::new();
    let end = t.read_to_end(&mut rest);
    assert!(end.is_ok(), "the TLS session ended without close_notify: {end:?}");

    // NBD_OPT_EXPORT_NAME cannot be refused: the connection ends.
    let mut c = greet(s.port);
    send(&mut c, NBD_OPT_EXPORT_NAME, b"v");
    let mut b = [0u8; 1];
    assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "the connection stays open after EXPORT_NAME before TLS");

    // A TLS handshake stalled halfway: others are served meanwhile, and the server
    // closes it at its handshake timeout (1 s here).
    let mut c = greet(s.port);
    send(&mut c, NBD_OPT_STARTTLS, &[]);
    assert_eq!(reply(&mut c, NBD_OPT_STARTTLS), NBD_REP_ACK);
    c.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap(); // a ClientHello's first bytes
    let good = client_dir(td.path(), "node-1", &ca1, Some(&ca1));
    let o = qemu_io_tls(s.port, "v", Some(&good), &["write -P 0x66 0 4k", "read -P 0x66 0 4k"]);
    assert!(qemu_io_succeeded(&o), "served beside a stuck handshake: {}", text(&o));
    let t0 = std::time::Instant::now();
    let mut rest = Vec::new();
    let r = c.read_to_end(&mut rest); // ends when the server closes (a TLS alert may come first)
    assert!(r.is_ok() || t0.elapsed() < std::time::Duration::from_secs(15), "not closed: {r:?}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(15), "the stalled handshake was not closed");
    let t0 = std::time::Instant::now();
    while !s.log_text().contains("handshake made no progress") {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the stalled handshake's end is not logged");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The newest kernel of ../shared/tools/nbd-vm's cache (the one its run.sh boots) and
/// its modules directory.
fn vm_kernel_modules() -> PathBuf {
    let cache = std::env::var_os("NBDVM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/nbd-vm"));
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("ls '{}/kernels' | sort -V | tail -1", cache.display()))
        .output()
        .unwrap();
    let kver = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(!kver.is_empty(), "no kernel in {}/kernels (../shared/tools/nbd-vm/setup.sh)", cache.display());
    cache.join("kernels").join(&kver).join("lib/modules").join(&kver).join("kernel")
}

/// A credentials directory in the layout the node plugin reads (a Kubernetes TLS
/// Secret's): `ca.crt` to verify the server, `tls.crt` and `tls.key` signed by `signer`
/// for node `node`.
fn node_dir(root: &Path, tag: &str, trust: &Ca, signer: &Ca, node: &str) -> PathBuf {
    let dir = root.join(tag);
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, "ca.crt", &trust.pem);
    let (cert, key) = leaf(signer, node, &[], true);
    write(&dir, "tls.crt", &cert);
    write(&dir, "tls.key", &key);
    dir
}

/// `ferrovol serve` on `data` with NBD on the fixed `port` (a reconnect must find it
/// again after a restart), attached access, and `extra` flags; returns once it serves.
fn serve_on_port(data: &Path, port: u16, log: &Path, extra: &[&str]) -> std::process::Child {
    let logf = std::fs::File::create(log).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovol"))
        .arg("--data-dir")
        .arg(data)
        .args(["serve", "--pool-size", "2GiB", "--listen", &format!("127.0.0.1:{port}"), "--nbd-access", "attached"])
        .args(extra)
        .stdout(logf.try_clone().unwrap())
        .stderr(logf)
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !(data.join("ferrovol.sock").exists() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()) {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("ferrovol serve exited ({st}): {}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "server did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child
}

/// The Linux kernel's NBD client over TLS, in a VM booted by ../shared/tools/nbd-vm:
/// `ferrovol nbd attach nbds://` hands the TLS session to the kernel, and ext4 on the
/// device works against a server that requires TLS and binds the attachment to the
/// node's certificate (published as the CSI controller does, to `ferrovol:node-1`; the
/// certificate names the Kubernetes node, `node-1`). A device attached in clear text
/// goes over to TLS at its reconnect once the server requires it; a reconnect makes new
/// TLS sessions; plain and foreign-CA attaches are refused (tests/kernel/guest-tls.sh).
#[test]
fn the_kernel_client_attaches_over_tls_with_kernel_tls() {
    let nbd_vm = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/nbd-vm/run.sh");
    assert!(nbd_vm.exists(), "{} is missing", nbd_vm.display());
    let td = TestDir::new();
    let ca1 = ca("ferrovol test CA");
    let stranger_ca = ca("another CA");
    // The guest reaches the host as 10.0.2.2: the server's certificate names it.
    let dir = td.path();
    let (scert, skey) = leaf(&ca1, "storage-1", &["10.0.2.2", "127.0.0.1"], false);
    let cert = write(dir, "server.pem", &scert);
    let key = write(dir, "server-key.pem", &skey);
    let client_ca = write(dir, "nodes-ca.pem", &ca1.pem);
    let tls_flags = [
        "--nbd-tls",
        "required",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--nbd-tls-client-ca",
        client_ca.to_str().unwrap(),
    ];
    let data = td.data();
    let port = free_port();
    let mut server = serve_on_port(&data, port, &dir.join("serve-plain.log"), &[]);
    cli_ok(&data, &["volume", "create", "kvol", "--size", "256MiB"]);
    let published = json(&cli_ok(&data, &["volume", "publish", "kvol", "--node", "ferrovol:node-1", "--json"]));
    let export = published["export_name"].as_str().unwrap().to_owned();

    let share = dir.join("share");
    let mods = share.join("mods");
    std::fs::create_dir_all(&mods).unwrap();
    let kernel = vm_kernel_modules();
    for m in [
        "lib/crypto/libchacha.ko.xz",
        "crypto/chacha_generic.ko.xz",
        "lib/crypto/libpoly1305.ko.xz",
        "crypto/poly1305_generic.ko.xz",
        "crypto/chacha20poly1305.ko.xz",
        "net/tls/tls.ko.xz",
    ] {
        let from = kernel.join(m);
        std::fs::copy(&from, mods.join(from.file_name().unwrap()))
            .unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    }
    node_dir(&share, "node", &ca1, &ca1, "node-1");
    node_dir(&share, "stranger", &ca1, &stranger_ca, "node-1");
    let bin = dir.join("ferrovol-stripped");
    let st = std::process::Command::new("objcopy")
        .args(["--strip-debug", env!("CARGO_BIN_EXE_ferrovol"), bin.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success(), "objcopy --strip-debug");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kernel/guest-tls.sh");
    let mut vm = std::process::Command::new("bash")
        .arg(&nbd_vm)
        .args(["-t", "300", "-s", share.to_str().unwrap()])
        .args(["-e", &format!("PORT={port}"), "-e", &format!("EXPORT={export}")])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .arg(&script)
        .spawn()
        .unwrap();
    // The guest wrote in clear text: a clean restart (same crash generation) with TLS
    // required.
    let t = std::time::Instant::now();
    while !share.join("plain-done").exists() {
        if let Some(st) = vm.try_wait().unwrap() {
            panic!("the guest ended ({st}) before writing in clear text");
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(300), "the guest never wrote in clear text");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    std::process::Command::new("kill").arg("-TERM").arg(server.id().to_string()).status().unwrap();
    assert!(server.wait().unwrap().success(), "clean stop");
    let mut server = serve_on_port(&data, port, &dir.join("serve-tls.log"), &tls_flags);
    std::fs::write(share.join("tls-on"), "").unwrap();
    let st = vm.wait().unwrap();
    assert!(st.success(), "guest-tls.sh failed with {st} (console output above)");
    assert!(share.join("sum").exists(), "the guest did not finish");
    let info = json(&cli_ok(&data, &["volume", "info", "kvol", "--json"]));
    assert!(info["allocated_bytes"].as_u64().unwrap() >= 12 << 20, "12 MiB written: {info}");
    server.kill().unwrap();
    server.wait().unwrap();
}

/// A client certificate of the right CA that has expired is refused in the TLS
/// handshake (the client sees the server's alert), and the refusal is logged. The
/// client is this crate's own (`nbds://`), which presents what it is given.
#[test]
fn an_expired_client_certificate_is_refused() {
    let td = TestDir::new();
    let ca1 = ca("ferrovol test CA");
    let s = start(&td, "required", &ca1);
    s.create_volume("v", "8MiB");
    let dir = td.path().join("expired");
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, "ca.crt", &ca1.pem);
    let (cert, key) = expired_client_leaf(&ca1, "node-1");
    write(&dir, "tls.crt", &cert);
    write(&dir, "tls.key", &key);
    let tls = nbd::client::ClientTls::load(&dir).unwrap();
    let target = nbd::client::Target::Tls(format!("127.0.0.1:{}", s.port));
    match nbd::client::connect(&target, "v", std::time::Duration::from_secs(10), Some(&tls)) {
        Err(nbd::client::HandshakeError::Tls { message, .. }) => {
            assert!(message.contains("CertificateExpired"), "the alert names the expiry: {message}")
        }
        other => panic!("an expired certificate was not refused in TLS: {other:?}"),
    }
    let t0 = std::time::Instant::now();
    while !s.log_text().contains("TLS handshake failed") {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the refusal is not logged");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
