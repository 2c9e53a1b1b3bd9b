//! kill -9 at a random moment while snapshots are created and deleted under a write
//! load, 30 rounds on one pool (on one data-plane thread, and again on two): after each
//! restart every flushed write reads back, every snapshot whose create was
//! acknowledged (and not deleted) exists, every acknowledged delete stays deleted,
//! each snapshot holds a clean prefix of the write sequence (its point in time: no
//! torn or foreign blocks), and `ferrovol check` is clean. fio takes part too: each
//! round it writes a region of its own volume with verify headers and flushes, then
//! keeps writing verified blocks elsewhere, and snapshots of its volume are taken,
//! while the server is killed; after the restart `fio --verify_only` passes on that
//! round's region and on an earlier one.

mod common;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const WRITER: &str = r#"
import sys, hashlib, nbd
uri, stride, blen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def block(i):
    d = hashlib.sha256(b"snapcrash:%d" % i).digest()
    return (d * (blen // len(d) + 1))[:blen]
h = nbd.NBD(); h.connect_uri(uri)
i = 0
while True:
    h.pwrite(block(i), i * stride)
    h.flush()
    sys.stdout.write("%d\n" % i); sys.stdout.flush()
    i += 1
"#;

/// For the export: blocks 0..=last must each be exactly block(i) or all zeros, and the
/// written ones must form a prefix (writes were sequential, each flushed). With
/// `must_have`, blocks 0..must_have must all be present, and the block right after
/// them, written but never flushed, may be partly persisted (a disk with a volatile
/// cache may keep any part of an unflushed write). Prints "prefix N".
const PREFIX: &str = r#"
import sys, hashlib, nbd
uri, stride, blen, last, must_have = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def block(i):
    d = hashlib.sha256(b"snapcrash:%d" % i).digest()
    return (d * (blen // len(d) + 1))[:blen]
h = nbd.NBD(); h.connect_uri(uri)
state = []
for i in range(last + 2):
    b = h.pread(blen, i * stride)
    state.append("w" if b == block(i) else "z" if b == bytes(blen) else "x")
# The writer prints after a flush returns: up to two blocks past the printed ones
# may have been written (one flushed but not yet printed, one in flight).
for j in (must_have, must_have + 1):
    if must_have > 0 and j < len(state) and state[j] == "x":
        state[j] = "z"
assert "x" not in state, "torn or foreign block at %d" % state.index("x")
n = state.index("z") if "z" in state else len(state)
assert "w" not in state[n:], "not a prefix: written block after a hole at %d" % n
assert n >= must_have, "only %d blocks, %d were flushed" % (n, must_have)
print("prefix", n)
"#;

/// Rounds of kill -9 (`CRASH_ROUNDS`, default 30), each on a new volume of the same
/// pool, so recovery also runs over everything the earlier rounds left behind.
#[test]
fn snapshots_stay_consistent_across_kill9_under_load() {
    crash_rounds(&[]);
}

/// The same with two data-plane threads: the writer, fio and the snapshot churn's
/// copy-on-write land on both, while the management thread creates and deletes.
#[test]
fn snapshots_stay_consistent_across_kill9_under_load_on_two_dataplane_threads() {
    crash_rounds(&["--dataplane-threads", "2"]);
}

fn crash_rounds(serve_args: &[&str]) {
    require_python_nbd();
    let rounds: u64 = std::env::var("CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "16GiB", serve_args);
    s.create_volume("fio", "1GiB");
    let mut totals = (0, 0, 0);
    for round in 0..rounds {
        let (flushed, created, deleted) = crash_round(&mut s, &td, round);
        totals = (totals.0 + flushed, totals.1 + created, totals.2 + deleted);
    }
    eprintln!("{rounds} rounds: {} blocks flushed, {} snapshots created, {} deleted", totals.0, totals.1, totals.2);
    s.stop();
    check_clean(&td.data());
}

/// fio over `uri` (volume `fio`) on the 8 MiB region that round `round` stamps (60
/// regions, reused after), sequential 64 KiB blocks with crc32c verify headers, plus
/// `args`; returns whether it succeeded and its output.
fn fio_region(td: &TestDir, uri: &str, round: u64, args: &[&str]) -> (bool, String) {
    let offset = format!("--offset={}", (round % 60) * (8 << 20));
    let o = output(
        peer("fio")
            .current_dir(td.path())
            .args(["--name=stamp", "--ioengine=nbd", &format!("--uri={uri}")])
            .args(["--rw=write", "--bs=64k", &offset, "--size=8m"])
            .args(["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--output-format=normal"])
            .args(args),
    );
    (o.status.success() && !text(&o).to_lowercase().contains("verify failed"), text(&o))
}

/// One round: a writer on volume `v{round}` flushes every block, snapshots are created
/// and deleted until a kill -9 at a random moment; then `check` is clean, the server
/// restarts, and the volume and (some of) its snapshots are verified. Returns the
/// blocks flushed and the snapshots created and deleted.
fn crash_round(s: &mut Server, td: &TestDir, round: u64) -> (usize, usize, usize) {
    let vol = format!("v{round}");
    s.create_volume(&vol, "512MiB");
    // fio stamps this round's region and flushes it (end_fsync) before the load starts.
    let (ok, out) = fio_region(td, &s.uri("fio"), round, &["--do_verify=0", "--end_fsync=1"]);
    assert!(ok, "round {round}: fio stamp failed:\n{out}");
    // ... then writes verified blocks at random in the last 64 MiB until the server dies.
    let mut fio_load = peer("fio")
        .current_dir(td.path())
        .args(["--name=load", "--ioengine=nbd", &format!("--uri={}", s.uri("fio")), "--rw=randwrite"])
        .args(["--bs=16k", "--iodepth=8", "--offset=960m", "--size=64m", "--verify=crc32c", "--do_verify=1"])
        .args(["--verify_state_save=0", "--time_based", "--runtime=60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (stride, blen) = (69632u64, 16384u64); // blocks straddle 64 KiB units
    let acked = td.path().join(format!("acked-{round}.txt"));
    let mut writer = Command::new("timeout")
        .args(["-k", "5", "60", PYTHON, "-c", WRITER, &s.uri(&vol), &stride.to_string(), &blen.to_string()])
        .env("PATH", peer_path())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&acked).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::fs::metadata(&acked).unwrap().len() == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "round {round}: writer acknowledged nothing");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Snapshot churn until the kill: create s{k}, delete s{k-2}; remember what was acknowledged.
    let kill_at = Instant::now() + Duration::from_millis(200 + rand_below(800));
    let (mut created, mut deleted) = (Vec::new(), Vec::new());
    let mut k = 0;
    while Instant::now() < kill_at || created.is_empty() {
        if s.cli(&["snapshot", "create", &vol, &format!("s{k}")]).status.success() {
            created.push(k);
        }
        if k >= 2 && s.cli(&["snapshot", "delete", &vol, &format!("s{}", k - 2)]).status.success() {
            deleted.push(k - 2);
        }
        // Snapshots of fio's volume too: its writes copy on write from here on.
        let _ = s.cli(&["snapshot", "create", "fio", &format!("r{round}k{k}")]);
        if k >= 1 {
            let _ = s.cli(&["snapshot", "delete", "fio", &format!("r{round}k{}", k - 1)]);
        }
        k += 1;
    }
    s.kill9();
    let _ = writer.wait();
    let _ = fio_load.wait();
    let raw = std::fs::read_to_string(&acked).unwrap();
    let flushed = raw.rfind('\n').map(|p| raw[..p].lines().count()).unwrap_or(0);
    assert!(flushed > 0, "round {round}: nothing flushed before the kill");
    check_clean(&td.data());
    s.restart();

    let prefix = format!("{vol}@");
    let listed: Vec<String> = json(&s.cli_ok(&["snapshot", "list", &vol, "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    for c in &created {
        let name = format!("{vol}@s{c}");
        if deleted.contains(c) {
            assert!(!listed.contains(&name), "round {round}: {name} was deleted but is back");
        } else {
            assert!(listed.contains(&name), "round {round}: {name} was created (acknowledged) but is gone: {listed:?}");
        }
    }
    // Every snapshot holds a clean prefix; check the newest and one other at random.
    let last = flushed as u64 + 2;
    let mut check: Vec<&String> = listed.iter().rev().take(1).collect();
    if listed.len() > 1 {
        check.push(&listed[rand_below(listed.len() as u64 - 1) as usize]);
    }
    for name in check {
        let o = python(PREFIX, &[&s.uri(name), &stride.to_string(), &blen.to_string(), &last.to_string(), "0"]);
        assert!(o.status.success(), "round {round}: snapshot {name}: {}", text(&o));
    }
    let o = python(
        PREFIX,
        &[&s.uri(&vol), &stride.to_string(), &blen.to_string(), &last.to_string(), &flushed.to_string()],
    );
    assert!(o.status.success(), "round {round}: volume after kill -9: {}", text(&o));
    // fio's flushed regions: this round's and an earlier one.
    for r in [round, rand_below(round + 1)] {
        let (ok, out) = fio_region(td, &s.uri("fio"), r, &["--verify_only"]);
        assert!(ok, "round {round}: fio --verify_only of round {r}'s region after kill -9:\n{out}");
    }
    // Keep the pool from filling: the volume goes; its snapshots stay (still checked by
    // `check`); fio's snapshots go.
    s.cli_ok(&["volume", "delete", &vol]);
    for v in json(&s.cli_ok(&["snapshot", "list", "fio", "--json"])).as_array().unwrap() {
        let name = v["name"].as_str().unwrap();
        s.cli_ok(&["snapshot", "delete", "fio", name.trim_start_matches("fio@")]);
    }
    let _ = std::fs::remove_file(&acked);
    (flushed, created.len(), deleted.len())
}
