//! The management API over TCP with mutual TLS (rustls), and NBD's TLS sessions with
//! the same files: the server certificate and key, the CA that client certificates
//! must chain to, reloaded on demand (SIGHUP);
//! the TLS handshake of each connection before any call is read, and who called
//! ([`Caller`], the client certificate's subject, in each request's extensions).
//!
//! Lives here: [`TlsFiles`], [`MtlsAcceptor`], [`incoming`], [`Caller`]. Not here: the
//! service (mgmt.rs), the unix socket (host.rs), the client side (`mgmt-api`).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The caller of a management request that came over mutual TLS: its certificate's
/// subject (RFC 4514 form, e.g. `CN=csi-controller,O=example`).
#[derive(Debug, Clone)]
pub struct Caller(pub String);

/// PEM files of the management API's TLS: `cert` (the server's chain, leaf first),
/// `key` (its private key: PKCS#8, PKCS#1 or SEC1), `client_ca` (the CA certificates a
/// client's certificate must chain to).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Server certificate chain.
    pub cert: PathBuf,
    /// Server private key.
    pub key: PathBuf,
    /// CA certificates for client certificates.
    pub client_ca: PathBuf,
}

/// How long a client may take over the TLS handshake before its connection is closed.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS configuration in force, replaced whole by [`MtlsAcceptor::reload`]:
/// handshakes started after a reload use the new files; connections already made
/// keep theirs.
pub struct MtlsAcceptor {
    files: TlsFiles,
    config: RwLock<Arc<rustls::ServerConfig>>,
    /// The same files for NBD sessions (no ALPN: NBD clients offer none).
    nbd_config: RwLock<Arc<rustls::ServerConfig>>,
}

impl MtlsAcceptor {
    /// Reads and checks the files.
    ///
    /// Errors: a file that cannot be read or holds no certificate, key or CA; a key
    /// that does not match the certificate.
    pub fn load(files: TlsFiles) -> anyhow::Result<MtlsAcceptor> {
        let (config, nbd_config) = server_configs(&files)?;
        Ok(MtlsAcceptor { files, config: RwLock::new(Arc::new(config)), nbd_config: RwLock::new(Arc::new(nbd_config)) })
    }

    /// Reads the files again; on error the configuration in force stays.
    ///
    /// Errors: as [`MtlsAcceptor::load`].
    pub fn reload(&self) -> anyhow::Result<()> {
        let (config, nbd_config) = server_configs(&self.files)?;
        *self.config.write() = Arc::new(config);
        *self.nbd_config.write() = Arc::new(nbd_config);
        Ok(())
    }

    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.config.read()))
    }
}

/// NBD sessions (`NBD_OPT_STARTTLS`) take the files in force when they start: the
/// same certificate, key and client CA as the management API.
impl nbd::TlsSource for MtlsAcceptor {
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.nbd_config.read())
    }
}

/// The management API's configuration (ALPN `h2`) and NBD's (no ALPN) from the files.
fn server_configs(f: &TlsFiles) -> anyhow::Result<(rustls::ServerConfig, rustls::ServerConfig)> {
    let mut api = server_config(f)?;
    let nbd = api.clone();
    api.alpn_protocols = vec![b"h2".to_vec()];
    Ok((api, nbd))
}

fn server_config(f: &TlsFiles) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&f.cert)?;
    let key =
        PrivateKeyDer::from_pem_file(&f.key).with_context(|| format!("read a private key from {}", f.key.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in read_certs(&f.client_ca)? {
        roots.add(ca).with_context(|| format!("a CA certificate in {}", f.client_ca.display()))?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
        .build()
        .context("client certificate verifier")?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .with_context(|| format!("the key {} with the certificate {}", f.key.display(), f.cert.display()))?;
    Ok(config)
}

fn read_certs(path: &std::path::Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("read {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parse the certificates in {}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{} holds no certificate", path.display());
    Ok(certs)
}

/// The subject of a DER certificate, or `?` when it does not parse (rustls verified
/// it, so it does).
fn subject(der: &[u8]) -> String {
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, cert)) => cert.subject().to_string(),
        Err(_) => "?".to_owned(),
    }
}

/// Whether the DER certificate `der` names the CSI node `node_id`: as its subject's
/// common name, or as one of its DNS subject alternative names. A certificate that does
/// not parse names nobody.
pub fn names_node(der: &[u8], node_id: &str) -> bool {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    if cert.subject().iter_common_name().any(|cn| cn.as_str() == Ok(node_id)) {
        return true;
    }
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return false;
    };
    san.value
        .general_names
        .iter()
        .any(|n| matches!(n, x509_parser::extensions::GeneralName::DNSName(d) if *d == node_id))
}

/// The subject of the DER certificate `der` (RFC 4514 form), or `?` when it does not
/// parse.
pub fn certificate_subject(der: &[u8]) -> String {
    subject(der)
}

/// A management connection that completed mutual TLS.
pub struct MtlsStream {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    caller: Caller,
}

impl tonic::transport::server::Connected for MtlsStream {
    type ConnectInfo = Caller;

    fn connect_info(&self) -> Caller {
        self.caller.clone()
    }
}

impl AsyncRead for MtlsStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for MtlsStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The connections of `listener` that complete mutual TLS, for tonic's
/// `serve_with_incoming`: each handshake runs in a task of its own (a slow client holds
/// up no other), and one that fails (no certificate, a certificate of another CA, not
/// TLS) is logged and closed before any call is read.
pub fn incoming(
    listener: TcpListener,
    acceptor: Arc<MtlsAcceptor>,
) -> impl tokio_stream::Stream<Item = Result<MtlsStream, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "management API: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let tls = acceptor.acceptor();
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let who = stream.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| subject(c));
                        let caller = Caller(who.unwrap_or_else(|| "?".to_owned()));
                        tracing::debug!(%peer, caller = %caller.0, "management API: client authenticated");
                        let _ = tx.send(Ok(MtlsStream { inner: stream, caller })).await;
                    }
                    Ok(Err(e)) => tracing::info!(%peer, error = %e, "management API: TLS handshake refused"),
                    Err(_) => tracing::info!(%peer, "management API: TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
