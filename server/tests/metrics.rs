//! The Prometheus endpoint (`serve --metrics-listen`): after qemu-io writes, reads and
//! flushes a volume, a scrape shows exactly those bytes for that volume, the latency
//! histograms, the pool's used bytes, its commits and checkpoints, and the NBD
//! connection gauge; once the volume is
//! deleted its series are gone, also when a volume of the same name replaces it.

mod common;

use common::*;

#[test]
fn metrics_count_volume_io_and_pool_usage() {
    let td = TestDir::new();
    let port = free_port();
    let s = Server::start_with(&td.data(), "2GiB", &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    s.create_volume("m", "64MiB");
    s.create_volume("idle", "64MiB");
    qemu_io_ok(&s.uri("m"), &["write -P 0x61 0 1M", "read -P 0x61 0 1M", "flush"]);

    let text = scrape(port);
    let v = |metric: &str| sample(&text, &format!("ferrovol_{metric}{{volume=\"m\"}}"));
    assert_eq!(v("volume_write_bytes_total"), Some(1048576.0), "written bytes:\n{text}");
    assert_eq!(v("volume_read_bytes_total"), Some(1048576.0), "read bytes:\n{text}");
    assert!(v("volume_write_ops_total").is_some_and(|n| n >= 1.0), "write ops:\n{text}");
    assert!(v("volume_flushes_total").is_some_and(|n| n >= 1.0), "flushes:\n{text}");
    assert_eq!(v("volume_errors_total"), Some(0.0), "errors:\n{text}");
    assert!(v("volume_read_seconds_count").is_some_and(|n| n >= 1.0), "read latency histogram:\n{text}");
    assert!(
        sample(&text, "ferrovol_volume_write_bytes_total{volume=\"idle\"}").is_none(),
        "no series for a volume never opened"
    );
    assert_eq!(sample(&text, "ferrovol_pool_used_bytes"), Some(1048576.0), "pool used:\n{text}");
    assert_eq!(sample(&text, "ferrovol_pool_failed"), Some(0.0));
    assert!(sample(&text, "ferrovol_pool_capacity_bytes").is_some_and(|c| c > 1e9));
    assert!(sample(&text, "ferrovol_nbd_connections").is_some());
    assert!(sample(&text, "ferrovol_pool_freeing_bytes").is_some(), "freeing gauge:\n{text}");
    let (free, reserved) = (sample(&text, "ferrovol_pool_free_bytes"), sample(&text, "ferrovol_pool_reserved_bytes"));
    assert!(reserved.is_some_and(|r| r > 0.0 && Some(r) < free), "reserved gauge:\n{text}");

    // Commits and checkpoints: the volume creates and the flush committed; the open
    // wrote a checkpoint, of at least one block; the maxima bound nothing below them.
    assert!(sample(&text, "ferrovol_pool_commits_total").is_some_and(|n| n >= 1.0), "commits:\n{text}");
    assert!(sample(&text, "ferrovol_pool_commit_seconds_total").is_some_and(|t| t > 0.0), "commit time:\n{text}");
    assert!(sample(&text, "ferrovol_pool_checkpoints_total").is_some_and(|n| n >= 1.0), "checkpoints:\n{text}");
    assert!(
        sample(&text, "ferrovol_pool_checkpoint_bytes_total").is_some_and(|b| b >= 4096.0),
        "checkpoint bytes:\n{text}"
    );
    let (longest, hold) = (
        sample(&text, "ferrovol_pool_checkpoint_max_seconds"),
        sample(&text, "ferrovol_pool_checkpoint_hold_max_seconds"),
    );
    assert!(longest.is_some_and(|l| l > 0.0) && hold.is_some_and(|h| h > 0.0 && Some(h) <= longest), "{text}");

    s.cli_ok(&["volume", "delete", "m"]);
    let text = scrape(port);
    assert!(!text.contains("volume=\"m\""), "series of a deleted volume remain:\n{text}");
    assert_eq!(sample(&text, "ferrovol_pool_used_bytes"), Some(0.0), "pool used after the delete:\n{text}");
}

/// Waits for the client to open `sys.argv[1]`, says so, then on a line from stdin sends
/// five 4 KiB writes and prints how many failed.
const LATE_WRITER: &str = r#"
import sys, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1])
print("open", flush=True)
sys.stdin.readline()
failed = 0
for i in range(5):
    try:
        h.pwrite(b"x" * 4096, i * 4096)
    except nbd.Error:
        failed += 1
