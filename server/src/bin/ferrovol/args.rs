//! The command line: what `ferrovol` accepts (clap), and how `serve`'s flags become a
//! [`HostOptions`]. Not here: what the commands do (admin.rs, main.rs).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferrovol::access::NbdAccessMode;
use ferrovol::host::HostOptions;

/// Thin-provisioned volumes in a pool, served over NBD.
#[derive(Parser)]
#[command(name = "ferrovol", version, about)]
pub(crate) struct Cli {
    /// Directory holding the pool file (pool.img) and the sockets.
    #[arg(long, global = true, env = "FERROVOL_DATA_DIR", default_value = "./ferrovol-data")]
    pub(crate) data_dir: PathBuf,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

/// The management socket, for the commands that use it (not `check`, which reads a
/// stopped pool).
#[derive(clap::Args)]
pub(crate) struct Mgmt {
    /// Management socket (default: <data-dir>/ferrovol.sock).
    #[arg(long, global = true, env = "FERROVOL_SOCKET")]
    pub(crate) socket: Option<PathBuf>,
    /// Call a remote server's management API at HOST:PORT over mutual TLS instead of
    /// the socket (with --api-ca, --api-cert, --api-key).
    #[arg(long, global = true, env = "FERROVOL_API", requires_all = ["api_ca", "api_cert", "api_key"])]
    pub(crate) api: Option<String>,
    /// With --api: CA certificates (PEM) the server's certificate must chain to.
    #[arg(long, global = true, env = "FERROVOL_API_CA")]
    pub(crate) api_ca: Option<PathBuf>,
    /// With --api: this client's certificate (PEM).
    #[arg(long, global = true, env = "FERROVOL_API_CERT")]
    pub(crate) api_cert: Option<PathBuf>,
    /// With --api: this client's private key (PEM).
    #[arg(long, global = true, env = "FERROVOL_API_KEY")]
    pub(crate) api_key: Option<PathBuf>,
}

/// Where the administrative commands call the management API.
pub(crate) enum Target {
    /// The local server's unix socket.
    Unix(PathBuf),
    /// A server's TCP address, over mutual TLS.
    Tls(String, mgmt_api::ClientTls),
}

impl Mgmt {
    pub(crate) fn path(&self, data_dir: &Path) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| data_dir.join("ferrovol.sock"))
    }

    pub(crate) fn target(&self, data_dir: &Path) -> Target {
        match (&self.api, &self.api_ca, &self.api_cert, &self.api_key) {
            (Some(addr), Some(ca), Some(cert), Some(key)) => {
                Target::Tls(addr.clone(), mgmt_api::ClientTls { ca: ca.clone(), cert: cert.clone(), key: key.clone() })
            }
            _ => Target::Unix(self.path(data_dir)),
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Run the storage server: create or open the pool and serve every volume over NBD.
    Serve {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(flatten)]
        args: Box<ServeArgs>,
    },
    /// Create, list, resize and delete volumes on a running server.
    Volume {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// Create, list, delete and diff snapshots on a running server.
    Snapshot {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
    /// The storage host: id, NBD addresses and access mode, capacity, versions.
    Host {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(subcommand)]
        cmd: HostCmd,
    },
    /// Pool information from a running server.
    Pool {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(subcommand)]
        cmd: PoolCmd,
    },
    /// Attach an NBD export as a local block device (/dev/nbdN) through the kernel's
    /// netlink interface, detach it, list the devices. Needs root and the nbd module.
    Nbd {
        #[command(subcommand)]
        cmd: NbdCmd,
    },
    /// The CSI driver's services (Container Storage Interface, for Kubernetes).
    Csi {
        #[command(subcommand)]
        cmd: CsiCmd,
    },
    /// Verify a stopped pool: checksums, mappings against refcounts, free space.
    /// Exits 1 naming each problem found (a file that holds no pool, or one too damaged
    /// to load, included), 2 if the pool cannot be checked (in use, missing,
    /// unreadable). What the pool opens despite is printed as `warning:` lines (a
    /// damaged older superblock slot; in a pool of format version 2 or older, valid log
    /// batches behind a damaged one, an error from version 3 on).
    ///
    /// With --repair, a pool whose refcounts disagree with its mappings (what open
    /// refuses) gets them rebuilt from the mappings, with the free space, and a fresh
    /// checkpoint; each change is printed. A pool whose mappings or records are damaged
    /// is refused (exit 1) and left unchanged: the mappings are what a repair trusts.
    Check {
        /// Pool file or block device (default: <data-dir>/pool.img).
        #[arg(long)]
        pool: Option<PathBuf>,
        /// Rebuild the refcounts and free space from the mappings (stop the server first).
        #[arg(long)]
        repair: bool,
    },
}

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// Pool file or raw block device (default: <data-dir>/pool.img, created if missing).
    #[arg(long)]
    pub(crate) pool: Option<PathBuf>,
    /// Size of a new pool file (K, M, G, T are powers of 1024) [default: 64GiB]. An
    /// existing pool file smaller than this is grown to it at start; a larger one is
    /// kept (a pool never shrinks). A block device's pool is grown with `pool grow`.
    #[arg(long, value_parser = parse_size)]
    pub(crate) pool_size: Option<u64>,
    /// Data-unit (allocation-unit) size of a new pool: 16K, 32K, 64K or 128K.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    pub(crate) unit_size: u64,
    /// TCP address for NBD.
    #[arg(long, default_value = "127.0.0.1:10809")]
    pub(crate) listen: SocketAddr,
    /// Unix socket for NBD (default: <data-dir>/nbd.sock).
    #[arg(long)]
    pub(crate) nbd_socket: Option<PathBuf>,
    /// Who may open an export over TCP: `open` (anyone who reaches the port, by volume
    /// name), `attached` (only a node a volume is published to, with the export name
    /// `volume publish` gives: VOLUME/KEY), or `auto`: open when --listen is a loopback
    /// address, attached otherwise. Unix-socket clients may always open any volume.
    #[arg(long, default_value = "auto")]
    pub(crate) nbd_access: NbdAccessMode,
    /// host:port at which nodes reach this server's NBD listener, reported to them
    /// instead of --listen (repeat for several; for NAT, or --listen 0.0.0.0:PORT).
    #[arg(long)]
    pub(crate) advertise: Vec<String>,
    /// Also serve the management API over TCP at this address, with mutual TLS only
    /// (--tls-cert, --tls-key, --tls-client-ca; the files are read again on SIGHUP).
    #[arg(long, requires_all = ["server_tls_cert", "server_tls_key", "tls_client_ca"])]
    pub(crate) api_listen: Option<SocketAddr>,
    /// NBD over TLS (NBD_OPT_STARTTLS) with the --tls-* files, mutual (a client
    /// presents a certificate of --tls-client-ca): `optional` (TLS at the client's
    /// choice) or `required` (every option before STARTTLS is refused with
    /// NBD_REP_ERR_TLS_REQD). The Linux kernel's client cannot do TLS.
    #[arg(long, value_enum, default_value_t = NbdTlsArg::Off,
          requires_ifs = [("optional", "server_tls_cert"), ("required", "server_tls_cert"),
                          ("optional", "nbd_tls_client_ca"), ("required", "nbd_tls_client_ca")])]
    pub(crate) nbd_tls: NbdTlsArg,
    /// With --nbd-tls: CA certificates (PEM) an NBD client's (a node's) certificate
    /// must chain to. Not the management API's --tls-client-ca: a node's certificate
    /// must not be able to call the API.
    #[arg(long, value_name = "FILE")]
    pub(crate) nbd_tls_client_ca: Option<PathBuf>,
    /// With --api-listen or --nbd-tls: the server's certificate chain (PEM).
    #[arg(long = "tls-cert", id = "server_tls_cert", value_name = "FILE", requires = "server_tls_key")]
    pub(crate) server_tls_cert: Option<PathBuf>,
    /// With --api-listen or --nbd-tls: the server's private key (PEM).
    #[arg(long = "tls-key", id = "server_tls_key", value_name = "FILE")]
    pub(crate) server_tls_key: Option<PathBuf>,
    /// With --api-listen: CA certificates (PEM) a management API caller's certificate
    /// must chain to; a client without one is refused before any call.
    #[arg(long)]
    pub(crate) tls_client_ca: Option<PathBuf>,
    /// With --pool on a block device: if the device holds no ferrovol pool, format it
    /// as a new one (destroys its contents).
    #[arg(long)]
    pub(crate) format: bool,
    /// Seconds a client in the handshake (before it chooses an export) may go without
    /// sending or reading a byte; the whole handshake may take ten times this at most.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) handshake_timeout: u64,
    /// Seconds without requests after which an idle NBD connection is closed; 0 never
    /// closes (the kernel's client keeps idle connections for as long as a device is attached).
    #[arg(long, default_value_t = 0)]
    pub(crate) idle_timeout: u64,
    /// NBD connections open at once, over TCP and the unix socket.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_connections: u64,
    /// NBD connections at once to one volume or snapshot.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_connections_per_export: u64,
    /// READ and WRITE payload bytes one connection may have buffered at once; past it
    /// the server stops reading that client's requests (backpressure).
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    pub(crate) max_in_flight_bytes: u64,
    /// Bytes of READ data, WRITE payload and block status replies all connections
    /// together may hold at once; past it requests wait. Each connection also has 2 MiB
    /// of its own outside it, so memory stays under this plus 2 MiB per connection.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub(crate) max_total_in_flight_bytes: u64,
    /// Seconds a client may take to read the next 256 KiB of a reply or to send the next
    /// 256 KiB of a WRITE payload; a connection that takes longer is closed, freeing
    /// what it held.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) stall_timeout: u64,
    /// Seconds connections get, once the server is told to stop, to finish requests in
    /// flight (and, with --soft-disconnect eshutdown, to disconnect).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub(crate) shutdown_grace: u64,
    /// What a stopping server does with requests it has not started: `close` (read no
    /// more, answer those in flight, close: a reconnecting client sends the rest to the
    /// next server, and the kernel's file systems see no error) or `eshutdown` (answer
    /// them NBD_ESHUTDOWN, the NBD spec's soft disconnect, which the kernel's client
    /// takes for an I/O error).
    #[arg(long, value_enum, default_value_t = SoftDisconnectArg::Close)]
    pub(crate) soft_disconnect: SoftDisconnectArg,
    /// Open the pool even if one superblock slot is damaged and may have held the newer
    /// generation: the pool is opened from the other slot, losing whatever was committed
    /// after it. Without it such a pool is refused (the error says so).
    #[arg(long)]
    pub(crate) accept_superblock_rollback: bool,
    /// Open the pool even if a metadata log batch is damaged with a later commit intact
    /// behind it: the log is replayed up to the damaged batch, losing the commits from it
    /// on. Without it such a pool is refused (the error names the batches).
    #[arg(long)]
    pub(crate) accept_log_loss: bool,
    /// Allocate every block of the pool file on the host file system at create and at
    /// open (fallocate), so that no write ever needs room from it. Without it the pool
    /// file is sparse: when the host file system fills up, writes that need new room
    /// get ENOSPC, as in a full pool. No effect on a block device.
    #[arg(long)]
    pub(crate) preallocate: bool,
    /// With --pool a block device: pass the data units the pool frees (deleted volumes
    /// and snapshots, trims of whole units) down to it as discards, so that a
    /// thin-provisioned or flash device gets the space back. A pool file always gives
    /// freed units back to its file system (hole punching) unless preallocated.
    #[arg(long)]
    pub(crate) discard: bool,
    /// NBD data-plane threads, each with its own io_uring; a connection stays on the one
    /// serving the fewest connections when it is accepted. One thread batches the most
    /// requests per wake-up and was fastest on a 2-core host with its clients on the
    /// same cores (BENCHMARKS.md); more let a host with cores to spare serve more
    /// connections at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub(crate) dataplane_threads: u64,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`); off by default.
    #[arg(long)]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Time each NBD request by stage (receive, serve, reply), exported with
    /// --metrics-listen as ferrovol_nbd_request_stage_seconds: three clock reads and
    /// three histogram updates per request. Off by default.
    #[arg(long)]
    pub(crate) request_timing: bool,
    /// Enter the kernel once per request for its storage I/O, instead of once per turn
    /// of a data-plane thread for every request that turn started (the default, which
    /// takes less CPU per I/O at queue depth; BENCHMARKS.md). For comparing the two.
    #[arg(long)]
    pub(crate) io_immediate_enter: bool,
    /// Microseconds (0 to 1000) a data-plane thread keeps polling its connections and
    /// io_uring after its last work before it sleeps: lower latency for a lone request,
    /// for a core kept busy while it polls (BENCHMARKS.md). 0, the default, sleeps at
    /// once.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub(crate) busy_poll_us: u64,
}

