//! NBD exports backed by the engine: each volume is an export named after it, and a
//! published volume also under its attachments' export names (`VOLUME/KEY`).
//!
//! Lives here: [`VolumeExport`] (the `nbd::Export` implementation over a
//! `storage_engine::Volume`, read-only and revocable as its attachment says, held to
//! the volume's QoS limits) and
//! [`PoolRegistry`] (export lookup and listing, with the access decision of
//! [`NbdAccess`]). Not here: the protocol (the `nbd` crate), the data path (the
//! engine), the revocation signals and name parsing (access.rs).

use std::sync::Arc;

use nbd::{BlockSizes, Client, Errno, Export, ExportFlags, ExportRegistry, Extent, ReadData, Refusal};
use storage_engine::{AlignedBuf, Pool, Volume, MAX_IO_BYTES};
use tokio::sync::watch;

use crate::access::{ExportName, Fences, NbdAccess};

use crate::errors::nbd_errno;
use crate::host::Working;
use crate::metrics::{Metrics, VolumeMetrics};
use crate::qos::{Direction, Limiter, Limiters};

fn log_err(op: &'static str, e: storage_engine::Error) -> Errno {
    match e.kind() {
        storage_engine::ErrorKind::Io | storage_engine::ErrorKind::Failed | storage_engine::ErrorKind::Corrupt => {
            tracing::error!(error = %e, op, "request failed")
        }
        _ => tracing::debug!(error = %e, op, "request refused"),
    }
    nbd_errno(&e)
}

/// One volume served over NBD: read-only when it is a snapshot or the attachment it
/// was opened with is; `fence` is that attachment's revocation signal.
pub struct VolumeExport {
    vol: Volume,
    m: VolumeMetrics,
    read_only: bool,
    fence: Option<watch::Receiver<bool>>,
    /// The volume's QoS limiter, shared with its other connections.
    qos: Arc<Limiter>,
    /// Appended to the description: the server's crash generation.
    tag: Arc<str>,
}

impl VolumeExport {
    /// Waits for the volume's QoS limits to let a request go, counting the time held
    /// back. `EPERM` when the attachment is revoked first (or was already): a request
    /// waiting its turn does not hold a fenced connection open, and never runs.
    async fn admit(&self, dir: Direction, bytes: u64) -> Result<(), Errno> {
        self.check_fence()?;
        if !self.qos.is_limited() {
            return Ok(());
        }
        let waited = tokio::select! {
            biased;
            () = self.revoked() => return Err(Errno::Eperm),
            waited = self.qos.admit(dir, bytes) => waited,
        };
        if !waited.is_zero() {
            self.m.throttled(waited);
        }
        Ok(())
    }

    /// `EPERM` for a change once the attachment was revoked: a request whose payload
    /// was still arriving, or that waited for memory, when the unpublish came does not
    /// reach the volume (the connection closes once it is answered).
    fn check_fence(&self) -> Result<(), Errno> {
        match &self.fence {
            Some(f) if *f.borrow() => Err(Errno::Eperm),
            _ => Ok(()),
        }
    }
}

impl Export for VolumeExport {
    type ReadBuf = AlignedBuf;
    type WriteBuf = AlignedBuf;

    fn size(&self) -> u64 {
        self.vol.size()
    }

    fn flags(&self) -> ExportFlags {
        let rw = !self.vol.is_snapshot() && !self.read_only;
        ExportFlags { read_only: !rw, can_trim: rw, can_write_zeroes: rw, can_fast_zero: rw, can_multi_conn: true }
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes { minimum: 1, preferred: 4096, maximum: MAX_IO_BYTES as u32 }
    }

    fn description(&self) -> String {
        format!("{}{}", describe(&self.vol), self.tag)
    }

    fn alloc_write_buf(&self, offset: u64, len: u32) -> AlignedBuf {
        self.vol.alloc_write_buf(offset, len as usize)
    }

    async fn read(&self, offset: u64, len: u32) -> Result<ReadData<AlignedBuf>, Errno> {
        let _working = Working::begin();
        self.admit(Direction::Read, u64::from(len)).await?;
        let t = std::time::Instant::now();
        let r = self.vol.read(offset, u64::from(len)).await;
        self.m.read(u64::from(len), t.elapsed(), r.is_ok());
        let r = r.map_err(|e| log_err("read", e))?;
        let extents = if r.extents.len() == 1 && r.extents[0].allocated {
            Vec::new()
        } else {
            r.extents.iter().map(|e| Extent { length: e.length, hole: !e.allocated, zero: !e.allocated }).collect()
        };
        Ok(ReadData { data: r.data, extents })
    }

