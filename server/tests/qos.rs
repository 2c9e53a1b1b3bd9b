//! Per-volume QoS limits on a real `ferrovol serve`, driven by fio's nbd engine: a
//! limited volume serves its limit (a ratio against an unlimited volume in the same
//! run), a limit changed while fio runs takes effect within a second, a throttled
//! volume does not slow another, and the limits are kept across a restart.
//!
//! Tolerances: the limiter never releases a request early, so over fio's measured
//! window (after a ramp that the first request's free slot falls in) a volume gets at
//! most its limit; it may get less only when the client cannot keep requests waiting,
//! which at these rates and queue depths takes a stall of tens of milliseconds on the
//! machine. So a measured rate must lie within [0.85, 1.05] of the limit; the upper
//! bound is the property, the lower one allows a loaded machine.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

/// fio's result for one run of `args` (its nbd engine on `uri`, JSON output): the
/// IOPS of direction `dir` ("read" or "write"), all jobs together.
fn fio_iops(dir_path: &Path, uri: &str, dir: &str, args: &[&str]) -> f64 {
    let o = output(
        peer("fio").current_dir(dir_path).args(
            [
                "--name=q",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--output-format=json",
                "--group_reporting",
                "--time_based",
            ]
            .iter()
            .chain(args),
        ),
    );
    assert!(o.status.success(), "fio failed: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let start = out.find('{').unwrap_or_else(|| panic!("no JSON from fio: {out}"));
    let v: serde_json::Value = serde_json::from_str(&out[start..]).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["jobs"][0]["error"], 0, "fio: {out}");
    v["jobs"][0][dir]["iops"].as_f64().unwrap()
}

