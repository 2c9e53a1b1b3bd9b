//! ferrovol's management API: the storage host's control surface, gRPC (tonic) over a
//! unix socket (`ferrovol serve` listens on `<data-dir>/ferrovol.sock` by default).
//!
//! Lives here: the protocol (`proto/ferrovol.proto`, package `ferrovol.v1`) and its
//! generated code ([`pb`]: messages, the `Management` service trait a server
//! implements, and the raw client), and [`Client`], a typed client whose calls return
//! [`ApiError`], one error of a small matchable [`ErrorKind`], and [`drain`], a
//! graceful stop for a gRPC server that a silent client cannot hang. Used by the `ferrovol`
//! CLI and by the CSI controller; implemented by the `ferrovol` server. Not here: the
//! engine or anything else of ferrovol's (this crate depends on none of them), the
//! server side (the `ferrovol` crate's `mgmt` module).

pub mod drain;

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Generated protobuf and gRPC code for package `ferrovol.v1` (proto/ferrovol.proto);
/// the comments of the proto file are its documentation.
#[allow(missing_docs)]
pub mod pb {
    tonic::include_proto!("ferrovol.v1");
}

pub use pb::{Attachment, ByteRange, HostInfo, PoolStatus, Qos, Volume};

/// The label a storage host gives a clone: its source's full name (`VOLUME` or
/// `VOLUME@SNAPSHOT`), set by CloneVolume (an idempotent clone of the same name
/// compares it).
pub const ORIGIN_LABEL: &str = "ferrovol/origin";

/// The label a storage host gives every member of a group snapshot
/// (CreateGroupSnapshot): how many members the group has, so that a group a crash cut
/// short is told apart from ordinary snapshots.
pub const GROUP_SIZE_LABEL: &str = "ferrovol/group-size";

/// The label a storage host keeps a volume's QoS limits in (CreateVolume's `qos`,
/// SetVolumeQos), read back as `Volume.qos`; set by the server only.
pub const QOS_LABEL: &str = "ferrovol/qos";

/// The largest reply [`Client`] accepts, in bytes: about four million volumes in a
/// listing, or a hundred million ranges in a diff. Replies are not paged, and gRPC's
/// default of 4 MiB per message is passed by a listing of some 16,000 volumes.
pub const MAX_REPLY_BYTES: usize = 1 << 30;

/// What kind of failure an [`ApiError`] is: what a caller decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No such volume or snapshot (gRPC `NOT_FOUND`).
    NotFound,
    /// A volume or snapshot of that name exists (`ALREADY_EXISTS`).
    AlreadyExists,
    /// A bad name, size or request (`INVALID_ARGUMENT`).
    InvalidArgument,
    /// The pool, or the file system under it, is full (`RESOURCE_EXHAUSTED`).
    NoSpace,
    /// The request cannot be served in the pool's state: it failed after an I/O error,
    /// the volume is a read-only snapshot, or it is published (to another node
    /// exclusively, or at all for a delete) (`FAILED_PRECONDITION`).
    FailedPrecondition,
    /// The call did what it could but must be retried to finish: an unpublish whose
    /// connections did not close in time (`ABORTED`).
    Aborted,
    /// No server answers at the address (not running, or stopping).
    Unavailable,
    /// The connection broke during the call: its outcome is unknown (a change may or
    /// may not have been made).
    Interrupted,
    /// The server failed otherwise (`INTERNAL` and the rest).
    Internal,
}

/// The error of a management call: its kind, and a message for people.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    kind: ErrorKind,
    message: String,
}

