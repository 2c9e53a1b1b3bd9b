//! `ferrovol nbd attach|detach|list|watch|resize|reconnect`: an NBD export as a local
//! `/dev/nbdN` that stays attached, on `nbd::attach` (the kernel's netlink interface,
//! the handshake, the reconnect records and the watcher). Printing only.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nbd::attach::{self, Health, Options};

/// Attaches export `uri` with `connections` connections; prints the device.
pub(crate) fn attach(
    uri: &str,
    device: Option<&str>,
    connections: u32,
    dead_timeout: u64,
    backend: Option<String>,
    run_dir: PathBuf,
    tls_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    let a = attach::attach(&Options {
        uri: uri.to_string(),
        device: device.map(attach::parse_device).transpose()?,
        connections,
        dead_timeout: (dead_timeout > 0).then(|| Duration::from_secs(dead_timeout)),
        backend,
        run_dir: run_dir.clone(),
        tls_dir,
    })?;
    if !attach::watcher_running(&run_dir) {
        eprintln!("ferrovol: note: no `ferrovol nbd watch` runs: a dead connection will not be replaced");
    }
    out!("/dev/nbd{}", a.index);
    Ok(())
}

/// Detaches `device`.
pub(crate) fn detach(device: &str, run_dir: &Path) -> anyhow::Result<()> {
    attach::detach(run_dir, attach::parse_device(device)?)?;
    Ok(())
}

/// Lists the NBD devices: attached or free, with their backend identifiers and health.
pub(crate) fn list(all: bool, run_dir: &Path) -> anyhow::Result<()> {
    for l in attach::list(run_dir)? {
        let d = &l.device;
        if d.connected || all {
            let health = match &l.health {
                _ if !d.connected => "-".to_string(),
                None => "unwatched".to_string(),
                Some(Health::Alive) => "alive".to_string(),
                Some(Health::Reconnecting(since)) => format!("reconnecting since {since}"),
                Some(Health::Fenced(why)) => format!("fenced: {why}"),
            };
            out!(
                "/dev/nbd{}\t{}\t{}\t{}",
                d.index,
                if d.connected { "attached" } else { "free" },
                d.backend.as_deref().unwrap_or("-"),
                health
            );
        }
    }
    Ok(())
}

/// Runs the reconnect watcher.
pub(crate) fn watch(retry: f64, run_dir: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(retry.is_finite() && (0.05..=60.0).contains(&retry), "--retry {retry}: 0.05 to 60 seconds");
    attach::watch(run_dir, Duration::from_secs_f64(retry))?;
    Ok(())
}

/// Makes `device` take its export's size; prints it.
pub(crate) fn resize(device: &str, run_dir: &Path) -> anyhow::Result<()> {
    let size = attach::resize(run_dir, attach::parse_device(device)?)?;
    out!("{size}");
    Ok(())
}

/// Hands `device` new connections now.
pub(crate) fn reconnect(device: &str, uri: Option<&str>, backend: Option<&str>, run_dir: &Path) -> anyhow::Result<()> {
    attach::reconnect(run_dir, attach::parse_device(device)?, uri.map(|u| (u, backend)))?;
    Ok(())
}