/// A volume's QoS limits (per volume, whatever the number of connections; a request
/// over a limit waits its turn).
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct QosArgs {
    /// READ requests per second (0: no limit).
    #[arg(long)]
    pub(crate) read_iops: Option<u64>,
    /// WRITE, TRIM and WRITE_ZEROES requests per second (0: no limit).
    #[arg(long)]
    pub(crate) write_iops: Option<u64>,
    /// Bytes read per second (e.g. 100M: powers of 1024; 0: no limit).
    #[arg(long, value_parser = parse_rate)]
    pub(crate) read_bps: Option<u64>,
    /// Bytes written per second (e.g. 50M: powers of 1024; 0: no limit).
    #[arg(long, value_parser = parse_rate)]
    pub(crate) write_bps: Option<u64>,
    /// How far ahead of its limits an idle volume may run, in milliseconds (0 to 60000).
    #[arg(long)]
    pub(crate) burst_ms: Option<u32>,
}

impl QosArgs {
    /// `base` with the limits given here over it.
    pub(crate) fn over(&self, base: mgmt_api::Qos) -> mgmt_api::Qos {
        mgmt_api::Qos {
            read_iops: self.read_iops.unwrap_or(base.read_iops),
            write_iops: self.write_iops.unwrap_or(base.write_iops),
            read_bytes_per_second: self.read_bps.unwrap_or(base.read_bytes_per_second),
            write_bytes_per_second: self.write_bps.unwrap_or(base.write_bytes_per_second),
            burst_ms: self.burst_ms.unwrap_or(base.burst_ms),
        }
    }
}