    async fn write(&self, offset: u64, buf: AlignedBuf, fua: bool) -> Result<(), Errno> {
        let _working = Working::begin();
        let len = buf.as_ref().len() as u64;
        self.admit(Direction::Write, len).await?;
        self.check_fence()?;
        let t = std::time::Instant::now();
        let r = self.vol.write(offset, buf, fua).await;
        self.m.write(len, t.elapsed(), r.is_ok());
        r.map_err(|e| log_err("write", e))
    }

    fn times_requests(&self) -> bool {
        self.m.times_requests()
    }

    fn request_timed(&self, times: &nbd::RequestTimes) {
        self.m.request_timed(times)
    }

    async fn flush(&self) -> Result<(), Errno> {
        let _working = Working::begin();
        let r = self.vol.flush().await;
        self.m.flush(r.is_ok());
        r.map_err(|e| log_err("flush", e))
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        let _working = Working::begin();
        self.admit(Direction::Write, 0).await?;
        self.check_fence()?;
        let r = self.vol.trim(offset, len, fua).await;
        self.m.trim(r.is_ok());
        r.map_err(|e| log_err("trim", e))
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), Errno> {
        let _working = Working::begin();
        // Zeroing by unmapping is a metadata change (fast); NO_HOLE writes real zeros.
        if fast_only && !may_unmap {
            return Err(Errno::Enotsup);
        }
        // Zeros written (NO_HOLE) count as bytes written; unmapping counts none.
        self.admit(Direction::Write, if may_unmap { 0 } else { len }).await?;
        self.check_fence()?;
        let r = self.vol.write_zeroes(offset, len, may_unmap, fua).await;
        self.m.trim(r.is_ok());
        r.map_err(|e| log_err("write zeroes", e))
    }

    async fn cache(&self, _offset: u64, _len: u64) -> Result<(), Errno> {
        // No server-side data cache (O_DIRECT); nothing to prefetch into.
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let ext = self.vol.block_status(offset, len).map_err(|e| log_err("block status", e))?;
        Ok(ext.into_iter().map(|e| Extent { length: e.length, hole: !e.allocated, zero: !e.allocated }).collect())
    }

    fn revoked(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let fence = self.fence.clone();
        async move {
            match fence {
                // An error means the signal is gone: only after a revocation.
                Some(mut rx) => {
                    let _ = rx.wait_for(|r| *r).await;
                }
                None => std::future::pending().await,
            }
        }
    }
}

/// The pool's volumes as NBD exports.
pub struct PoolRegistry {
    pool: Pool,
    metrics: Arc<Metrics>,
    access: NbdAccess,
    fences: Arc<Fences>,
    limits: Arc<Limiters>,
    tag: Arc<str>,
}

/// Told to a TCP client that names a volume without a key under [`NbdAccess::Attached`].
const NEEDS_KEY: &str = "this server serves a volume over TCP only to a node it is published to: open the \
                         export name that PublishVolume returned (VOLUME/KEY)";
/// Told to a client whose key is not (or no longer) one of the volume's attachments.
const NOT_PUBLISHED: &str = "the volume is not published with this key (unpublished, or another volume's key)";
const OTHER_NODE: &str = "the volume is published with this key to another node than the one the client's \
                          certificate names";

impl PoolRegistry {
    /// Exports every volume of `pool`, present and future, counting their requests in
    /// `metrics`, to the clients `access` allows; keyed connections watch their key's
    /// signal in `fences`; requests wait for their volume's limiter in `limits`.
    pub fn new(
        pool: Pool,
        metrics: Arc<Metrics>,
        access: NbdAccess,
        fences: Arc<Fences>,
        limits: Arc<Limiters>,
    ) -> PoolRegistry {
        PoolRegistry { pool, metrics, access, fences, limits, tag: "".into() }
    }

    /// Tells `generation` at the end of every export's description (`NBD_INFO_DESCRIPTION`
    /// and `NBD_OPT_LIST`), where a reconnecting client finds it
    /// ([`nbd::client::CrashGeneration`]).
    pub fn with_crash_generation(mut self, generation: &nbd::client::CrashGeneration) -> PoolRegistry {
        self.tag = format!("; {}", generation.tag()).into();
        self
    }

