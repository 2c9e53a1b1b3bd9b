//! Serves an in-memory export over NBD on a TCP port, for trying the protocol layer
//! with real clients (`nbdinfo`, `nbdsh`, `qemu-io`, `nbd-client`).
//!
//! Usage: `cargo run -p nbd --example memserver -- [PORT] [NAME] [SIZE_MIB]`
//! (defaults: 10809, `mem`, 64). Listens on 127.0.0.1 only; stops on Ctrl-C.
//! The export is `nbd::testing::MemExport`: data is lost on exit.

use std::sync::Arc;

use nbd::testing::{MemExport, MemRegistry};
use nbd::ServerConfig;
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = match args.next() {
        Some(p) => p.parse().map_err(|_| std::io::Error::other(format!("bad port {p:?}")))?,
        None => 10809,
    };
    let name = args.next().unwrap_or_else(|| "mem".to_string());
    let size_mib: u64 = match args.next() {
        Some(s) => s.parse().map_err(|_| std::io::Error::other(format!("bad size {s:?}")))?,
        None => 64,
    };

    let registry = Arc::new(MemRegistry::default().with(&name, MemExport::new(size_mib << 20)));
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    println!("serving export {name:?} ({size_mib} MiB) on nbd://{}/{name}", listener.local_addr()?);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    nbd::serve_tcp(listener, registry, Arc::new(ServerConfig::default()), shutdown).await
}