/// A rate in bytes per second: a size as [`parse_size`] reads it, 0 allowed.
fn parse_rate(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_size(s)
}

#[derive(Subcommand)]
pub(crate) enum VolumeCmd {
    /// Create a thin volume (exported over NBD under its name).
    Create {
        /// Volume name (also its NBD export name): 1 to 128 of A-Z a-z 0-9 . _ -, not
        /// starting with . or -
        name: String,
        /// Virtual size, a multiple of 4096 bytes, at most 1 PiB (e.g. 10GiB; K, M, G, T,
        /// P are powers of 1024, so 10GB is 10 GiB too).
        #[arg(long, value_parser = parse_size)]
        size: u64,
        /// A label KEY=VALUE kept with the volume (repeat; at most 16).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Succeed when a volume of that name, size, labels and limits exists already.
        #[arg(long)]
        exist_ok: bool,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Change a volume's QoS limits, at once on its open connections: the limits given
    /// change, the others stay (0 removes one; --clear removes all first).
    SetQos {
        /// Volume name.
        name: String,
        /// Remove every limit before applying those given.
        #[arg(long)]
        clear: bool,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Publish a volume to a node: prints the NBD export name (VOLUME/KEY, a secret) and
    /// addresses the node opens it at. Idempotent for the same node and flags.
    Publish {
        /// Volume name.
        name: String,
        /// The node (a CSI node id).
        #[arg(long)]
        node: String,
        /// The node may only read.
        #[arg(long)]
        read_only: bool,
        /// No other node may be published to while this one is.
        #[arg(long)]
        exclusive: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Unpublish a volume from a node: its key stops working, and its open NBD
    /// connections are closed (after answering what they have in flight) before this
    /// returns.
    Unpublish {
        /// Volume name.
        name: String,
        /// The node.
        #[arg(long)]
        node: String,
    },
    /// Expose a volume (or VOLUME@SNAPSHOT, read-only) on this storage host as a local
    /// block device through Linux's ublk driver: prints /dev/ublkbN. Needs a server
    /// built with the `ublk` feature, a kernel with ublk_drv, and CAP_SYS_ADMIN.
    AttachLocal {
        /// Volume name, or VOLUME@SNAPSHOT.
        name: String,
    },
    /// Remove a volume's local block device (requests in flight on it fail).
    DetachLocal {
        /// Volume name, or VOLUME@SNAPSHOT.
        name: String,
    },
    /// List volumes with virtual size and allocated bytes.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one volume (or VOLUME@SNAPSHOT).
    Info {
        /// Volume name, or VOLUME@SNAPSHOT.
        name: String,
        /// Print JSON (with exclusive and shared bytes) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and free the space only it held (its snapshots and clones keep
    /// theirs).
    Delete {
        /// Volume name.
        name: String,
    },
    /// Grow a volume online (shrinking is refused); new NBD connections see the new size.
    Resize {
        /// Volume name.
        name: String,
        /// New virtual size, a multiple of 4096 bytes, not below the current one.
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    /// Create a writable volume from a snapshot (VOLUME@SNAPSHOT) or a volume, sharing its data.
    Clone {
        /// VOLUME@SNAPSHOT or VOLUME.
        #[arg(long)]
        from: String,
        /// Name of the new volume.
        name: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum SnapshotCmd {
    /// Take a read-only, crash-consistent snapshot (exported as VOLUME@SNAPSHOT).
    Create {
        /// Volume to snapshot.
        volume: String,
        /// Snapshot name (same rules as volume names).
        snapshot: String,
    },
    /// Take snapshot SNAPSHOT of several volumes at one instant (a group snapshot:
    /// writes to all of them are held back together), e.g. a database's data and log.
    CreateGroup {
        /// Snapshot name, the same on every volume (VOLUME@SNAPSHOT).
        snapshot: String,
        /// The volumes (one or more).
        #[arg(required = true, num_args = 1..)]
        volumes: Vec<String>,
    },
    /// List snapshots (of VOLUME, or all) with allocated, exclusive and shared bytes.
    List {
        /// Only this volume's snapshots.
        volume: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot.
    Delete {
        /// Volume the snapshot belongs to.
        volume: String,
        /// Snapshot name.
        snapshot: String,
    },
    /// Byte ranges that differ between two snapshots (or a snapshot and its volume).
    Diff {
        /// VOLUME@SNAPSHOT (or VOLUME).
        from: String,
        /// VOLUME@SNAPSHOT (or VOLUME).
        to: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `--nbd-tls`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum NbdTlsArg {
    /// NBD without TLS (NBD_OPT_STARTTLS is answered NBD_REP_ERR_UNSUP).
    Off,
    /// TLS at the client's choice.
    Optional,
    /// TLS before any other option.
    Required,
}

/// `--soft-disconnect`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum SoftDisconnectArg {
    /// Close without running or answering new requests.
    Close,
    /// Answer new requests NBD_ESHUTDOWN.
    Eshutdown,
}

#[derive(Subcommand)]
pub(crate) enum NbdCmd {
    /// Attach an export; prints the device. URI: nbd://HOST[:PORT]/EXPORT (a ferrovol
    /// export name from `volume publish` is VOLUME/KEY), nbds:// for the same over TLS
    /// (with --tls-dir; the kernel keeps the TLS session: `modprobe tls`), or
    /// nbd+unix:///EXPORT?socket=PATH.
    /// Writes the device's reconnect record in --run-dir for `nbd watch`.
    Attach {
        /// The export.
        uri: String,
        /// The device to use (/dev/nbdN); any free one by default.
        #[arg(long)]
        device: Option<String>,
        /// Connections to open (more than 1 when the export allows several).
        #[arg(long, default_value_t = 1)]
        connections: u32,
        /// Seconds the kernel keeps requests waiting for a reconnect once every
        /// connection is dead, before it fails them; 0 fails them at once.
        #[arg(long, default_value_t = 120)]
        dead_timeout: u64,
        /// The backend identifier the kernel keeps for the device (default: the
        /// address and the export's volume, without any key).
        #[arg(long)]
        backend: Option<String>,
        /// Where reconnect records live (root only: they hold export keys).
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
        /// For nbds:// URIs: a directory with ca.crt (the CA of the server's
        /// certificate), tls.crt and tls.key (this client's), the layout of a Kubernetes
        /// TLS Secret. Kept in the record: reconnects read the files again.
        #[arg(long, env = "FERROVOL_NBD_TLS_DIR")]
        tls_dir: Option<PathBuf>,
    },
    /// Detach a device: requests in flight end with an error, the device stays, free.
    Detach {
        /// /dev/nbdN.
        device: String,
        /// Where reconnect records live.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
    /// The devices with their backend identifiers (from the kernel) and health (from
    /// the watcher): alive, reconnecting, fenced, or unwatched.
    List {
        /// Free devices too.
        #[arg(long)]
        all: bool,
        /// Where reconnect records live.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
    /// Keep attached devices connected: on the kernel's link-dead message, handshake
    /// again and hand the device new sockets (NBD_CMD_RECONFIGURE). One per node; it may
    /// be stopped and started while devices are in use. Runs until killed.
    Watch {
        /// Seconds between reconnect attempts at first (doubling up to 8 times that).
        #[arg(long, default_value_t = 0.5)]
        retry: f64,
        /// Where reconnect records live.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
    /// Make a device take its export's new size (after `volume resize`), mounted or not;
    /// prints the size in bytes.
    Resize {
        /// /dev/nbdN.
        device: String,
        /// Where reconnect records live.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
    /// Hand a device new connections now, to its export or to URI (the kernel refuses
    /// another backend).
    Reconnect {
        /// /dev/nbdN.
        device: String,
        /// Another URI for the same export (a new address or key).
        uri: Option<String>,
        /// The backend identifier URI leads to (default: its address and volume).
        #[arg(long, requires = "uri")]
        backend: Option<String>,
        /// Where reconnect records live.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
}

#[derive(Subcommand)]
pub(crate) enum CsiCmd {
    /// Serve the CSI Identity and Controller services: place volumes on the storage
    /// hosts of --config and manage them through their management APIs. Keeps no
    /// state of its own (the hosts are the source of truth).
    Controller {
        /// Where to serve: unix:///PATH (for the Kubernetes sidecars) or tcp://HOST:PORT.
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: csi::serve::Endpoint,
        /// The storage hosts (TOML: [[host]] entries with name, api, zone; see the README).
        #[arg(long)]
        config: PathBuf,
    },
    /// Serve the CSI Identity and Node services of this node: attach published volumes
    /// over NBD (/dev/nbdN), format them once, mount, publish, grow and watch them. Needs
    /// root; run `ferrovol nbd watch` beside it for reconnects.
    Node {
        /// Where to serve: unix:///PATH (for the Kubernetes sidecars) or tcp://HOST:PORT.
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: csi::serve::Endpoint,
        /// This node's Kubernetes node name (its node ID is ferrovol:NAME).
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// This node's zone (topology.ferrovol.io/zone), if the cluster has zones.
        #[arg(long)]
        zone: Option<String>,
        /// Where NBD reconnect records live, shared with `ferrovol nbd watch`.
        #[arg(long, env = "FERROVOL_NBD_RUN_DIR", default_value = nbd::attach::DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
        /// Seconds a device's requests wait for a reconnect once its connections are dead.
        #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
        dead_timeout: u64,
        /// NBD connections per volume.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
        connections: u32,
        /// The most volumes this node takes (NodeGetInfo max_volumes_per_node; 0: no limit).
        #[arg(long, default_value_t = 0)]
        max_volumes: u32,
        /// This node's NBD TLS credentials: a directory with ca.crt (the CA of the
        /// storage hosts' certificates), tls.crt and tls.key (this node's certificate,
        /// naming the node, and its key). While tls.crt is there, volumes of hosts with
        /// --nbd-tls required are attached over TLS with them (and of hosts with
        /// optional); the files are read at each attach and reconnect.
        #[arg(long, env = "FERROVOL_NBD_TLS_DIR")]
        nbd_tls_dir: Option<PathBuf>,
        /// The management socket of the storage host on this machine, if one runs here
        /// (its --data-dir/ferrovol.sock): its volumes are attached as its local ublk
        /// devices (/dev/ublkbN) instead of over NBD, as --local-ublk says.
        #[arg(long, env = "FERROVOL_LOCAL_HOST_SOCKET")]
        local_host_socket: Option<PathBuf>,
        /// When the local host's volumes get ublk devices: auto (when the kernel resizes
        /// them online, Linux 6.16 and later), always (NodeExpandVolume then fails on older
        /// kernels until the volume is staged again), or never. Read-only attachments go
        /// over NBD.
        #[arg(long, default_value = "auto", requires = "local_host_socket")]
        local_ublk: csi::local::LocalUblk,
    },
}

#[derive(Subcommand)]
pub(crate) enum HostCmd {
    /// Host id, NBD addresses and access mode, capacity, format and software versions.
    Info {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum PoolCmd {
    /// Capacity, used, metadata and free bytes (and the part of free reserved for metadata).
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Grow the pool online onto a larger file or device (a pool never shrinks): a pool
    /// file is lengthened to SIZE; without --size, the pool takes the size its file or
    /// device has now (a device or file grown underneath it).
    Grow {
        /// New size of the pool (superblocks, log and data area), e.g. 200GiB.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())).ok_or_else(|| format!("'{s}' is not KEY=VALUE"))
}

pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    parse_size::Config::new().with_binary().parse_size(s).map_err(|e| format!("'{s}' is not a size: {e}"))
}

impl ServeArgs {
    /// The host these flags describe, on `data_dir` with its management socket at
    /// `mgmt_socket`.
    ///
    /// Errors: a unit size past 4 GiB.
    pub(crate) fn host_options(&self, data_dir: &Path, mgmt_socket: PathBuf) -> anyhow::Result<HostOptions> {
        let mut o = HostOptions::new(data_dir);
        o.pool = self.pool.clone();
        o.pool_size = self.pool_size.unwrap_or(storage_engine::DEFAULT_POOL_SIZE);
        o.grow_to_pool_size = self.pool_size.is_some();
        o.unit_size =
            u32::try_from(self.unit_size).map_err(|_| anyhow::anyhow!("unit size {} is too large", self.unit_size))?;
        o.format = self.format;
        o.preallocate = self.preallocate;
        o.discard = self.discard;
        o.accept_superblock_rollback = self.accept_superblock_rollback;
        o.accept_log_loss = self.accept_log_loss;
        o.listen = self.listen;
        o.nbd_socket = self.nbd_socket.clone();
        o.nbd_access = self.nbd_access;
        o.advertise = self.advertise.clone();
        o.api_listen = self.api_listen;
        if let (Some(cert), Some(key)) = (&self.server_tls_cert, &self.server_tls_key) {
            o.tls = Some(ferrovol::tls::TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
                nbd_client_ca: self.nbd_tls_client_ca.clone(),
            });
        }
        o.nbd_tls = match self.nbd_tls {
            NbdTlsArg::Off => None,
            NbdTlsArg::Optional => Some(nbd::TlsMode::Optional),
            NbdTlsArg::Required => Some(nbd::TlsMode::Required),
        };
        o.mgmt_socket = Some(mgmt_socket);
        o.metrics_listen = self.metrics_listen;
        o.request_timing = self.request_timing;
        o.io_immediate_enter = self.io_immediate_enter;
        o.dataplane_threads = self.dataplane_threads as usize;
        o.busy_poll = Duration::from_micros(self.busy_poll_us);
        o.nbd = nbd::ServerConfig {
            handshake_timeout: Duration::from_secs(self.handshake_timeout),
            idle_timeout: (self.idle_timeout > 0).then(|| Duration::from_secs(self.idle_timeout)),
            max_connections: self.max_connections as usize,
            max_connections_per_export: self.max_connections_per_export as usize,
            max_in_flight_bytes: self.max_in_flight_bytes as usize,
            max_total_in_flight_bytes: usize::try_from(self.max_total_in_flight_bytes).unwrap_or(usize::MAX),
            stall_timeout: Duration::from_secs(self.stall_timeout),
            shutdown_grace: Duration::from_secs(self.shutdown_grace),
            soft_disconnect: match self.soft_disconnect {
                SoftDisconnectArg::Close => nbd::SoftDisconnect::Close,
                SoftDisconnectArg::Eshutdown => nbd::SoftDisconnect::Eshutdown,
            },
            ..Default::default()
        };
        Ok(o)
    }
}
