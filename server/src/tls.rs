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

/// PEM files of the host's TLS: `cert` (the server's chain, leaf first), `key` (its
/// private key: PKCS#8, PKCS#1 or SEC1), and for each service the CA certificates a
/// client's certificate must chain to: `client_ca` for the management API's callers,
/// `nbd_client_ca` for NBD clients (nodes). The two must differ: a node's certificate
/// must not also be a management API caller's.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Server certificate chain.
    pub cert: PathBuf,
    /// Server private key.
    pub key: PathBuf,
    /// CA certificates for management API callers' certificates (with `--api-listen`).
    pub client_ca: Option<PathBuf>,
    /// CA certificates for NBD clients' certificates (with `--nbd-tls`).
    pub nbd_client_ca: Option<PathBuf>,
}

/// How long a client may take over the TLS handshake before its connection is closed.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS configuration in force, replaced whole by [`MtlsAcceptor::reload`]:
/// handshakes started after a reload use the new files; connections already made
/// keep theirs.
pub struct MtlsAcceptor {
    files: TlsFiles,
    /// The management API's (ALPN `h2`), with `client_ca`.
    config: RwLock<Option<Arc<rustls::ServerConfig>>>,
    /// NBD sessions' (no ALPN: NBD clients offer none), with `nbd_client_ca`.
    nbd_config: RwLock<Option<Arc<rustls::ServerConfig>>>,
}

impl MtlsAcceptor {
    /// Reads and checks the files.
    ///
    /// Errors: a file that cannot be read or holds no certificate, key or CA; a key
    /// that does not match the certificate.
    pub fn load(files: TlsFiles) -> anyhow::Result<MtlsAcceptor> {
        let (config, nbd_config) = server_configs(&files)?;
        Ok(MtlsAcceptor { files, config: RwLock::new(config), nbd_config: RwLock::new(nbd_config) })
    }

    /// Reads the files again; on error the configuration in force stays.
    ///
    /// Errors: as [`MtlsAcceptor::load`].
    pub fn reload(&self) -> anyhow::Result<()> {
        let (config, nbd_config) = server_configs(&self.files)?;
        *self.config.write() = config;
        *self.nbd_config.write() = nbd_config;
        Ok(())
    }

    /// The management API's acceptor; `None` without `client_ca`.
    fn acceptor(&self) -> Option<tokio_rustls::TlsAcceptor> {
        self.config.read().clone().map(tokio_rustls::TlsAcceptor::from)
    }
}

/// NBD sessions (`NBD_OPT_STARTTLS`) take the files in force when they start: the
/// same certificate, key and client CA as the management API.
impl nbd::TlsSource for MtlsAcceptor {
    /// Panics without `nbd_client_ca` (the host starts NBD TLS only with it).
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.nbd_config.read().clone().expect("NBD TLS is on only with its client CA")
    }
}

/// The management API's configuration (ALPN `h2`) and NBD's (no ALPN), each when its
/// client CA is given.
type Configs = (Option<Arc<rustls::ServerConfig>>, Option<Arc<rustls::ServerConfig>>);

fn server_configs(f: &TlsFiles) -> anyhow::Result<Configs> {
    let api = match &f.client_ca {
        Some(ca) => {
            let mut c = server_config(f, ca)?;
            c.alpn_protocols = vec![b"h2".to_vec()];
            Some(Arc::new(c))
        }
        None => None,
    };
    let nbd = match &f.nbd_client_ca {
        Some(ca) => {
            let mut c = server_config(f, ca)?;
            // NBD sessions last as long as a device is attached and are not resumed:
            // no session tickets (each would hold the client's chain in the cache).
            c.send_tls13_tickets = 0;
            Some(Arc::new(c))
        }
        None => None,
    };
    Ok((api, nbd))
}

fn server_config(f: &TlsFiles, client_ca: &std::path::Path) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&f.cert)?;
    let key =
        PrivateKeyDer::from_pem_file(&f.key).with_context(|| format!("read a private key from {}", f.key.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in read_certs(client_ca)? {
        roots.add(ca).with_context(|| format!("a CA certificate in {}", client_ca.display()))?;
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

/// The subject of the DER certificate `der` (RFC 4514 form), or `?` when it does not
/// parse (rustls verified it, so it does).
pub fn certificate_subject(der: &[u8]) -> String {
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, cert)) => cert.subject().to_string(),
        Err(_) => "?".to_owned(),
    }
}

/// Whether the DER certificate `der` names the CSI node `node_id`: as one of its DNS
/// subject alternative names when it has any (RFC 6125: then the common name is not
/// looked at), else as its subject's common name; compared without regard to ASCII
/// case, as DNS names are (Kubernetes node names are lowercase DNS names). The node IDs
/// of ferrovol's node plugin (`ferrovol:NODE-NAME`) are named by their Kubernetes node
/// name, which a DNS name can hold (a `:` it cannot). A certificate naming several nodes
/// may open what is published to each: issue one per node. A certificate that does not
/// parse names nobody.
pub fn names_node(der: &[u8], node_id: &str) -> bool {
    let node_id = node_id.strip_prefix(csi::controller::NODE_ID_PREFIX).unwrap_or(node_id);
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    let dns: Vec<&str> = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                x509_parser::extensions::GeneralName::DNSName(d) => Some(*d),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    if !dns.is_empty() {
        return dns.iter().any(|d| d.eq_ignore_ascii_case(node_id));
    }
    let named =
        cert.subject().iter_common_name().any(|cn| cn.as_str().is_ok_and(|cn| cn.eq_ignore_ascii_case(node_id)));
    named
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
            let Some(tls) = acceptor.acceptor() else {
                tracing::error!(%peer, "management API: no client CA; closing the connection");
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let who = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .map(|c| certificate_subject(c));
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