    pub(crate) fn export(
        &self,
        vol: Volume,
        read_only: bool,
        fence: Option<watch::Receiver<bool>>,
    ) -> Arc<VolumeExport> {
        Arc::new(VolumeExport {
            m: self.metrics.volume(vol.name(), vol.id()),
            qos: self.limits.get(vol.name(), vol.id(), &vol.labels()),
            vol,
            read_only,
            fence,
            tag: Arc::clone(&self.tag),
        })
    }
}

/// The export description, the same in `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
fn describe(vol: &Volume) -> String {
    let kind = if vol.is_snapshot() { "read-only snapshot" } else { "thin volume" };
    let fresh = if vol.is_pristine() { format!(", {}", nbd::client::NEVER_WRITTEN) } else { String::new() };
    format!("ferrovol {kind} {}, {} bytes, {} KiB data units{fresh}", vol.name(), vol.size(), vol.unit_size() / 1024)
}

/// Whether `client` may use an attachment to `node_id` as far as TLS goes: a client
/// that started TLS must have presented a certificate naming that node; one without
/// TLS is judged by the key alone.
fn tls_names(client: &Client, node_id: &str) -> bool {
    match client {
        Client::Tls { certificate: Some(der), .. } => crate::tls::names_node(der, node_id),
        Client::Tls { certificate: None, .. } => false,
        _ => true,
    }
}

impl ExportRegistry for PoolRegistry {
    type Export = VolumeExport;

    /// `VOLUME/KEY` opens a volume published with that key, read-only when published
    /// so, for as long as it stays published, and over TLS only for a client whose
    /// certificate names the node it is published to; a plain name opens it for unix-socket
    /// clients, and for TCP ones under [`NbdAccess::Open`].
    fn lookup(&self, name: &str, client: &Client) -> Result<Arc<VolumeExport>, Refusal> {
        match ExportName::parse(name) {
            ExportName::Malformed => Err(Refusal::Unknown),
            ExportName::Plain(name) => {
                // Refused before the look-up: a client without a key learns nothing,
                // not even which names exist. Only a unix-socket client is trusted.
                if self.access == NbdAccess::Attached && *client != Client::Unix {
                    return Err(Refusal::Denied(NEEDS_KEY.into()));
                }
                let vol = self.pool.volume(name).map_err(|_| Refusal::Unknown)?;
                Ok(self.export(vol, false, None))
            }
            ExportName::Keyed(name, key) => {
                // Under attached access a key for a volume that does not exist gets the
                // answer a wrong key gets: a client without a key learns no names.
                let hidden = self.access == NbdAccess::Attached && *client != Client::Unix;
                let vol = self.pool.volume(name).map_err(|_| match hidden {
                    true => Refusal::Denied(NOT_PUBLISHED.into()),
                    false => Refusal::Unknown,
                })?;
                // Subscribe before looking: an unpublish that removes the attachment
                // after the look raises the signal this connection then holds.
                let fence = self.fences.subscribe(&key);
                match vol.attachments().into_iter().find(|a| a.key == key) {
                    // Over TLS the key is not enough: the certificate must name the
                    // node the volume is published to.
                    Some(a) if !tls_names(client, &a.node_id) => {
                        drop(fence);
                        self.fences.forget_unused(&key);
                        let subject = match client {
                            Client::Tls { certificate: Some(der), .. } => crate::tls::certificate_subject(der),
                            _ => "none".to_owned(),
                        };
                        tracing::info!(
                            volume = name,
                            node = a.node_id,
                            certificate = subject,
                            "refused: the certificate names another node"
                        );
                        Err(Refusal::Denied(OTHER_NODE.into()))
                    }
                    Some(a) => Ok(self.export(vol, a.read_only, Some(fence))),
                    None => {
                        drop(fence);
                        self.fences.forget_unused(&key);
                        Err(Refusal::Denied(NOT_PUBLISHED.into()))
                    }
                }
            }
        }
    }

    /// Cheap whatever the pool holds (no space accounting): it runs on the data plane.
    /// TCP clients under [`NbdAccess::Attached`] see nothing: they open no name
    /// without its key, and keys are never listed.
    fn list(&self, client: &Client) -> Vec<(String, String)> {
        if self.access == NbdAccess::Attached && *client != Client::Unix {
            return Vec::new();
        }
        let names = self.pool.names();
        names
            .into_iter()
            .filter_map(|n| self.pool.volume(&n).ok().map(|v| (n, format!("{}{}", describe(&v), self.tag))))
            .collect()
    }

    fn shown_name(&self, name: &str) -> String {
        ExportName::shown(name)
    }

    /// A volume's connections count together, whatever name or key opened them.
    fn counted_as(&self, name: &str) -> String {
        ExportName::volume(name).to_owned()
    }
}
