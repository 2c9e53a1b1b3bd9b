//! `ferrovol`: the storage host's binary, a thin command line over the `ferrovol`
//! library (start-up: `ferrovol::host`) and the management API's client (`mgmt-api`).
//!
//! Lives here: `main` (logging, the runtime, signals) and the dispatch of commands.
//! Not here: the flags (args.rs), what the administrative commands print (admin.rs),
//! the server itself (the library).

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
            say!("ferrovol: writing the output failed: {e}");
            std::process::exit(1);
        }
    }};
}

/// `eprintln!` that never panics: a message to stderr, dropped when stderr cannot
/// take it (a full file system under the log file, a log reader that has gone). The
/// server must go on serving, and stop cleanly, whatever happens to its log.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod admin;
mod args;
mod nbd_cmd;

use std::process::ExitCode;

use args::{Cli, Cmd, CsiCmd, HostCmd, NbdCmd, PoolCmd};
use clap::Parser;
use ferrovol::host::Host;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("FERROVOL_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log line that cannot be written is dropped: reporting that failure on
        // stderr (the default) panics when stderr is what failed.
        .log_internal_errors(false)
        .init();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let r = rt.block_on(run(cli));
    match r {
        Ok(code) => code,
        Err(e) => {
            say!("ferrovol: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let dir = &cli.data_dir;
    match cli.cmd {
        Cmd::Serve { mgmt, args } => {
            // Catch SIGTERM and SIGINT before anything can connect: the listening sockets
            // accept connections (into their backlog) as soon as they are bound, so a
            // supervisor may see the server as up and stop it while the pool is still
            // opening. The stop is then taken after the open, and the pool is closed
            // cleanly.
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate())?;
            let mut interrupt = signal(SignalKind::interrupt())?;
            let mut hangup = signal(SignalKind::hangup())?;
            let host = Host::start(args.host_options(dir, mgmt.path(dir))?).await?;
            loop {
                tokio::select! {
                    _ = interrupt.recv() => break,
                    _ = term.recv() => break,
                    _ = hangup.recv() => match host.reload_tls() {
                        Ok(()) => tracing::info!("SIGHUP: the TLS files were read again (new management API connections and NBD sessions use them)"),
                        Err(e) => tracing::error!(error = format!("{e:#}"), "SIGHUP: the TLS files do not load; the ones in force stay"),
                    },
                }
            }
            host.shut_down().await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Volume { mgmt, cmd } => admin::volume_cmd(&mgmt.target(dir), cmd).await.map(|()| ExitCode::SUCCESS),
        Cmd::Snapshot { mgmt, cmd } => admin::snapshot_cmd(&mgmt.target(dir), cmd).await.map(|()| ExitCode::SUCCESS),
        Cmd::Host { mgmt, cmd: HostCmd::Info { json } } => {
            admin::host_info(&mgmt.target(dir), json).await.map(|()| ExitCode::SUCCESS)
        }
        Cmd::Pool { mgmt, cmd: PoolCmd::Status { json } } => {
            admin::pool_status(&mgmt.target(dir), json).await.map(|()| ExitCode::SUCCESS)
        }
        Cmd::Pool { mgmt, cmd: PoolCmd::Grow { size, json } } => {
            admin::pool_grow(&mgmt.target(dir), size, json).await.map(|()| ExitCode::SUCCESS)
        }
        Cmd::Nbd { cmd } => {
            match cmd {
                NbdCmd::Attach { uri, device, connections, dead_timeout, backend, run_dir, tls_dir } => {
                    nbd_cmd::attach(&uri, device.as_deref(), connections, dead_timeout, backend, run_dir, tls_dir)?
                }
                NbdCmd::Detach { device, run_dir } => nbd_cmd::detach(&device, &run_dir)?,
                NbdCmd::List { all, run_dir } => nbd_cmd::list(all, &run_dir)?,
                NbdCmd::Watch { retry, run_dir } => nbd_cmd::watch(retry, &run_dir)?,
                NbdCmd::Resize { device, run_dir } => nbd_cmd::resize(&device, &run_dir)?,
                NbdCmd::Reconnect { device, uri, backend, run_dir } => {
                    nbd_cmd::reconnect(&device, uri.as_deref(), backend.as_deref(), &run_dir)?
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Csi { cmd: CsiCmd::Controller { endpoint, config } } => {
            let config = csi::config::Config::load(&config)?;
            csi::serve::serve_controller(&config, &endpoint, stop_signal()?).await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Csi {
            cmd:
                CsiCmd::Node {
                    endpoint,
                    node_name,
                    zone,
                    run_dir,
                    dead_timeout,
                    connections,
                    max_volumes,
                    nbd_tls_dir,
                    local_host_socket,
                    local_ublk,
                },
        } => {
            if let Some(d) = &nbd_tls_dir {
                if d.join(nbd::client::ClientTls::CERT).exists() {
                    // Refused at start rather than at the first stage of a TLS host's volume.
                    nbd::client::ClientTls::load(d).map_err(|e| anyhow::anyhow!("--nbd-tls-dir: {e}"))?;
                } else {
                    tracing::warn!(
                        dir = %d.display(),
                        "no NBD TLS credentials yet: volumes of storage hosts that require TLS cannot be staged until \
                         ca.crt, tls.crt and tls.key are there"
                    );
                }
            }
            let node = csi::node::Node::new(node_name, zone).map_err(anyhow::Error::msg)?.with_attach(
                csi::node::AttachOptions {
                    run_dir,
                    dead_timeout: std::time::Duration::from_secs(dead_timeout),
                    connections,
                    max_volumes: i64::from(max_volumes),
                    tls_dir: nbd_tls_dir,
                    local: local_host_socket.map(|socket| csi::local::LocalHost::new(socket, local_ublk)),
                },
            );
            csi::serve::serve_node(node, &endpoint, stop_signal()?).await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check { pool, repair } => admin::check(pool.unwrap_or_else(|| dir.join("pool.img")), repair).await,
    }
}

/// Resolves at SIGTERM or SIGINT (set up before anything is served).
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}
