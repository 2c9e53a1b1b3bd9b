//! A short run of scripts/crash-campaign.py in the test command, on two data-plane
//! threads: four libnbd clients write, trim, FUA-write and flush concurrently on two
//! volumes (writes landing on both threads) while snapshots are taken and old volumes
//! deleted, the server is killed with SIGKILL at a random moment, and after a restart
//! every acknowledged-and-flushed byte must read back, each snapshot must hold a cut of
//! the writes at its moment, and `ferrovol check` must be clean. Longer campaigns:
//! README.md, "Layout".

mod common;

use common::*;
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/crash-campaign.py");

#[test]
fn crash_campaign_on_two_dataplane_threads_finds_no_violation() {
    require_python_nbd();
    let td = TestDir::new();
    let seed = rand_below(1 << 30).to_string();
    // The campaign listens on PORT + cycle: four ports free now, not only the first.
    let port = loop {
        let p = free_port();
        let free =
            (1..4).all(|i| p.checked_add(i).is_some_and(|q| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok()));
        if free {
            break p.to_string();
        }
    };
    let o = output(
        Command::new("timeout")
            .args(["-k", "5", "600", PYTHON, SCRIPT, "--cycles", "4", "--seed", &seed, "--port", &port])
            .args(["--bin", BIN, "--serve-args", "--dataplane-threads 2"])
            .arg("--out")
            .arg(td.path())
            .env("PATH", peer_path()),
    );
    let out = text(&o);
    assert!(
        o.status.success() && out.contains("bad cycles 0"),
        "crash campaign (seed {seed}) found violations or failed ({}):\n{out}",
        o.status
    );
}