impl ApiError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, as `Display` shows it.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// An error of `kind` with `message`: for a caller's own failures around a call
    /// (a timeout it sets, say), told apart by kind as the call's are.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into() }
    }

    /// The error a status the client received stands for. A status made by the client
    /// itself (it carries a source: the transport broke) or `UNKNOWN` means the call was
    /// cut on its way, and its outcome is unknown.
    fn from_status(s: tonic::Status) -> ApiError {
        use std::error::Error as _;
        use tonic::Code;
        if s.source().is_some() || s.code() == Code::Unknown {
            return ApiError::new(
                ErrorKind::Interrupted,
                format!(
                    "the connection to the server broke during the call ({}: the server stopped or was killed?); \
                     its outcome is unknown: if it was a change, list the volumes and snapshots once the server \
                     runs again",
                    s.message()
                ),
            );
        }
        let kind = match s.code() {
            Code::NotFound => ErrorKind::NotFound,
            Code::AlreadyExists => ErrorKind::AlreadyExists,
            Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
            Code::ResourceExhausted => ErrorKind::NoSpace,
            Code::FailedPrecondition => ErrorKind::FailedPrecondition,
            Code::Aborted => ErrorKind::Aborted,
            Code::Unavailable => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        };
        ApiError::new(kind, s.message())
    }
}

/// The innermost cause of a connection error, alone: the layers above it repeat it.
fn innermost_cause<'a>(e: &'a (dyn std::error::Error + 'static)) -> &'a (dyn std::error::Error + 'static) {
    let mut cause = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause
}

/// PEM files a client presents and trusts over mutual TLS ([`Client::connect_tls`]).
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// CA certificates the server's certificate must chain to.
    pub ca: PathBuf,
    /// The client's certificate chain, leaf first.
    pub cert: PathBuf,
    /// The client's private key.
    pub key: PathBuf,
}

impl ClientTls {
    /// Loads the three files as a connect would, without connecting.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] naming the file that does not load.
    pub fn check(&self) -> Result<()> {
        self.config().map(|_| ())
    }

