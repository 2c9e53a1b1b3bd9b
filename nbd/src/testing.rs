//! Test utilities: an in-memory export, and the entry points of the fuzz targets.
//!
//! Lives here: [`MemExport`] (a `Vec<u8>` behind a mutex, with per-4-KiB-block
//! allocation tracking so that reads and block status report holes), and
//! [`MemRegistry`]. Test knobs: a read delay that depends on the offset, a poisoned range
//! whose reads fail with `NBD_EIO`, a range whose reads panic, and counters of flushes and of the largest write
//! buffer ever allocated.
//! [`fuzz_handshake`] and [`fuzz_transmission`] feed arbitrary client bytes to a
//! server over an in-memory stream (used by `fuzz/` and by the corpus replay test).
//! Not here: anything durable; flush only counts.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{BlockSizes, Client, Errno, Export, ExportFlags, ExportRegistry, Extent, ReadData, Refusal};

/// Allocation granularity in bytes.
pub const BLOCK: u64 = 4096;

type DelayFn = Box<dyn Fn(u64) -> Duration + Send + Sync>;

struct State {
    data: Vec<u8>,
    /// One entry per `BLOCK`; `false` is a hole that reads as zeros.
    allocated: Vec<bool>,
}

/// A `size`-byte export held in memory, all holes at first.
pub struct MemExport {
    state: Mutex<State>,
    /// Flags the export advertises (all but read-only at first).
    pub flags: ExportFlags,
    /// Block sizes it advertises (1, 4096, 1 MiB at first).
    pub sizes: BlockSizes,
    /// Its description in the handshake.
    pub description: String,
    /// Delay applied to each read, computed from its offset.
    pub read_delay: Option<DelayFn>,
    /// Reads overlapping this byte range fail with `Eio`.
    pub poison: Option<Range<u64>>,
    /// Reads overlapping this byte range panic (an export bug), after the read delay.
    pub panic_on_read: Option<Range<u64>>,
    /// Largest `len` passed to `alloc_write_buf`, in bytes.
    pub max_write_alloc: AtomicU64,
    /// Number of `flush` calls.
    pub flushes: AtomicU64,
    /// Set by [`MemExport::revoke`]: connections to the export then close.
    revoked: tokio::sync::watch::Sender<bool>,
}

impl MemExport {
    /// An export of `size` bytes, all holes, writable, with trim, zeroes and multi-conn.
    pub fn new(size: u64) -> Self {
        let blocks = size.div_ceil(BLOCK) as usize;
        Self {
            state: Mutex::new(State { data: vec![0; size as usize], allocated: vec![false; blocks] }),
            flags: ExportFlags {
                read_only: false,
                can_trim: true,
                can_write_zeroes: true,
                can_fast_zero: true,
                can_multi_conn: true,
            },
            sizes: BlockSizes { minimum: 1, preferred: 4096, maximum: 1 << 20 },
            description: "in-memory test export".to_string(),
            read_delay: None,
            poison: None,
            panic_on_read: None,
            max_write_alloc: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            revoked: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Revokes the export: every connection to it reads no further request, answers
    /// those in flight and closes ([`crate::Error::Revoked`]).
    pub fn revoke(&self) {
        self.revoked.send_replace(true);
    }

    /// The same export, read-only.
    pub fn read_only(mut self) -> Self {
        self.flags.read_only = true;
        self
    }

    /// The same export, each read delayed by `f(offset)`.
    pub fn with_read_delay(mut self, f: impl Fn(u64) -> Duration + Send + Sync + 'static) -> Self {
        self.read_delay = Some(Box::new(f));
        self
    }

    /// Copies bytes out directly (for assertions).
    pub fn snapshot(&self, range: Range<usize>) -> Vec<u8> {
        self.state.lock().unwrap().data[range].to_vec()
    }

    fn extents(state: &State, offset: u64, len: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let block = (at / BLOCK) as usize;
            let block_end = ((at / BLOCK + 1) * BLOCK).min(end);
            let hole = !state.allocated[block];
            let length = block_end - at;
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += length,
                _ => out.push(Extent { length, hole, zero: hole }),
            }
            at = block_end;
        }
        out
    }

    fn zero_range(state: &mut State, offset: u64, len: u64, unmap: bool) {
        let (start, end) = (offset as usize, (offset + len) as usize);
        state.data[start..end].fill(0);
        let first_full = offset.div_ceil(BLOCK);
        let last_full = (offset + len) / BLOCK;
        for b in (offset / BLOCK)..(offset + len).div_ceil(BLOCK) {
            let full = b >= first_full && b < last_full;
            if unmap && full {
                state.allocated[b as usize] = false;
            } else if !unmap {
                state.allocated[b as usize] = true;
            }
        }
    }
}

impl Export for MemExport {
    type ReadBuf = Vec<u8>;
    type WriteBuf = Vec<u8>;

