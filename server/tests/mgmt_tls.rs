//! The management API over TCP with mutual TLS, against a real `ferrovol serve`:
//! a client with a certificate of the configured CA is served and audited under its
//! certificate's subject; one without a certificate, or with one of another CA, is
//! refused before any call runs; SIGHUP reads the files again.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::certs::{ca, leaf, write, Ca};
use common::*;
use mgmt_api::{Client, ClientTls, ErrorKind};

/// A client's files in `dir`, named after `tag`.
fn client_files(dir: &Path, tag: &str, trust: &Ca, signer: &Ca, cn: &str) -> ClientTls {
    let (cert, key) = leaf(signer, cn, &[], true);
    ClientTls {
        ca: write(dir, &format!("{tag}-ca.pem"), &trust.pem),
        cert: write(dir, &format!("{tag}.pem"), &cert),
        key: write(dir, &format!("{tag}-key.pem"), &key),
    }
}

/// Creates volume `name` as `tls`'s client: Ok, or the error's kind.
async fn create_as(addr: &str, tls: &ClientTls, name: &str) -> Result<(), ErrorKind> {
    let c = Client::connect_tls(addr, tls).await.map_err(|e| e.kind())?;
    c.create_volume(name, 1 << 20).await.map(|_| ()).map_err(|e| e.kind())
}

/// A call over TLS from a client that presents no certificate.
async fn create_without_certificate(addr: &str, ca_pem: &str, name: &str) -> bool {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let addr = addr.to_owned();
    let endpoint = tonic::transport::Endpoint::try_from("http://ferrovol.invalid").unwrap();
    let channel = endpoint
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (addr, connector) = (addr.clone(), connector.clone());
            async move {
                let tcp = tokio::net::TcpStream::connect(&addr).await?;
                let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(connector.connect(name, tcp).await?))
            }
        }))
        .await;
    match channel {
        Err(_) => false,
        Ok(ch) => Client::over(ch).create_volume(name, 1 << 20).await.is_ok(),
    }
}

#[test]
fn mutual_tls_admits_only_clients_of_the_configured_ca() {
    let td = TestDir::new();
    let dir = td.path().to_owned();
    let (ca1, ca2) = (ca("ferrovol test CA 1"), ca("another CA"));
    let (scert, skey) = leaf(&ca1, "storage-1", &["127.0.0.1", "localhost"], false);
    let server_cert = write(&dir, "server.pem", &scert);
    let server_key = write(&dir, "server-key.pem", &skey);
    let client_ca = write(&dir, "client-ca.pem", &ca1.pem);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut s = Server::start_with(
        &td.data(),
        "2GiB",
        &[
            "--api-listen",
            &addr,
            "--tls-cert",
            server_cert.to_str().unwrap(),
            "--tls-key",
            server_key.to_str().unwrap(),
            "--tls-client-ca",
            client_ca.to_str().unwrap(),
        ],
    );
    let good = client_files(&dir, "good", &ca1, &ca1, "csi-controller");
    let foreign = client_files(&dir, "foreign", &ca1, &ca2, "intruder");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        assert_eq!(create_as(&addr, &good, "by-good").await, Ok(()));
        assert!(create_as(&addr, &foreign, "by-foreign").await.is_err(), "a certificate of another CA was served");
        assert!(!create_without_certificate(&addr, &ca1.pem, "by-nobody").await, "a client without a certificate");
    });
    // The CLI over TLS too.
    let o = cli(
        &dir,
        &[
            "volume",
            "list",
            "--json",
            "--api",
            &addr,
            "--api-ca",
            good.ca.to_str().unwrap(),
            "--api-cert",
            good.cert.to_str().unwrap(),
            "--api-key",
            good.key.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let listed = json(&String::from_utf8_lossy(&o.stdout));
    let names: Vec<_> = listed.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_owned()).collect();
    assert_eq!(names, ["by-good"], "only the good client's call ran");
    let log = s.log_text();
    let line = log.lines().find(|l| l.contains("ferrovol::audit") && l.contains("by-good")).expect("audited");
    assert!(line.contains("CN=csi-controller"), "the caller is the certificate's subject: {line}");

    // SIGHUP: the client CA becomes the other one.
    std::fs::write(&client_ca, &ca2.pem).unwrap();
    let o = output(std::process::Command::new("kill").args(["-HUP", &s.pid().to_string()]));
    assert!(o.status.success());
    let t = std::time::Instant::now();
    let foreign_ok = loop {
        let r = rt.block_on(create_as(&addr, &foreign, "by-foreign"));
        if r.is_ok() || t.elapsed() > std::time::Duration::from_secs(10) {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(foreign_ok, Ok(()), "the reloaded CA is not in force");
    assert!(rt.block_on(create_as(&addr, &good, "by-good-2")).is_err(), "the old CA still admits");
    // Broken files on SIGHUP keep the ones in force.
    std::fs::write(&client_ca, "not a certificate").unwrap();
    output(std::process::Command::new("kill").args(["-HUP", &s.pid().to_string()]));
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(s.is_running());
    assert_eq!(rt.block_on(create_as(&addr, &foreign, "by-foreign-2")), Ok(()));
}

#[test]
fn api_listen_without_tls_is_refused() {
    let td = TestDir::new();
    let port = free_port().to_string();
    let o = cli(&td.data(), &["serve", "--api-listen", &format!("127.0.0.1:{port}")]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--tls-cert"), "{}", text(&o));
}
