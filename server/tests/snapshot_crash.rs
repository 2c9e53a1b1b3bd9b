//! kill -9 at a random moment while snapshots are created and deleted under a write
//! load: after restart every flushed write reads back, every snapshot whose create
//! was acknowledged (and not deleted) exists, every acknowledged delete stays deleted,
//! each snapshot holds a clean prefix of the write sequence (its point in time: no
//! torn or foreign blocks), and `ferrovol check` is clean.

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

#[test]
fn snapshots_stay_consistent_across_kill9_under_load() {
    require_python_nbd();
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("v", "512MiB");
    let (stride, blen) = (69632u64, 16384u64); // blocks straddle 64 KiB units
    let acked = td.path().join("acked.txt");
    let mut writer = Command::new("timeout")
        .args(["-k", "5", "60", PYTHON, "-c", WRITER, &s.uri("v"), &stride.to_string(), &blen.to_string()])
        .env("PATH", peer_path())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&acked).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::fs::metadata(&acked).unwrap().len() == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "writer acknowledged nothing");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Snapshot churn until the kill: create s{k}, delete s{k-2}; remember what was acknowledged.
    let kill_at = Instant::now() + Duration::from_millis(800 + rand_below(1200));
    let (mut created, mut deleted) = (Vec::new(), Vec::new());
    let mut k = 0;
    while Instant::now() < kill_at {
        if s.cli(&["snapshot", "create", "v", &format!("s{k}")]).status.success() {
            created.push(k);
        }
        if k >= 2 && s.cli(&["snapshot", "delete", "v", &format!("s{}", k - 2)]).status.success() {
            deleted.push(k - 2);
        }
        k += 1;
    }
    s.kill9();
    let _ = writer.wait();
    let raw = std::fs::read_to_string(&acked).unwrap();
    let flushed = raw.rfind('\n').map(|p| raw[..p].lines().count()).unwrap_or(0);
    assert!(flushed > 0 && !created.is_empty(), "nothing happened before the kill");
    check_clean(&td.data());
    s.restart();

    let listed: Vec<String> = json(&s.cli_ok(&["snapshot", "list", "v", "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .collect();
    for c in &created {
        let name = format!("v@s{c}");
        if deleted.contains(c) {
            assert!(!listed.contains(&name), "{name} was deleted but is back");
        } else {
            assert!(listed.contains(&name), "{name} was created (acknowledged) but is gone: {listed:?}");
        }
    }
    let last = flushed as u64 + 2;
    for name in &listed {
        let o = python(PREFIX, &[&s.uri(name), &stride.to_string(), &blen.to_string(), &last.to_string(), "0"]);
        assert!(o.status.success(), "snapshot {name}: {}", text(&o));
    }
    let o =
        python(PREFIX, &[&s.uri("v"), &stride.to_string(), &blen.to_string(), &last.to_string(), &flushed.to_string()]);
    assert!(o.status.success(), "volume after kill -9: {}", text(&o));
    eprintln!(
        "{flushed} blocks flushed, {} snapshots created, {} deleted, {} listed",
        created.len(),
        deleted.len(),
        listed.len()
    );
    s.stop();
    check_clean(&td.data());
}