    fn config(&self) -> Result<rustls::ClientConfig> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
            ApiError::new(ErrorKind::InvalidArgument, format!("{what} {}: {e}", path.display()))
        };
        let certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>> {
            let iter = CertificateDer::pem_file_iter(path).map_err(|e| bad("read", path, &e))?;
            let v = iter.collect::<std::result::Result<Vec<_>, _>>().map_err(|e| bad("parse", path, &e))?;
            if v.is_empty() {
                return Err(bad("no certificate in", path, &"empty"));
            }
            Ok(v)
        };
        let mut roots = rustls::RootCertStore::empty();
        for ca in certs(&self.ca)? {
            roots.add(ca).map_err(|e| bad("CA certificate in", &self.ca, &e))?;
        }
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| bad("read a private key from", &self.key, &e))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("TLS versions for", &self.cert, &e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs(&self.cert)?, key)
            .map_err(|e| bad("client certificate", &self.cert, &e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// A management client. Cheap to clone; calls may run concurrently.
#[derive(Clone)]
pub struct Client {
    inner: pb::management_client::ManagementClient<Channel>,
}

type Result<T> = std::result::Result<T, ApiError>;

impl Client {
    /// Connects to the management socket at `path`.
    ///
    /// Errors: [`ErrorKind::Unavailable`] when the socket does not exist or nobody
    /// listens on it (the message asks whether `ferrovol serve` runs with that data
    /// directory or socket).
    pub async fn connect_unix(path: &Path) -> Result<Client> {
        if !path.exists() {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                format!(
                    "no management socket at {} (is `ferrovol serve` running with this --data-dir or --socket?)",
                    path.display()
                ),
            ));
        }
        let shown = path.display().to_string();
        let path: PathBuf = path.to_owned();
        let endpoint = Endpoint::try_from("http://ferrovol.invalid").expect("a valid placeholder URI");
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|e| {
                let cause = innermost_cause(&e);
                ApiError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "cannot connect to the management socket {shown}: {cause} (is `ferrovol serve` running with \
                         this --data-dir or --socket? A server that is stopping no longer takes calls, and one that \
                         was killed leaves its socket behind)"
                    ),
                )
            })?;
        Ok(Client::over(channel))
    }

    /// Connects to a management API served over TCP with mutual TLS at `addr`
    /// (`host:port`), presenting the client certificate of `tls` and trusting the server
    /// certificates its CA signed; the server's certificate must name `host` (a DNS
    /// name or an IP address in its subject alternative names).
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] for files that do not load or an address
    /// without a port; [`ErrorKind::Unavailable`] when nobody listens there or the TLS
    /// handshake fails (the message gives the cause).
    pub async fn connect_tls(addr: &str, tls: &ClientTls) -> Result<Client> {
        let (host, _port) = addr
            .rsplit_once(':')
            .ok_or_else(|| ApiError::new(ErrorKind::InvalidArgument, format!("'{addr}' is not HOST:PORT")))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let server_name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| ApiError::new(ErrorKind::InvalidArgument, format!("'{host}' is not a server name: {e}")))?;
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls.config()?));
        let addr = addr.to_owned();
        let shown = addr.clone();
        let endpoint = Endpoint::try_from("http://ferrovol.invalid").expect("a valid placeholder URI");
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let (addr, connector, server_name) = (addr.clone(), connector.clone(), server_name.clone());
                async move {
                    let tcp = tokio::net::TcpStream::connect(&addr).await?;
                    let _ = tcp.set_nodelay(true);
                    let tls = connector.connect(server_name, tcp).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(tls))
                }
            }))
            .await
            .map_err(|e| {
                let cause = innermost_cause(&e);
                ApiError::new(
                    ErrorKind::Unavailable,
                    format!("cannot connect to the management API at {shown} over TLS: {cause}"),
                )
            })?;
        Ok(Client::over(channel))
    }

    /// A client over an established channel.
    pub fn over(channel: Channel) -> Client {
        Client {
            inner: pb::management_client::ManagementClient::new(channel).max_decoding_message_size(MAX_REPLY_BYTES),
        }
    }

    /// The generated client, for calls this one does not wrap.
    pub fn raw(&self) -> pb::management_client::ManagementClient<Channel> {
        self.inner.clone()
    }

    /// Creates a thin volume of `size_bytes` (a multiple of 4096). Durable on return.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::NoSpace`], [`ErrorKind::FailedPrecondition`], and the transport's.
    pub async fn create_volume(&self, name: &str, size_bytes: u64) -> Result<Volume> {
        self.create_volume_with(pb::CreateVolumeRequest { name: name.to_owned(), size_bytes, ..Default::default() })
            .await
    }

    /// Creates a thin volume as `req` says: with labels, and with `exist_ok` answering
    /// with the volume of that name when its size and labels are the same.
    ///
    /// Errors: as [`Client::create_volume`]; [`ErrorKind::AlreadyExists`] with
    /// `exist_ok` when the existing volume differs.
    pub async fn create_volume_with(&self, req: pb::CreateVolumeRequest) -> Result<Volume> {
        self.raw().create_volume(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Sets a volume's QoS limits (ManagementService.SetVolumeQos): all of them, a 0
    /// being none; applied at once to its open connections. Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`] (no such volume, or a snapshot),
    /// [`ErrorKind::InvalidArgument`] (a burst without a limit or over 60000 ms), and
    /// the transport's.
    pub async fn set_volume_qos(&self, req: pb::SetVolumeQosRequest) -> Result<Volume> {
        self.raw().set_volume_qos(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Exposes a volume (a snapshot read-only) as a local block device on the storage
    /// host, /dev/ublkbN (ManagementService.AttachLocal).
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`] (it has one),
    /// [`ErrorKind::FailedPrecondition`] (no ublk in this build, kernel or process).
    pub async fn attach_local(&self, name: &str) -> Result<pb::LocalDevice> {
        self.attach_local_for(name, "").await
    }

    /// [`Client::attach_local`] for node `node_id` (AttachLocalRequest.node_id): the
    /// volume must be published to that node writable, and unpublishing it from the
    /// node removes the device.
    ///
    /// Errors: as [`Client::attach_local`]; [`ErrorKind::FailedPrecondition`] also when
    /// the volume is not published to the node writable.
    pub async fn attach_local_for(&self, name: &str, node_id: &str) -> Result<pb::LocalDevice> {
        let req = pb::AttachLocalRequest { name: name.to_owned(), node_id: node_id.to_owned() };
        self.raw().attach_local(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Removes a volume's local block device (ManagementService.DetachLocal).
    ///
    /// Errors: [`ErrorKind::NotFound`] when it has none.
    pub async fn detach_local(&self, name: &str) -> Result<pb::LocalDevice> {
        let req = pb::DetachLocalRequest { name: name.to_owned() };
        self.raw().detach_local(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Publishes a volume to a node (ManagementService.PublishVolume): the attachment,
    /// with the export name the node opens. Durable on return.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::InvalidArgument`] (node id, too
    /// many nodes), [`ErrorKind::AlreadyExists`] (published to that node with other
    /// flags), [`ErrorKind::FailedPrecondition`] (published exclusively elsewhere),
    /// [`ErrorKind::NoSpace`], and the transport's.
    pub async fn publish(&self, req: pb::PublishVolumeRequest) -> Result<Attachment> {
        self.raw().publish_volume(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Unpublishes `volume` from `node_id`; true when it was published there. Once it
    /// returns, the node's connections to the volume are closed.
    ///
    /// Errors: [`ErrorKind::NotFound`] (no such volume), [`ErrorKind::Aborted`] (the
    /// connections did not close in time: retry), and the transport's.
    pub async fn unpublish(&self, volume: &str, node_id: &str) -> Result<bool> {
        let req = pb::UnpublishVolumeRequest { volume: volume.to_owned(), node_id: node_id.to_owned() };
        let r = self.raw().unpublish_volume(req).await.map_err(ApiError::from_status)?;
        Ok(r.into_inner().was_published)
    }

    /// The storage host's id, NBD addresses, access mode, capacity and versions
    /// (ManagementService.GetHostInfo).
    ///
    /// Errors: the transport's.
    pub async fn host_info(&self) -> Result<HostInfo> {
        let r = self.raw().get_host_info(pb::GetHostInfoRequest {}).await;
        r.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Deletes a volume (not a snapshot).
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::FailedPrecondition`], and the transport's.
    pub async fn delete_volume(&self, name: &str) -> Result<()> {
        let req = pb::DeleteVolumeRequest { name: name.to_owned() };
        self.raw().delete_volume(req).await.map(|_| ()).map_err(ApiError::from_status)
    }

    /// Grows a volume to `size_bytes`.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::InvalidArgument`] (shrink, bad
    /// size, a snapshot), and the transport's.
    pub async fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<Volume> {
        let req = pb::ResizeVolumeRequest { name: name.to_owned(), size_bytes };
        self.raw().resize_volume(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// One volume or snapshot (`VOLUME@SNAPSHOT`).
    ///
    /// Errors: [`ErrorKind::NotFound`], and the transport's.
    pub async fn volume(&self, name: &str) -> Result<Volume> {
        let req = pb::GetVolumeRequest { name: name.to_owned() };
        self.raw().get_volume(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Every volume (not snapshots), sorted by name.
    ///
    /// Errors: the transport's.
    pub async fn list_volumes(&self) -> Result<Vec<Volume>> {
        let r = self.raw().list_volumes(pb::ListVolumesRequest {}).await.map_err(ApiError::from_status)?;
        Ok(r.into_inner().volumes)
    }

    /// The pool's capacity and use.
    ///
    /// Errors: the transport's.
    pub async fn pool_status(&self) -> Result<PoolStatus> {
        let r = self.raw().get_pool_status(pb::GetPoolStatusRequest {}).await.map_err(ApiError::from_status)?;
        Ok(r.into_inner())
    }

    /// Grows the pool to `size_bytes` (0: the size of its file or device now); returns
    /// its status after.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] (smaller than the pool, larger than its
    /// device, too many units), [`ErrorKind::NoSpace`] (no room to preallocate on the
    /// host), and the transport's.
    pub async fn grow_pool(&self, size_bytes: u64) -> Result<PoolStatus> {
        let req = pb::GrowPoolRequest { size_bytes };
        self.raw().grow_pool(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Takes snapshot `snapshot` of `volume`, exported as `VOLUME@SNAPSHOT`.
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`], [`ErrorKind::NoSpace`], and the transport's.
    pub async fn create_snapshot(&self, volume: &str, snapshot: &str) -> Result<Volume> {
        let req = pb::CreateSnapshotRequest {
            volume: volume.to_owned(),
            snapshot: snapshot.to_owned(),
            ..Default::default()
        };
        self.create_snapshot_with(req).await
    }

    /// Takes a snapshot as `req` says (labels; `exist_ok`: a snapshot of that name
    /// with the same labels is the answer).
    ///
    /// Errors: as [`Client::create_snapshot`].
    pub async fn create_snapshot_with(&self, req: pb::CreateSnapshotRequest) -> Result<Volume> {
        self.raw().create_snapshot(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Takes a group snapshot as `req` says (one instant for all its volumes); the
    /// members in name order.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`], [`ErrorKind::NotFound`],
    /// [`ErrorKind::AlreadyExists`], [`ErrorKind::NoSpace`], and the transport's.
    pub async fn create_group_snapshot(&self, req: pb::CreateGroupSnapshotRequest) -> Result<Vec<Volume>> {
        self.raw().create_group_snapshot(req).await.map(|r| r.into_inner().snapshots).map_err(ApiError::from_status)
    }

    /// Deletes snapshot `snapshot` of `volume`.
    ///
    /// Errors: [`ErrorKind::NotFound`], and the transport's.
    pub async fn delete_snapshot(&self, volume: &str, snapshot: &str) -> Result<()> {
        let req = pb::DeleteSnapshotRequest { volume: volume.to_owned(), snapshot: snapshot.to_owned() };
        self.raw().delete_snapshot(req).await.map(|_| ()).map_err(ApiError::from_status)
    }

    /// Snapshots of `volume`, or of every volume, sorted by name.
    ///
    /// Errors: [`ErrorKind::NotFound`] (a name with neither a volume nor snapshots),
    /// and the transport's.
    pub async fn list_snapshots(&self, volume: Option<&str>) -> Result<Vec<Volume>> {
        let req = pb::ListSnapshotsRequest { volume: volume.unwrap_or_default().to_owned() };
        let r = self.raw().list_snapshots(req).await.map_err(ApiError::from_status)?;
        Ok(r.into_inner().snapshots)
    }

    /// A writable volume `name` sharing the data of `source` (`VOLUME@SNAPSHOT` or
    /// `VOLUME`).
    ///
    /// Errors: [`ErrorKind::NotFound`], [`ErrorKind::AlreadyExists`],
    /// [`ErrorKind::InvalidArgument`], [`ErrorKind::NoSpace`], and the transport's.
    pub async fn clone_volume(&self, source: &str, name: &str) -> Result<Volume> {
        let req = pb::CloneVolumeRequest { source: source.to_owned(), name: name.to_owned(), ..Default::default() };
        self.clone_volume_with(req).await
    }

    /// Clones as `req` says (labels; `exist_ok`: a volume of that name with the same
    /// labels is the answer).
    ///
    /// Errors: as [`Client::clone_volume`].
    pub async fn clone_volume_with(&self, req: pb::CloneVolumeRequest) -> Result<Volume> {
        self.raw().clone_volume(req).await.map(|r| r.into_inner()).map_err(ApiError::from_status)
    }

    /// Byte ranges that may differ between `from` and `to` (volumes or snapshots); with
    /// `from` empty, the ranges of `to` that hold written data.
    ///
    /// Errors: [`ErrorKind::NotFound`], and the transport's.
    pub async fn diff(&self, from: &str, to: &str) -> Result<Vec<ByteRange>> {
        let req = pb::DiffSnapshotsRequest { from: from.to_owned(), to: to.to_owned() };
        let r = self.raw().diff_snapshots(req).await.map_err(ApiError::from_status)?;
        Ok(r.into_inner().ranges)
    }
}