#[test]
fn a_limited_volume_serves_its_limit_and_an_unlimited_one_more() {
    let td = TestDir::new();
    let port = free_port();
    let s = Server::start_with(&td.data(), "2GiB", &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    s.create_volume("free", "256MiB");
    s.cli_ok(&["volume", "create", "capped", "--size", "256MiB", "--read-iops", "300", "--write-iops", "200"]);
    let info = json(&s.cli_ok(&["volume", "info", "capped", "--json"]));
    assert_eq!(info["qos"]["read_iops"], 300, "{info}");
    assert!(s.cli_ok(&["volume", "info", "capped"]).contains("qos: read 300 IOPS, write 200 IOPS"));
    let job = ["--bs=4k", "--iodepth=16", "--runtime=3", "--ramp_time=1"];
    let with = |rw: &'static str| [&job[..], &[rw]].concat();
    let capped_read = fio_iops(td.path(), &s.uri("capped"), "read", &with("--rw=randread"));
    let capped_write = fio_iops(td.path(), &s.uri("capped"), "write", &with("--rw=randwrite"));
    let free_read = fio_iops(td.path(), &s.uri("free"), "read", &with("--rw=randread"));
    eprintln!(
        "capped read {capped_read:.0} IOPS (limit 300), write {capped_write:.0} (limit 200); free read {free_read:.0}"
    );
    assert!((0.85 * 300.0..=1.05 * 300.0).contains(&capped_read), "read IOPS {capped_read} against a limit of 300");
    assert!((0.85 * 200.0..=1.05 * 200.0).contains(&capped_write), "write IOPS {capped_write} against a limit of 200");
    assert!(free_read > 2.0 * 300.0, "the unlimited volume did {free_read} IOPS: the limit was not what held back");
    let m = scrape(port);
    let throttled = sample(&m, "ferrovol_volume_throttled_seconds_total{volume=\"capped\"}").unwrap_or(0.0);
    assert!(throttled > 1.0, "time spent throttled: {throttled}\n{m}");
    assert_eq!(sample(&m, "ferrovol_volume_throttled_seconds_total{volume=\"free\"}"), Some(0.0), "{m}");

    // Bytes per second: 1 MiB/s of 64 KiB reads is 16 IOPS.
    s.cli_ok(&["volume", "set-qos", "capped", "--clear", "--read-bps", "1M"]);
    let r = fio_iops(
        td.path(),
        &s.uri("capped"),
        "read",
        &["--bs=64k", "--iodepth=4", "--runtime=3", "--ramp_time=1", "--rw=randread"],
    );
    assert!((0.85 * 16.0..=1.05 * 16.0).contains(&r), "64 KiB reads at 1 MiB/s: {r} IOPS, not 16");

    // Durable once set: kept across a crash. Bad limits are refused and change nothing.
    let err = s.cli_err(&["volume", "set-qos", "capped", "--clear", "--burst-ms", "100"]);
    assert!(err.contains("burst without a limit"), "{err}");
    let err = s.cli_err(&["volume", "create", "x", "--size", "1MiB", "--label", "ferrovol/qos=read-iops=1"]);
    assert!(err.contains("set by the server"), "{err}");
    // The limits are kept as a label of the server's own, which counts among the 16:
    // the refusal says so, and nothing is made.
    let labels: Vec<String> = (0..16).map(|i| format!("k{i}=v")).collect();
    let mut args = vec!["volume", "create", "full", "--size", "1MiB", "--write-iops", "10"];
    for l in &labels {
        args.extend(["--label", l.as_str()]);
    }
    let err = s.cli_err(&args);
    assert!(err.contains("17 labels, 1 of them named ferrovol/"), "{err}");
    assert!(!s.cli_ok(&["volume", "list"]).contains("full"), "a refused create made a volume");
    let mut s = s;
    s.kill9();
    s.restart();
    let info = json(&s.cli_ok(&["volume", "info", "capped", "--json"]));
    assert_eq!(info["qos"]["read_bytes_per_second"], 1 << 20, "{info}");
    assert_eq!(info["qos"]["read_iops"], 0, "{info}");
}

/// Reads fio's IOPS log (`TIME_MS, IOPS, DIR, BS, ...` per line, averaged over
/// `log_avg_msec`): (time in ms, IOPS).
fn iops_log(path: &Path) -> Vec<(u64, f64)> {
    let t = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    t.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_limit_changed_while_fio_runs_takes_effect_within_a_second() {
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.cli_ok(&["volume", "create", "v", "--size", "256MiB", "--write-iops", "100"]);
    let uri = s.uri("v");
    let dir = td.path().to_owned();
    let spawned = Instant::now();
    let fio = std::thread::spawn(move || {
        fio_iops(
            &dir,
            &uri,
            "write",
            &["--rw=randwrite", "--bs=4k", "--iodepth=16", "--runtime=6", "--write_iops_log=v", "--log_avg_msec=250"],
        )
    });
    std::thread::sleep(Duration::from_millis(2500));
    s.cli_ok(&["volume", "set-qos", "v", "--write-iops", "1000"]);
    let changed = spawned.elapsed().as_millis() as u64;
    fio.join().unwrap();
    // fio's clock starts after it was spawned, so a window of its log ends later than
    // it says: windows a second or more before the change in its time were before it,
    // and windows starting a second after the change in its time were too.
    let log = iops_log(&td.path().join("v_iops.1.log"));
    let before: Vec<f64> = log.iter().filter(|(t, _)| *t + 1000 <= changed && *t > 250).map(|(_, v)| *v).collect();
    let after: Vec<f64> = log.iter().filter(|(t, _)| *t >= changed + 1250).map(|(_, v)| *v).collect();
    assert!(before.len() >= 2 && !after.is_empty(), "change at {changed} ms; log {log:?}");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    eprintln!("change at {changed} ms: before {:.0} IOPS, after {:.0}", mean(&before), mean(&after));
    // A window is counted by fio's clock when it reaps: a client paused by its host
    // reaps late, so one window dips and the next makes up for it (67 then 143 was
    // seen). The server's rate shows over two windows, half a second.
    assert!(mean(&before) <= 1.1 * 100.0, "over the old limit of 100 before the change: {log:?}");
    assert!(
        before.windows(2).all(|w| (w[0] + w[1]) / 2.0 <= 1.3 * 100.0),
        "over the old limit of 100 in half a second before the change: {log:?}"
    );
    // The new limit took effect: five times the old one at least. Whether the server
    // then reaches all of 1000 is the disk's and the host's matter (on this shared
    // machine 500 to 980 a window was seen, with nothing else running).
    assert!(
        mean(&after) >= 5.0 * 100.0,
        "the new limit of 1000 did not take effect a second after the change: {log:?}"
    );
    assert!(mean(&after) <= 1.05 * 1000.0, "over the new limit of 1000: {log:?}");
}

#[test]
fn a_throttled_volume_does_not_slow_another() {
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("other", "256MiB");
    // Writes of 1 MiB at 20 a second, with 4 × 8 of them waiting at any time.
    s.cli_ok(&["volume", "create", "noisy", "--size", "1GiB", "--write-iops", "20"]);
    let other = |dir: &Path| {
        fio_iops(
            dir,
            &s.uri("other"),
            "read",
            &["--rw=randread", "--bs=4k", "--iodepth=16", "--runtime=2", "--ramp_time=1"],
        )
    };
    let mut ratios = Vec::new();
    for _ in 0..3 {
        let alone = other(td.path());
        let uri = s.uri("noisy");
        let dir = td.path().to_owned();
        let noisy = std::thread::spawn(move || {
            let args = ["--rw=randwrite", "--bs=1M", "--iodepth=8", "--numjobs=4", "--runtime=5"];
            fio_iops(&dir, &uri, "write", &args)
        });
        std::thread::sleep(Duration::from_millis(1000));
        let together = other(td.path());
        let noisy = noisy.join().unwrap();
        assert!(noisy <= 1.05 * 20.0 + 1.0, "the noisy volume did {noisy} IOPS over its limit of 20");
        eprintln!("other volume alone {alone:.0} IOPS, beside the throttled one {together:.0}");
        ratios.push(together / alone);
        if together >= 0.7 * alone {
            return;
        }
    }
    panic!("the other volume's IOPS beside a throttled one, as a share of its IOPS alone: {ratios:?}");
}

/// An unpublish does not wait for requests a limit holds back: they never run, and the
/// fenced connection closes at once instead of after the queue drains (32 writes at 2 a
/// second would take 16 s).
#[test]
fn an_unpublish_cuts_off_requests_waiting_for_their_turn() {
    let td = TestDir::new();
    let s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached"]);
    s.cli_ok(&["volume", "create", "v", "--size", "64MiB", "--write-iops", "2"]);
    let a = json(&s.cli_ok(&["volume", "publish", "v", "--node", "node-1", "--json"]));
    let uri = s.uri(a["export_name"].as_str().unwrap());
    let dir = td.path().to_owned();
    let fio = std::thread::spawn(move || {
        output(peer("fio").current_dir(&dir).args([
            "--name=q",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--time_based",
            "--runtime=30",
        ]))
    });
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]);
    let took = t.elapsed();
    let fio = fio.join().unwrap();
    assert!(took < Duration::from_secs(4), "unpublish waited {took:?} for requests held back by the limit");
    assert!(!fio.status.success(), "fio was not cut off: {}", text(&fio));
    // Only the writes let through before the unpublish reached the volume (one at
    // first, then two a second; each maps a 64 KiB unit), and nothing after it.
    let allocated = || json(&s.cli_ok(&["volume", "info", "v", "--json"]))["allocated_bytes"].as_u64().unwrap();
    let after = allocated();
    assert!(after <= 8 * 65536, "{after} bytes allocated by writes a limit of 2 per second let through");
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(allocated(), after, "a write held back by the limit landed after the unpublish");
}
