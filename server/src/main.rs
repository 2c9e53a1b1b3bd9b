//! `ferrovol`: the storage host's binary.
//!
//! Lives here: the command line (`serve`, `volume ...`, `pool status`, `check`), the
//! server's start-up and shutdown. Not here: the engine (`storage-engine`), the NBD
//! protocol (`nbd`), the management API and NBD exports (the `ferrovol` library: mgmt.rs,
//! exports.rs).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ferrovol::{exports, mgmt};
use storage_engine::{Pool, PoolOptions};

/// `println!` for command output: when the reader has gone (`ferrovol volume list |
/// head -1`), the command ends quietly with success instead of panicking; any other
/// error writing stdout ends it with a message and status 1.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("ferrovol: writing the output failed: {e}");
            std::process::exit(1);
        }
    }};
}

/// Thin-provisioned volumes in a pool, served over NBD.
#[derive(Parser)]
#[command(name = "ferrovol", version, about)]
struct Cli {
    /// Directory holding the pool file (pool.img) and the sockets.
    #[arg(long, global = true, env = "FERROVOL_DATA_DIR", default_value = "./ferrovol-data")]
    data_dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The management socket, for the commands that use it (not `check`, which reads a
/// stopped pool).
#[derive(clap::Args)]
struct Mgmt {
    /// Management socket (default: <data-dir>/ferrovol.sock).
    #[arg(long, global = true, env = "FERROVOL_SOCKET")]
    socket: Option<PathBuf>,
}

impl Mgmt {
    fn path(&self, data_dir: &Path) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| data_dir.join("ferrovol.sock"))
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the storage server: create or open the pool and serve every volume over NBD.
    Serve {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(flatten)]
        args: ServeArgs,
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
    /// Pool information from a running server.
    Pool {
        #[command(flatten)]
        mgmt: Mgmt,
        #[command(subcommand)]
        cmd: PoolCmd,
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
struct ServeArgs {
    /// Pool file or raw block device (default: <data-dir>/pool.img, created if missing).
    #[arg(long)]
    pool: Option<PathBuf>,
    /// Size of a new pool file (K, M, G, T are powers of 1024). Ignored for an existing pool.
    #[arg(long, default_value = "64GiB", value_parser = parse_size)]
    pool_size: u64,
    /// Data-unit (allocation-unit) size of a new pool: 16K, 32K, 64K or 128K.
    #[arg(long, default_value = "64KiB", value_parser = parse_size)]
    unit_size: u64,
    /// TCP address for NBD.
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: SocketAddr,
    /// Unix socket for NBD (default: <data-dir>/nbd.sock).
    #[arg(long)]
    nbd_socket: Option<PathBuf>,
    /// With --pool on a block device: if the device holds no ferrovol pool, format it
    /// as a new one (destroys its contents).
    #[arg(long)]
    format: bool,
    /// Seconds a client in the handshake (before it chooses an export) may go without
    /// sending or reading a byte; the whole handshake may take ten times this at most.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    handshake_timeout: u64,
    /// Seconds without requests after which an idle NBD connection is closed; 0 never
    /// closes (the kernel's client keeps idle connections for as long as a device is attached).
    #[arg(long, default_value_t = 0)]
    idle_timeout: u64,
    /// NBD connections open at once, over TCP and the unix socket.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: u64,
    /// NBD connections at once to one volume or snapshot.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections_per_export: u64,
    /// READ and WRITE payload bytes one connection may have buffered at once; past it
    /// the server stops reading that client's requests (backpressure).
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    max_in_flight_bytes: u64,
    /// Bytes of READ data, WRITE payload and block status replies all connections
    /// together may hold at once; past it requests wait. Each connection also has 2 MiB
    /// of its own outside it, so memory stays under this plus 2 MiB per connection.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    max_total_in_flight_bytes: u64,
    /// Seconds a client may take to read the next 256 KiB of a reply or to send the next
    /// 256 KiB of a WRITE payload; a connection that takes longer is closed, freeing
    /// what it held.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    stall_timeout: u64,
    /// Seconds connections get, once the server is told to stop, to finish requests in
    /// flight and disconnect; requests they send meanwhile get NBD_ESHUTDOWN.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    shutdown_grace: u64,
    /// Open the pool even if one superblock slot is damaged and may have held the newer
    /// generation: the pool is opened from the other slot, losing whatever was committed
    /// after it. Without it such a pool is refused (the error says so).
    #[arg(long)]
    accept_superblock_rollback: bool,
    /// Open the pool even if a metadata log batch is damaged with a later commit intact
    /// behind it: the log is replayed up to the damaged batch, losing the commits from it
    /// on. Without it such a pool is refused (the error names the batches).
    #[arg(long)]
    accept_log_loss: bool,
    /// Allocate every block of the pool file on the host file system at create and at
    /// open (fallocate), so that no write ever needs room from it. Without it the pool
    /// file is sparse: when the host file system fills up, writes that need new room
    /// get ENOSPC, as in a full pool. No effect on a block device.
    #[arg(long)]
    preallocate: bool,
    /// NBD data-plane threads, each with its own io_uring; a connection stays on the one
    /// serving the fewest connections when it is accepted. One thread batches the most
    /// requests per wake-up and was fastest on a 2-core host with its clients on the
    /// same cores (BENCHMARKS.md); more let a host with cores to spare serve more
    /// connections at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    dataplane_threads: u64,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`); off by default.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a thin volume (exported over NBD under its name).
    Create {
        /// Volume name (also its NBD export name): 1 to 128 of A-Z a-z 0-9 . _ -, not
        /// starting with . or -
        name: String,
        /// Virtual size, a multiple of 4096 bytes, at most 1 PiB (e.g. 10GiB; K, M, G, T,
        /// P are powers of 1024, so 10GB is 10 GiB too).
        #[arg(long, value_parser = parse_size)]
        size: u64,
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
enum SnapshotCmd {
    /// Take a read-only, crash-consistent snapshot (exported as VOLUME@SNAPSHOT).
    Create {
        /// Volume to snapshot.
        volume: String,
        /// Snapshot name (same rules as volume names).
        snapshot: String,
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

#[derive(Subcommand)]
enum PoolCmd {
    /// Capacity, used, metadata and free bytes (and the part of free reserved for metadata).
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_size::Config::new().with_binary().parse_size(s).map_err(|e| format!("'{s}' is not a size: {e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FERROVOL_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let r = rt.block_on(run(cli));
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferrovol: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let dir = &cli.data_dir;
    match cli.cmd {
        Cmd::Serve { mgmt, args } => serve(dir, &mgmt.path(dir), args).await.map(|()| ExitCode::SUCCESS),
        Cmd::Volume { mgmt, cmd } => volume_cmd(&mgmt.path(dir), cmd).await.map(|()| ExitCode::SUCCESS),
        Cmd::Snapshot { mgmt, cmd } => snapshot_cmd(&mgmt.path(dir), cmd).await.map(|()| ExitCode::SUCCESS),
        Cmd::Pool { mgmt, cmd: PoolCmd::Status { json } } => {
            pool_status(&mgmt.path(dir), json).await.map(|()| ExitCode::SUCCESS)
        }
        Cmd::Check { pool, repair: true } => {
            let path = pool.unwrap_or_else(|| cli.data_dir.join("pool.img"));
            let report = match tokio::task::spawn_blocking(move || storage_engine::repair(&path)).await? {
                Ok(r) => r,
                Err(e) if e.kind() == storage_engine::ErrorKind::Corrupt => {
                    out!("PROBLEM: {e}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(e) => {
                    eprintln!("ferrovol: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            for (unit, found, now) in &report.changed {
                out!("repaired: data unit {unit} had refcount {found}; {now} mapping pages map it");
            }
            if report.changed.is_empty() {
                out!("nothing to repair");
            } else {
                out!(
                    "{} refcounts repaired ({} leaked units free again); a fresh checkpoint was written",
                    report.changed.len(),
                    report.freed
                );
            }
            out!("{}", report.summary);
            out!("clean");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check { pool, repair: false } => {
            let path = pool.unwrap_or_else(|| cli.data_dir.join("pool.img"));
            let report = match tokio::task::spawn_blocking(move || storage_engine::check(&path)).await? {
                Ok(r) => r,
                Err(e) if e.kind() == storage_engine::ErrorKind::Corrupt => {
                    // Not even loadable: an inconsistency too.
                    out!("PROBLEM: {e}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(e) => {
                    eprintln!("ferrovol: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            out!("{}", report.summary);
            for w in &report.warnings {
                out!("warning: {w}");
            }
            if report.problems.is_empty() {
                out!("clean");
                Ok(ExitCode::SUCCESS)
            } else {
                for p in &report.problems {
                    out!("PROBLEM: {p}");
                }
                out!("{} problems", report.problems.len());
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// The error of a management call: the server's message, or, when the call broke on
/// the way (the server stopped or was killed during it: a status made by the client,
/// which carries its cause), a message saying its outcome is unknown.
fn status_err(s: tonic::Status) -> anyhow::Error {
    use std::error::Error as _;
    if s.source().is_some() || s.code() == tonic::Code::Unknown {
        return anyhow::anyhow!(
            "the connection to the server broke during the call ({}: the server stopped or was killed?); \
             its outcome is unknown: if it was a change, list the volumes and snapshots once the server \
             runs again",
            s.message()
        );
    }
    anyhow::anyhow!("{}", s.message())
}

fn human(bytes: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn volume_json(v: &mgmt::pb::Volume) -> serde_json::Value {
    serde_json::json!({
        "name": v.name, "id": v.id, "size_bytes": v.size_bytes,
        "allocated_bytes": v.allocated_bytes, "created_unix": v.created_unix, "export_name": v.export_name,
        "snapshot": v.snapshot, "exclusive_bytes": v.exclusive_bytes, "shared_bytes": v.shared_bytes,
    })
}

/// One row per volume; the NAME column is as wide as the longest name (at least 24).
fn print_table(vs: &[mgmt::pb::Volume]) {
    let w = vs.iter().map(|v| v.name.chars().count()).max().unwrap_or(0).max(24);
    out!("{:<w$} {:>12} {:>12} {:>12} {:>12}", "NAME", "SIZE", "ALLOCATED", "EXCLUSIVE", "SHARED");
    for v in vs {
        out!(
            "{:<w$} {:>12} {:>12} {:>12} {:>12}",
            v.name,
            human(v.size_bytes),
            human(v.allocated_bytes),
            human(v.exclusive_bytes),
            human(v.shared_bytes)
        );
    }
}

async fn snapshot_cmd(socket: &Path, cmd: SnapshotCmd) -> anyhow::Result<()> {
    let mut c = mgmt::connect(socket).await?;
    use mgmt::pb;
    match cmd {
        SnapshotCmd::Create { volume, snapshot } => {
            let v = c
                .create_snapshot(pb::CreateSnapshotRequest { volume, snapshot })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("created snapshot {}", v.name);
        }
        SnapshotCmd::List { volume, json } => {
            let req = pb::ListSnapshotsRequest { volume: volume.unwrap_or_default() };
            let vs = c.list_snapshots(req).await.map_err(status_err)?.into_inner().snapshots;
            if json {
                out!("{}", serde_json::Value::Array(vs.iter().map(volume_json).collect()));
            } else {
                print_table(&vs);
            }
        }
        SnapshotCmd::Delete { volume, snapshot } => {
            c.delete_snapshot(pb::DeleteSnapshotRequest { volume: volume.clone(), snapshot: snapshot.clone() })
                .await
                .map_err(status_err)?;
            out!("deleted snapshot {volume}@{snapshot}");
        }
        SnapshotCmd::Diff { from, to, json } => {
            let ranges =
                c.diff_snapshots(pb::DiffSnapshotsRequest { from, to }).await.map_err(status_err)?.into_inner().ranges;
            if json {
                let r: Vec<_> =
                    ranges.iter().map(|r| serde_json::json!({"offset": r.offset, "length": r.length})).collect();
                out!("{}", serde_json::Value::Array(r));
            } else {
                for r in &ranges {
                    out!("{} {}", r.offset, r.length);
                }
                let total: u64 = ranges.iter().map(|r| r.length).sum();
                eprintln!("{} ranges, {} bytes differ", ranges.len(), total);
            }
        }
    }
    Ok(())
}

async fn volume_cmd(socket: &Path, cmd: VolumeCmd) -> anyhow::Result<()> {
    let mut c = mgmt::connect(socket).await?;
    use mgmt::pb;
    match cmd {
        VolumeCmd::Create { name, size } => {
            let v = c
                .create_volume(pb::CreateVolumeRequest { name, size_bytes: size })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("created volume {} ({} bytes, {})", v.name, v.size_bytes, human(v.size_bytes));
        }
        VolumeCmd::List { json } => {
            let vs = c.list_volumes(pb::ListVolumesRequest {}).await.map_err(status_err)?.into_inner().volumes;
            if json {
                out!("{}", serde_json::Value::Array(vs.iter().map(volume_json).collect()));
            } else {
                print_table(&vs);
            }
        }
        VolumeCmd::Info { name, json } => {
            let v = c.get_volume(pb::GetVolumeRequest { name }).await.map_err(status_err)?.into_inner();
            if json {
                out!("{}", volume_json(&v));
            } else {
                out!(
                    "name: {}\ntype: {}\nid: {}\nsize: {} ({})\nallocated: {} ({})\nexport: {}",
                    v.name,
                    if v.snapshot { "snapshot (read-only)" } else { "volume" },
                    v.id,
                    v.size_bytes,
                    human(v.size_bytes),
                    v.allocated_bytes,
                    human(v.allocated_bytes),
                    v.export_name
                );
            }
        }
        VolumeCmd::Delete { name } => {
            c.delete_volume(pb::DeleteVolumeRequest { name: name.clone() }).await.map_err(status_err)?;
            out!("deleted volume {name}");
        }
        VolumeCmd::Clone { from, name } => {
            let v = c
                .clone_volume(pb::CloneVolumeRequest { source: from.clone(), name })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("created volume {} from {from}", v.name);
        }
        VolumeCmd::Resize { name, size } => {
            let v = c
                .resize_volume(pb::ResizeVolumeRequest { name, size_bytes: size })
                .await
                .map_err(status_err)?
                .into_inner();
            out!("resized volume {} to {} bytes ({})", v.name, v.size_bytes, human(v.size_bytes));
        }
    }
    Ok(())
}

async fn pool_status(socket: &Path, json: bool) -> anyhow::Result<()> {
    let mut c = mgmt::connect(socket).await?;
    let s = c.get_pool_status(mgmt::pb::GetPoolStatusRequest {}).await.map_err(status_err)?.into_inner();
    if json {
        out!(
            "{}",
            serde_json::json!({
                "uuid": s.uuid, "path": s.path, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes,
                "metadata_bytes": s.metadata_bytes, "free_bytes": s.free_bytes, "reserved_bytes": s.reserved_bytes,
                "unit_size_bytes": s.unit_size_bytes,
                "volume_count": s.volume_count, "direct_io": s.direct_io, "failed": s.failed, "nbd_endpoints": s.nbd_endpoints,
            })
        );
    } else {
        out!("pool {} at {}", s.uuid, s.path);
        out!(
            "capacity {}  used {}  metadata {}  free {} (of which {} reserved for metadata)",
            human(s.capacity_bytes),
            human(s.used_bytes),
            human(s.metadata_bytes),
            human(s.free_bytes),
            human(s.reserved_bytes)
        );
        out!(
            "unit size {}  volumes and snapshots {}  O_DIRECT {}  failed {}",
            human(u64::from(s.unit_size_bytes)),
            s.volume_count,
            s.direct_io,
            s.failed
        );
        for e in s.nbd_endpoints {
            out!("nbd: {e}");
        }
    }
    Ok(())
}

/// Binds a unix socket at `path`, replacing a stale socket file (one nobody listens on).
fn bind_unix(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{} is in use by a running server", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("remove stale socket {}", path.display()))?;
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("bind {}", path.display()))
}

async fn serve(data_dir: &Path, mgmt_socket: &Path, args: ServeArgs) -> anyhow::Result<()> {
    // Catch SIGTERM and SIGINT before anything can connect: the listening sockets accept
    // connections (into their backlog) as soon as they are bound, so a supervisor may see the
    // server as up and stop it while the pool is still opening. The stop is then taken after
    // the open, and the pool is closed cleanly.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let pool_path = args.pool.clone().unwrap_or_else(|| data_dir.join("pool.img"));
    if args.format {
        use std::os::unix::fs::FileTypeExt;
        let is_dev = std::fs::metadata(&pool_path).is_ok_and(|m| m.file_type().is_block_device());
        anyhow::ensure!(
            is_dev,
            "--format formats a block device, and {} is not one (a missing pool file is created without it)",
            pool_path.display()
        );
    }
    anyhow::ensure!(
        args.max_in_flight_bytes >= 1 << 20,
        "--max-in-flight-bytes must be at least 1MiB (one maximum-size request may still exceed it)"
    );
    anyhow::ensure!(
        args.max_total_in_flight_bytes >= 1 << 20,
        "--max-total-in-flight-bytes must be at least 1MiB (one maximum-size request may still exceed it)"
    );
    std::fs::create_dir_all(data_dir).with_context(|| format!("create data dir {}", data_dir.display()))?;
    let dataplane = DataPlane::start(args.dataplane_threads as usize).context("start the NBD data-plane threads")?;
    let opts = PoolOptions {
        size: args.pool_size,
        unit_size: u32::try_from(args.unit_size)
            .map_err(|_| anyhow::anyhow!("unit size {} is too large", args.unit_size))?,
        io: storage_engine::IoOptions {
            reaper: storage_engine::Reaper::PerRuntime(dataplane.handles.clone()),
            ..Default::default()
        },
        accept_superblock_rollback: args.accept_superblock_rollback,
        accept_log_loss: args.accept_log_loss,
        preallocate: args.preallocate,
    };
    // Listen first, so a busy port or socket leaves no new pool file behind. The NBD
    // listeners belong to the data-plane runtime, the management socket to this one.
    let nbd_sock = args.nbd_socket.clone().unwrap_or_else(|| data_dir.join("nbd.sock"));
    let tcp = std::net::TcpListener::bind(args.listen)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            let _rt = dataplane.handle().enter();
            tokio::net::TcpListener::from_std(l)
        })
        .with_context(|| format!("bind NBD on {}", args.listen))?;
    // TCP before the unix sockets: a busy port leaves no socket file behind either.
    let metrics_listener = match args.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind the metrics endpoint on {addr}"))?,
        ),
        None => None,
    };
    let unix = {
        let _rt = dataplane.handle().enter();
        bind_unix(&nbd_sock)?
    };
    let mgmt_listener = match bind_unix(mgmt_socket) {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&nbd_sock);
            return Err(e);
        }
    };
    let p = pool_path.clone();
    let format = args.format;
    let pool = dataplane
        .handle()
        .spawn_blocking(move || {
            // `--format` was checked to name a block device at the start.
            if format {
                Pool::open_or_format_device(&p, &opts)
            } else {
                Pool::open_or_create(&p, &opts)
            }
        })
        .await?;
    let pool = match pool {
        Ok(pool) => pool,
        Err(e) => {
            let _ = std::fs::remove_file(&nbd_sock);
            let _ = std::fs::remove_file(mgmt_socket);
            return Err(anyhow::anyhow!("pool {}: {e}", pool_path.display()));
        }
    };
    let endpoints = vec![format!("nbd://{}", tcp.local_addr()?), format!("nbd+unix:///?socket={}", nbd_sock.display())];
    tracing::info!(nbd_tcp = %tcp.local_addr()?, nbd_unix = %nbd_sock.display(), management = %mgmt_socket.display(), "serving");

    let metrics = Arc::new(ferrovol::metrics::Metrics::new());
    let registry = Arc::new(exports::PoolRegistry::new(pool.clone(), metrics.clone()));
    let config = nbd::ServerConfig {
        handshake_timeout: std::time::Duration::from_secs(args.handshake_timeout),
        idle_timeout: (args.idle_timeout > 0).then(|| std::time::Duration::from_secs(args.idle_timeout)),
        max_connections: args.max_connections as usize,
        max_connections_per_export: args.max_connections_per_export as usize,
        max_in_flight_bytes: args.max_in_flight_bytes as usize,
        max_total_in_flight_bytes: usize::try_from(args.max_total_in_flight_bytes).unwrap_or(usize::MAX),
        stall_timeout: Duration::from_secs(args.stall_timeout),
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        ..Default::default()
    };
    let nbd_server = nbd::Server::new_on(registry.clone(), config, dataplane.handles.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let metrics_task = metrics_listener.map(|l| {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(%addr, "serving Prometheus metrics at /metrics");
        }
        let server = nbd_server.clone();
        tokio::spawn(ferrovol::metrics::serve(
            l,
            metrics.clone(),
            pool.clone(),
            move || ferrovol::metrics::NbdCounts {
                connections: server.connections(),
                stalled_connections: server.stalled_connections(),
            },
            stopped(stop_rx.clone()),
        ))
    });
    let dp = dataplane.handle();
    let tcp_task = dp.spawn(nbd_server.clone().serve_tcp(tcp, stopped(stop_rx.clone())));
    let unix_task = dp.spawn(nbd_server.clone().serve_unix(unix, stopped(stop_rx.clone())));
    let mgmt_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(mgmt::ManagementService::new(pool.clone(), endpoints))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(mgmt_listener),
                stopped(stop_rx.clone()),
            ),
    );

    tokio::select! {
        _ = interrupt.recv() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down: flushing and checkpointing the pool");
    let _ = stop_tx.send(true);
    let _ = tcp_task.await;
    let _ = unix_task.await;
    // Soft disconnect: in-flight requests finish, new ones get NBD_ESHUTDOWN, and each
    // connection closes when its client leaves or the grace period ends.
    nbd_server.shut_down();
    let grace_end = tokio::time::Instant::now() + nbd_server.config().shutdown_grace + Duration::from_secs(1);
    while nbd_server.connections() > 0 && tokio::time::Instant::now() < grace_end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = mgmt_task.await;
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    let _ = std::fs::remove_file(&nbd_sock);
    let _ = std::fs::remove_file(mgmt_socket);
    if let Err(e) = pool.flush().await {
        tracing::error!(error = %e, "final flush failed");
    }
    tokio::task::spawn_blocking(move || pool.close()).await??;
    dataplane.stop();
    tracing::info!("pool closed cleanly");
    Ok(())
}

/// The NBD data plane: threads each driving a current-thread tokio runtime that reaps
/// one of the pool's io_urings and serves the NBD connections placed on it, so that a
/// request is received, submitted, completed and answered on one thread with no
/// hand-off. The first also owns the listeners. Management requests run on the main
/// runtime.
struct DataPlane {
    /// Every thread's runtime; the first also owns the listeners and opens the pool.
    handles: Vec<tokio::runtime::Handle>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl DataPlane {
    /// Starts `n` (at least 1) threads: `ferrovol-nbd`, then `ferrovol-nbd-1` and on.
    fn start(n: usize) -> std::io::Result<DataPlane> {
        let (mut handles, mut stops, mut threads) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            handles.push(rt.handle().clone());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            stops.push(stop);
            let name = if i == 0 { "ferrovol-nbd".to_owned() } else { format!("ferrovol-nbd-{i}") };
            threads.push(std::thread::Builder::new().name(name).spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })?);
        }
        Ok(DataPlane { handles, stops, threads })
    }

    /// The first thread's runtime (listeners, opening the pool).
    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handles[0]
    }

    /// Stops the runtimes (dropping whatever tasks are left) once the pool is closed.
    fn stop(self) {
        for stop in self.stops {
            let _ = stop.send(());
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}