print("failed", failed, flush=True)
"#;

/// A volume deleted and created again under its name between two scrapes: the new one's
/// series start from zero, and the old volume's clients, whose requests now fail, do
/// not count against it. Before, series were keyed by name alone: the new volume showed
/// the old one's bytes and its clients' errors.
#[test]
fn a_volume_created_again_under_a_deleted_name_starts_from_zero() {
    use std::io::{BufRead, BufReader, Write};
    require_python_nbd();
    let td = TestDir::new();
    let port = free_port();
    let s = Server::start_with(&td.data(), "2GiB", &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    s.create_volume("r", "64MiB");
    qemu_io_ok(&s.uri("r"), &["write -P 0x61 0 1M"]);
    let mut old = std::process::Command::new(PYTHON)
        .args(["-c", LATE_WRITER, &s.uri("r")])
        .env("PATH", peer_path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(old.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "open");
    let v = |text: &str, metric: &str| sample(text, &format!("ferrovol_{metric}{{volume=\"r\"}}"));
    assert_eq!(v(&scrape(port), "volume_write_bytes_total"), Some(1048576.0));

    s.cli_ok(&["volume", "delete", "r"]);
    s.create_volume("r", "64MiB");
    qemu_io_ok(&s.uri("r"), &["write -P 0x62 0 4k"]);
    writeln!(old.stdin.as_mut().unwrap()).unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "failed 5", "the old volume's client writes to a deleted volume");
    old.wait().unwrap();

    let text = scrape(port);
    assert_eq!(v(&text, "volume_write_bytes_total"), Some(4096.0), "the new volume's bytes only:\n{text}");
    assert_eq!(v(&text, "volume_errors_total"), Some(0.0), "the old volume's errors:\n{text}");
}

/// Eight 4 KiB writes, five reads and a flush over one connection, by libnbd.
const TIMED_CLIENT: &str = r#"
import sys, nbd
h = nbd.NBD(); h.connect_uri(sys.argv[1])
for i in range(8):
    h.pwrite(b"t" * 4096, i * 4096)
for i in range(5):
    assert h.pread(4096, i * 4096) == b"t" * 4096
h.flush()
h.shutdown()
"#;

/// With `--request-timing`, every request answered is timed in each of its three
/// stages (receive, serve, reply), counted by command: exactly the client's requests.
/// Without it, no stage series. Either way with `--metrics-listen`, each data-plane
/// thread's lag probe ticks.
#[test]
fn request_timing_counts_every_request_in_each_stage() {
    require_python_nbd();
    for timing in [true, false] {
        let td = TestDir::new();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec!["--metrics-listen", &listen, "--dataplane-threads", "2"];
        if timing {
            // And the storage I/O entered once per turn: the same requests, answered.
            args.extend(["--request-timing", "--io-immediate-enter"]);
        }
        let s = Server::start_with(&td.data(), "2GiB", &args);
        s.create_volume("t", "64MiB");
        let out = std::process::Command::new(PYTHON)
            .args(["-c", TIMED_CLIENT, &s.uri("t")])
            .env("PATH", peer_path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = scrape(port);
        let count = |command: &str, stage: &str| {
            sample(
                &text,
                &format!("ferrovol_nbd_request_stage_seconds_count{{command=\"{command}\",stage=\"{stage}\"}}"),
            )
        };
        for stage in ["receive", "serve", "reply"] {
            let want = |n: f64| timing.then_some(n);
            assert_eq!(count("write", stage), want(8.0), "writes, {stage} (timing {timing}):\n{text}");
            assert_eq!(count("read", stage), want(5.0), "reads, {stage} (timing {timing}):\n{text}");
            assert_eq!(count("other", stage), want(1.0), "the flush, {stage} (timing {timing}):\n{text}");
        }
        if timing {
            let sum = sample(&text, "ferrovol_nbd_request_stage_seconds_sum{command=\"write\",stage=\"serve\"}");
            assert!(sum.is_some_and(|s| s > 0.0), "writes took time to serve:\n{text}");
        }
        // The probe ticks every 10 ms on each of the two threads; the scrape came
        // well after the server started.
        let ticks = sample(&text, "ferrovol_dataplane_lag_seconds_count");
        assert!(ticks.is_some_and(|n| n >= 2.0), "lag probe ticks:\n{text}");
        assert!(sample(&text, "ferrovol_dataplane_lag_max_seconds").is_some_and(|m| m >= 0.0), "{text}");
    }
}
