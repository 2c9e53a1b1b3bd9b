//! The shared NBD interoperability checklist (../shared/tools/nbd-interop.sh) against a
//! fresh 1 GiB volume, over TCP (one data-plane thread) and over the unix socket (two).

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/tools/nbd-interop.sh");

/// Runs the checklist against `uri`; asserts exit 0 and "N passed, 0 failed" with N >= 28.
fn run_checklist(uri: &str, scratch: &Path) {
    assert!(Path::new(SCRIPT).is_file(), "the shared NBD checklist is missing at {SCRIPT}");
    for tool in ["bash", "qemu-io", "qemu-img", "nbdinfo", "nbdcopy", "nbdsh", "fio", "nbdkit"] {
        require(tool);
    }
    let o = output(
        Command::new("timeout")
            .args(["-k", "5", "300", "bash", SCRIPT, uri])
            .env("PATH", peer_path())
            .env("SCRATCH", scratch)
            .env("T", "60"),
    );
    let out = text(&o);
    let summary = out
        .lines()
        .rev()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w.as_slice() {
                [p, "passed,", f, "failed,", _, "skipped"] => Some((p.parse::<u32>().ok()?, f.parse::<u32>().ok()?)),
                _ => None,
            }
        })
        .unwrap_or_else(|| panic!("no summary line from the checklist ({}):\n{out}", o.status));
    let failures: Vec<&str> = out.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(summary.1, 0, "checklist failures on {uri}:\n{}\n\nfull output:\n{out}", failures.join("\n"));
    assert!(summary.0 >= 28, "only {} checks passed on {uri} (28 expected):\n{out}", summary.0);
    assert!(o.status.success(), "checklist exited {} on {uri}:\n{out}", o.status);
    let skipped: Vec<&str> = out.lines().filter(|l| l.starts_with("SKIP")).collect();
    assert!(skipped.is_empty(), "checks skipped on {uri}:\n{}", skipped.join("\n"));
}

#[test]
fn interop_checklist_tcp() {
    // Every check of the shared NBD checklist passes over TCP.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("interop", "1GiB");
    let scratch = td.path().join("scratch");
    run_checklist(&s.uri("interop"), &scratch);
    assert!(s.cli_ok(&["volume", "list"]).contains("interop"));
}

#[test]
fn interop_checklist_unix() {
    // Every check of the shared NBD checklist passes over the unix socket, with two
    // data-plane threads (connections placed on both, two io_urings; the TCP test
    // covers the default of one).
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "2GiB", &["--dataplane-threads", "2"]);
    s.create_volume("interop", "1GiB");
    let scratch = td.path().join("scratch");
    run_checklist(&s.unix_uri("interop"), &scratch);
    // what the checklist left behind is a consistent pool
    s.stop();
    check_clean(&td.data());
}