    fn size(&self) -> u64 {
        self.state.lock().unwrap().data.len() as u64
    }

    fn flags(&self) -> ExportFlags {
        self.flags
    }

    fn block_sizes(&self) -> BlockSizes {
        self.sizes
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn alloc_write_buf(&self, _offset: u64, len: u32) -> Vec<u8> {
        self.max_write_alloc.fetch_max(u64::from(len), Ordering::SeqCst);
        vec![0; len as usize]
    }

    async fn read(&self, offset: u64, len: u32) -> Result<ReadData<Vec<u8>>, Errno> {
        if let Some(delay) = &self.read_delay {
            tokio::time::sleep(delay(offset)).await;
        }
        let end = offset + u64::from(len);
        if let Some(p) = &self.poison {
            if offset < p.end && p.start < end {
                return Err(Errno::Eio);
            }
        }
        if let Some(p) = &self.panic_on_read {
            assert!(!(offset < p.end && p.start < end), "read of a range set to panic");
        }
        let state = self.state.lock().unwrap();
        let data = state.data[offset as usize..end as usize].to_vec();
        let extents = Self::extents(&state, offset, u64::from(len));
        Ok(ReadData { data, extents })
    }

    async fn write(&self, offset: u64, buf: Vec<u8>, _fua: bool) -> Result<(), Errno> {
        let mut state = self.state.lock().unwrap();
        let end = offset as usize + buf.len();
        state.data[offset as usize..end].copy_from_slice(&buf);
        for b in (offset / BLOCK)..(end as u64).div_ceil(BLOCK) {
            state.allocated[b as usize] = true;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<(), Errno> {
        let mut state = self.state.lock().unwrap();
        Self::zero_range(&mut state, offset, len, true);
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast_only: bool,
        _fua: bool,
    ) -> Result<(), Errno> {
        if fast_only && !may_unmap {
            return Err(Errno::Enotsup);
        }
        let mut state = self.state.lock().unwrap();
        Self::zero_range(&mut state, offset, len, may_unmap);
        Ok(())
    }

    async fn cache(&self, _offset: u64, _len: u64) -> Result<(), Errno> {
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let state = self.state.lock().unwrap();
        Ok(Self::extents(&state, offset, len))
    }

    fn revoked(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.revoked.subscribe();
        async move {
            let _ = rx.wait_for(|r| *r).await;
        }
    }
}

/// A fixed set of named exports; names in `denied` are refused
/// ([`crate::Refusal::Denied`]) to every client but [`crate::Client::Unix`] ones.
#[derive(Default)]
pub struct MemRegistry {
    /// Export names only Unix-socket clients may open.
    pub denied: Vec<String>,
    /// The exports by name, in the order they were added.
    pub exports: Vec<(String, Arc<MemExport>)>,
}

impl MemRegistry {
    /// The registry with `export` added under `name`.
    pub fn with(mut self, name: &str, export: MemExport) -> Self {
        self.exports.push((name.to_string(), Arc::new(export)));
        self
    }

    /// The export named `name` (panics if there is none: a test fixture's bug).
    pub fn get(&self, name: &str) -> Arc<MemExport> {
        self.exports.iter().find(|(n, _)| n == name).map(|(_, e)| Arc::clone(e)).expect("export in fixture")
    }
}

impl ExportRegistry for MemRegistry {
    type Export = MemExport;

    fn lookup(&self, name: &str, client: &Client) -> Result<Arc<MemExport>, Refusal> {
        let export = self.exports.iter().find(|(n, _)| n == name).map(|(_, e)| Arc::clone(e));
        let export = export.ok_or(Refusal::Unknown)?;
        if *client != Client::Unix && self.denied.iter().any(|d| d == name) {
            return Err(Refusal::Denied("not published to this client".into()));
        }
        Ok(export)
    }

    fn list(&self, client: &Client) -> Vec<(String, String)> {
        let shown = |n: &String| *client == Client::Unix || !self.denied.contains(n);
        self.exports.iter().filter(|(n, _)| shown(n)).map(|(n, e)| (n.clone(), e.description.clone())).collect()
    }
}

/// A self-signed certificate and its key (P-256, valid until 2126) for servers in
/// tests and fuzz bodies that offer TLS: nothing secret, never for a real server.
pub const TEST_CERT_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBfTCCASOgAwIBAgIUH968a8H/Iq0pzRTg0ZgONDeOQRcwCgYIKoZIzj0EAwIw\nEzERMA8GA1UEAwwIbmJkLWZ1enowIBcNMjYxMjA0MTUwNDEyWhgPMjEyNjExMTAx\nNTA0MTJaMBMxETAPBgNVBAMMCG5iZC1mdXp6MFkwEwYHKoZIzj0CAQYIKoZIzj0D\nAQcDQgAEM48T2qlpUQBEl56AsIpNnyiMZnRoszpT5egX4r7xJFf1R+0P1e7uj4rE\njlqaQmzqllSlPPSmb9V2w+ezxAmrHKNTMFEwHQYDVR0OBBYEFNAQL9D23deQhrDN\nQF15DGALgIUAMB8GA1UdIwQYMBaAFNAQL9D23deQhrDNQF15DGALgIUAMA8GA1Ud\nEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSAAwRQIgCGPZ27P0VOthlNOKTqCnieOQ\nKJmiDiH/q3snWubiv48CIQDvo7vX4nv4csDW0mvj0EriPxpVH5vm5pv+tN7Yvo1R\nTQ==\n-----END CERTIFICATE-----\n";
/// The key of [`TEST_CERT_PEM`] (PKCS#8).
pub const TEST_KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgduWweV4zbhioJ5ms\nolyCLNRvDmkNmBdgp+ykiDyDTbehRANCAAQzjxPaqWlRAESXnoCwik2fKIxmdGiz\nOlPl6BfivvEkV/VH7Q/V7u6PisSOWppCbOqWVKU89KZv1XbD57PECasc\n-----END PRIVATE KEY-----\n";

/// A rustls server configuration with [`TEST_CERT_PEM`] and no client authentication.
pub fn test_tls_config() -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    let cert = rustls::pki_types::CertificateDer::from_pem_slice(TEST_CERT_PEM.as_bytes()).expect("test certificate");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(TEST_KEY_PEM.as_bytes()).expect("test key");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .expect("test certificate and key");
    Arc::new(config)
}

/// Runs a server (TLS as `tls` says: `None` is NOTLS) over an in-memory stream whose
/// client side sends `data` and then closes its write side; reads and discards
/// everything the server sends. Returns when the server ends the connection. Never
/// panics unless the server does.
async fn feed(data: Vec<u8>, tls: Option<crate::TlsMode>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let registry = Arc::new(
        MemRegistry::default().with("fuzz", MemExport::new(1 << 20)).with("ro", MemExport::new(64 * 1024).read_only()),
    );
    let config = crate::ServerConfig {
        handshake_timeout: Duration::from_secs(5),
        max_in_flight_bytes: 4 << 20,
        tls: tls.map(|mode| crate::NbdTls { mode, source: Arc::new(test_tls_config()) }),
        ..Default::default()
    };
    let server = crate::Server::new(registry, config);
    let (mut client, stream) = tokio::io::duplex(256 * 1024);
    let serving = tokio::spawn(async move {
        // A panic in a request handler ends only its connection in a server; here it
        // is a finding.
        if let Err(e @ crate::Error::HandlerPanicked) = server.serve_connection(stream).await {
            panic!("{e}");
        }
    });
    let (mut rx, mut tx) = tokio::io::split(&mut client);
    let send = async move {
        let _ = tx.write_all(&data).await;
        let _ = tx.shutdown().await;
    };
    let drain = async move {
        let mut sink = vec![0u8; 64 * 1024];
        while matches!(rx.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    tokio::join!(send, drain);
    serving.await.expect("the NBD server panicked");
}

fn block_on(f: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
}

/// Fuzz target body: `data` is everything a client sends from the first byte on
/// (client flags, options, and, after a successful `NBD_OPT_GO`, requests), to a server
/// in each TLS mode: NOTLS, TLS at the client's choice, and TLS required (where the
/// bytes after an acknowledged `NBD_OPT_STARTTLS` go to the TLS handshake).
pub fn fuzz_handshake(data: &[u8]) {
    for tls in [None, Some(crate::TlsMode::Optional), Some(crate::TlsMode::Required)] {
        block_on(feed(data.to_vec(), tls));
    }
}

/// Fuzz target body: a fixed handshake (structured replies, `base:allocation`,
/// `NBD_OPT_GO` to a 1 MiB export) followed by `data` as transmission-phase requests.
pub fn fuzz_transmission(data: &[u8]) {
    use crate::proto::*;
    let mut input = Vec::new();
    input.extend_from_slice(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes());
    let opt = |input: &mut Vec<u8>, option: u32, body: &[u8]| {
        input.extend_from_slice(&OptionHeader { option, length: body.len() as u32 }.encode());
        input.extend_from_slice(body);
    };
    opt(&mut input, NBD_OPT_STRUCTURED_REPLY, &[]);
    let meta = MetaContextRequest { export_name: "fuzz".into(), queries: vec![BASE_ALLOCATION.into()] };
    opt(&mut input, NBD_OPT_SET_META_CONTEXT, &meta.encode());
    opt(&mut input, NBD_OPT_GO, &InfoRequest { name: "fuzz".into(), requests: vec![] }.encode());
    input.extend_from_slice(data);
    block_on(feed(input, None));
}
