//! The shared NBD interoperability checklist (../shared/tools/nbd-interop.sh) against a
//! fresh 1 GiB volume, over TCP (one data-plane thread) and over the unix socket (two,
//! busy-polling); and a busy-polling server going back to sleep once idle.

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
    // covers the default of one), each polling before it sleeps (the TCP test covers
    // sleeping at once).
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "2GiB", &["--dataplane-threads", "2", "--busy-poll-us", "200"]);
    s.create_volume("interop", "1GiB");
    let scratch = td.path().join("scratch");
    run_checklist(&s.unix_uri("interop"), &scratch);
    // what the checklist left behind is a consistent pool
    s.stop();
    check_clean(&td.data());
}

/// CPU time (user and system) `pid` has used, in clock ticks (/proc/PID/stat).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses: utime is the 14th
    // field of the line, stime the 15th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn a_busy_polling_server_polls_after_work_and_sleeps_when_idle() {
    // `--busy-poll-us` keeps a data-plane thread polling after work (the time shows in
    // ferrovol_dataplane_busy_poll_seconds_total), not forever: once the client is done
    // the server's CPU use falls back to about nothing, even with the metrics' 10 ms
    // lag probe waking each thread (a thread that polled after every tick would poll a
    // tenth of the time; one that never stopped would use a whole core).
    let td = TestDir::new();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let s = Server::start_with(
        &td.data(),
        "2GiB",
        &["--busy-poll-us", "1000", "--dataplane-threads", "2", "--metrics-listen", &listen],
    );
    s.create_volume("p", "64MiB");
    let polled = || {
        let text = scrape(port);
        sample(&text, "ferrovol_dataplane_busy_poll_seconds_total").unwrap_or_else(|| panic!("no series:\n{text}"))
    };
    let code = r#"
import sys, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1])
for i in range(200):
    h.pwrite(bytes([i % 251]) * 4096, i * 4096)
for i in range(200):
    assert h.pread(4096, i * 4096) == bytes([i % 251]) * 4096, i
h.flush()
h.shutdown()
"#;
    python_ok(code, &[&s.uri("p")]);
    // A window's time is counted when it ends, a millisecond after the last request.
    let waited = std::time::Instant::now();
    while polled() == 0.0 && waited.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(polled() > 0.0, "400 requests one at a time, and no polling after any of them");
    std::thread::sleep(std::time::Duration::from_millis(200));
    let hz = 100.0; // USER_HZ, the unit of /proc/PID/stat on Linux
    let (t0, c0, p0) = (std::time::Instant::now(), cpu_ticks(s.pid()), polled());
    std::thread::sleep(std::time::Duration::from_secs(2));
    let secs = t0.elapsed().as_secs_f64();
    let (used, idle_polled) = ((cpu_ticks(s.pid()) - c0) as f64 / hz / secs, (polled() - p0) / secs);
    assert!(idle_polled < 0.02, "an idle server polled {:.1}% of the time", idle_polled * 100.0);
    assert!(used < 0.25, "an idle busy-polling server used {:.0}% of a core", used * 100.0);
}
