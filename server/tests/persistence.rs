//! What survives a restart: data and volumes after a clean stop (SIGTERM), and every
//! flushed or FUA write after kill -9; `ferrovol check` finds the stopped pool clean.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn data_survives_clean_restart() {
    // Data written over NBD reads back after a clean stop (SIGTERM) and restart.
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("p", "256MiB");
    // no explicit flush: a clean shutdown must flush on its own
    qemu_io_ok(
        &s.uri("p"),
        &["write -P 0x21 0 1M", "write -P 0x22 1000 70000", "write -P 0x23 100M 8M", "write -P 0x24 255M 1M"],
    );
    s.stop();
    check_clean(&td.data());
    s.restart();
    let reads = [
        "read -P 0x21 0 1000",
        "read -P 0x22 1000 70000",
        "read -P 0x21 71000 977576",
        "read -P 0 1M 99M",
        "read -P 0x23 100M 8M",
        "read -P 0x24 255M 1M",
    ];
    qemu_io_ok(&s.uri("p"), &reads);
    // a second clean cycle changes nothing
    s.stop();
    s.restart();
    qemu_io_ok(&s.unix_uri("p"), &reads);
    s.stop();
    check_clean(&td.data());
}

/// A server whose stderr cannot be written (a full file system under its log file; a
/// log reader that went away) serves, answers management calls with their true outcome,
/// and stops cleanly on SIGTERM with its final commit: losing the log must never cost
/// data or a wrong answer.
#[test]
fn a_server_whose_log_cannot_be_written_serves_and_stops_cleanly() {
    require_python_nbd();
    let td = TestDir::new();
    let mut s = Server::start_logging_to(&td.data(), "1GiB", &[], std::path::Path::new("/dev/full"));
    // Each of these logs a line at info level.
    s.create_volume("a", "64MiB");
    s.cli_ok(&["snapshot", "create", "a", "s1"]);
    s.cli_ok(&["volume", "clone", "--from", "a@s1", "c"]);
    s.cli_ok(&["snapshot", "delete", "a", "s1"]);
    s.cli_ok(&["volume", "delete", "c"]);
    // Written, acknowledged, never flushed: the clean stop must make it durable.
    python_ok(
        "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nh.pwrite(b'\\xab' * 1048576, 4096)\nh.shutdown()",
        &[&s.uri("a")],
    );
    s.stop();
    check_clean(&td.data());
    s.stderr_to = None;
    s.restart();
    qemu_io_ok(&s.uri("a"), &["read -P 0 0 4096", "read -P 0xab 4096 1M"]);
    assert_eq!(s.volumes().as_array().unwrap().len(), 1, "{}", s.volumes());
    s.stop();
}

#[test]
fn flushed_data_survives_kill9() {
    // Data whose flush or FUA write returned survives kill -9, and the crashed pool checks clean.
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("k", "128MiB");
    qemu_io_ok(&s.uri("k"), &["write -P 0x5a 0 1M", "flush"]);
    qemu_io_ok(&s.uri("k"), &["write -P 0x5b 5000 12345", "write -P 0x5c 64M 3M", "flush"]);
    qemu_io_ok(&s.uri("k"), &["write -f -P 0x6b 2M 1M", "write -f -P 0x6c 100M 4097"]); // FUA, no flush
                                                                                        // trims and zeroes are durable after a flush too
    qemu_io_ok(
        &s.uri("k"),
        &["write -P 0x6d 110M 4M", "flush", "discard 110M 1M", "write -z 111M 1M", "write -z -u 112M 1M", "flush"],
    );
    s.kill9();
    check_clean(&td.data());
    s.restart();
    qemu_io_ok(
        &s.uri("k"),
        &[
            "read -P 0x5a 0 5000",
            "read -P 0x5b 5000 12345",
            "read -P 0x5a 17345 1031231",
            "read -P 0 1M 1M",
            "read -P 0x6b 2M 1M",
            "read -P 0x5c 64M 3M",
            "read -P 0x6c 100M 4097",
            "read -P 0 67M 33M",
            "read -P 0 110M 3M",
            "read -P 0x6d 113M 1M",
        ],
    );
    // overwrite after recovery, crash again, and the newest flushed data wins
    qemu_io_ok(&s.uri("k"), &["write -P 0x7d 0 2M", "flush"]);
    s.kill9();
    s.restart();
    qemu_io_ok(&s.uri("k"), &["read -P 0x7d 0 2M", "read -P 0x5c 64M 3M"]);
    s.stop();
    check_clean(&td.data());
}

/// Writes block i (content derived from TAG and i) to slot i mod n, then flushes (or
/// writes with FUA; or, in "multiconn" mode, writes on a second connection and flushes
/// on the first, which multi-conn makes cover both), then prints i: a printed i is
/// durable. Runs until the server dies.
const CRASH_WRITER: &str = r#"
import sys, hashlib, nbd
uri, tag, stride, blen, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def block(i):
    d = hashlib.sha256(("%s:%d" % (tag, i)).encode()).digest()
    return (d * (blen // len(d) + 1))[:blen]
h = nbd.NBD(); h.connect_uri(uri)
n = h.get_size() // stride
if mode == "multiconn":
    assert h.can_multi_conn()
    h2 = nbd.NBD(); h2.connect_uri(uri)
i = 0
while True:
    if mode == "fua":
        h.pwrite(block(i), (i % n) * stride, nbd.CMD_FLAG_FUA)
    elif mode == "multiconn":
        h2.pwrite(block(i), (i % n) * stride)
        h.flush()
    else:
        h.pwrite(block(i), (i % n) * stride)
        h.flush()
    sys.stdout.write("%d\n" % i); sys.stdout.flush()
    i += 1
"#;

/// Reads back the newest acknowledged block of every slot; slots past the last block
/// sent must still read as zeros. Prints "checked N blocks, 0 bad" and exits 0 if all match.
const CRASH_VERIFIER: &str = r#"
import sys, hashlib, nbd
uri, tag, stride, blen, acked = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def block(i):
    d = hashlib.sha256(("%s:%d" % (tag, i)).encode()).digest()
    return (d * (blen // len(d) + 1))[:blen]
h = nbd.NBD(); h.connect_uri(uri)
n = h.get_size() // stride
latest = {}
for line in open(acked):
    latest[int(line) % n] = int(line)
bad = [i for s, i in sorted(latest.items()) if h.pread(blen, s * stride) != block(i)]
last = max(latest.values())
nonzero = []
if last + 12 < n:
    # block last+1 may have been in flight; the ones after it were never sent
    nonzero = [s for s in range(last + 2, last + 12) if h.pread(blen, s * stride) != bytes(blen)]
print("checked %d blocks, %d bad%s%s" % (len(latest), len(bad),
      (": first bad indexes %s" % bad[:10]) if bad else "",
      ("; never-written slots not zero: %s" % nonzero) if nonzero else ""))
sys.exit(1 if bad or nonzero else 0)
"#;

struct Round {
    volume: String,
    tag: String,
    stride: u64,
    blen: u64,
    acked: std::path::PathBuf,
}

impl Round {
    fn verify(&self, s: &Server) -> String {
        let args = [
            &s.uri(&self.volume),
            self.tag.as_str(),
            &self.stride.to_string(),
            &self.blen.to_string(),
            self.acked.to_str().unwrap(),
        ];
        let o = python(CRASH_VERIFIER, &args);
        assert!(o.status.success(), "round {}: acknowledged data lost after kill -9:\n{}", self.volume, text(&o));
        text(&o)
    }
}

#[test]
fn acknowledged_writes_survive_kill9_during_write_loop() {
    kill9_during_write_loops(&[]);
}

/// The same on two data-plane threads, as a host with cores to spare runs the server:
/// the writers' connections (two for the multi-conn round) land on both threads.
#[test]
fn acknowledged_writes_survive_kill9_during_write_loop_on_two_dataplane_threads() {
    kill9_during_write_loops(&["--dataplane-threads", "2"]);
}

fn kill9_during_write_loops(serve_args: &[&str]) {
    // Every block whose flush (or FUA write) returned before a random kill -9 reads back exactly after restart.
    require_python_nbd();
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "2GiB", serve_args);
    // (mode, block length, stride): unit-unaligned 64 KiB blocks with gaps, small
    // adjacent unaligned blocks sharing units, multi-unit aligned blocks, FUA writes,
    // and writes on one connection made durable by a flush on another (multi-conn)
    let plans: [(&str, u64, u64); 5] = [
        ("flush", 65536, 69632),
        ("flush", 5096, 5096),
        ("flush", 262144, 262144),
        ("fua", 12288, 12800),
        ("multiconn", 32768, 40960),
    ];
    let mut rounds: Vec<Round> = Vec::new();
    for (r, (mode, blen, stride)) in plans.into_iter().enumerate() {
        let volume = format!("crash{r}");
        s.create_volume(&volume, "1GiB");
        let round = Round {
            volume,
            tag: format!("round{r}-{}", rand_below(1 << 40)),
            stride,
            blen,
            acked: td.path().join(format!("acked{r}.txt")),
        };
        let acked_file = std::fs::File::create(&round.acked).unwrap();
        let err_path = td.path().join(format!("writer{r}.err"));
        let mut writer = Command::new("timeout")
            .args([
                "-k",
                "5",
                "60",
                PYTHON,
                "-c",
                CRASH_WRITER,
                &s.uri(&round.volume),
                &round.tag,
                &stride.to_string(),
                &blen.to_string(),
                mode,
            ])
            .env("PATH", peer_path())
            .stdin(Stdio::null())
            .stdout(acked_file)
            .stderr(std::fs::File::create(&err_path).unwrap())
            .spawn()
            .unwrap();
        // wait for the first acknowledged block, then kill at a random moment 1-2 s later
        let t = Instant::now();
        while std::fs::metadata(&round.acked).unwrap().len() == 0 {
            if let Some(st) = writer.try_wait().unwrap() {
                panic!(
                    "writer exited ({st}) before its first flush: {}",
                    std::fs::read_to_string(&err_path).unwrap_or_default()
                );
            }
            assert!(t.elapsed() < Duration::from_secs(20), "no block acknowledged within 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(1000 + rand_below(1000)));
        assert!(
            writer.try_wait().unwrap().is_none(),
            "writer stopped before the kill: {}",
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        s.kill9();
        let st = writer.wait().unwrap();
        assert!(!st.success(), "writer must end with an error once the server is gone");

        // keep only complete lines: a line is printed after its flush returned
        let raw = std::fs::read_to_string(&round.acked).unwrap();
        let complete = match raw.rfind('\n') {
            Some(p) => &raw[..=p],
            None => "",
        };
        let n = complete.lines().count();
        assert!(n > 0, "no block acknowledged before the kill");
        std::fs::write(&round.acked, complete).unwrap();

        check_clean(&td.data());
        s.restart();
        let out = round.verify(&s);
        eprintln!("round {r} ({mode}, {blen} B blocks): {n} acknowledged; {}", out.trim());
        rounds.push(round);
    }
    // the later crashes and a clean restart left every earlier round's data intact
    s.stop();
    check_clean(&td.data());
    s.restart();
    for round in &rounds {
        round.verify(&s);
    }
}

fn sizes(s: &Server) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = s
        .volumes()
        .as_array()
        .expect("volume list is an array")
        .iter()
        .map(|v| (v["name"].as_str().unwrap().to_owned(), v["size_bytes"].as_u64().unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn volume_metadata_survives_restart() {
    // Volumes, sizes, deletions and resizes persist across a clean restart and across kill -9.
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("keep", "1GiB");
    s.create_volume("grow", "4MiB");
    s.create_volume("gone", "256MiB");
    s.create_volume("x.y_z-1", "12KiB");
    qemu_io_ok(&s.uri("gone"), &["write -P 0x01 0 16M", "flush"]);
    qemu_io_ok(&s.uri("grow"), &["write -P 0x02 0 4M", "flush"]);
    let used_with_gone = s.pool_status()["used_bytes"].as_u64().unwrap();
    assert!(used_with_gone >= 20 * MIB, "used bytes after writing 20 MiB: {used_with_gone}");
    s.cli_ok(&["volume", "delete", "gone"]);
    s.cli_ok(&["volume", "resize", "grow", "--size", "1GiB"]);
    let before = s.volumes();
    let want = vec![("grow".to_owned(), GIB), ("keep".to_owned(), GIB), ("x.y_z-1".to_owned(), 12 * KIB)];
    assert_eq!(sizes(&s), want, "volumes before restart");

    s.stop();
    check_clean(&td.data());
    s.restart();
    assert_eq!(sizes(&s), want, "volumes after a clean restart");
    let after = s.volumes();
    let key = |v: &serde_json::Value| v["name"].as_str().unwrap().to_owned();
    let (mut b, mut a) = (before.as_array().unwrap().clone(), after.as_array().unwrap().clone());
    b.sort_by_key(key);
    a.sort_by_key(key);
    for (x, y) in b.iter().zip(&a) {
        for f in ["id", "export_name", "created_unix", "size_bytes", "allocated_bytes"] {
            assert_eq!(x[f], y[f], "{f} of {} changed across restart", key(x));
        }
    }
    let used = s.pool_status()["used_bytes"].as_u64().unwrap();
    assert!(
        used < used_with_gone - 15 * MIB,
        "space of the deleted volume not free after restart: used {used}, was {used_with_gone}"
    );
    let e = s.cli_err(&["volume", "info", "gone"]);
    assert!(e.contains("not found"), "info on a deleted volume: {e}");
    let o = output(peer("nbdinfo").arg(s.uri("gone")));
    assert!(!o.status.success(), "the deleted volume is still exported:\n{}", text(&o));
    // the grown volume keeps its data and zeros beyond the old size
    qemu_io_ok(&s.uri("grow"), &["read -P 0x02 0 4M", "read -P 0 4M 4M", "write -P 0x03 1000M 1M"]);

    // management changes acknowledged right before a kill -9 are not lost either
    s.create_volume("late", "8MiB");
    s.cli_ok(&["volume", "resize", "keep", "--size", "2GiB"]);
    s.cli_ok(&["volume", "delete", "x.y_z-1"]);
    s.kill9();
    check_clean(&td.data());
    s.restart();
    let want = vec![("grow".to_owned(), GIB), ("keep".to_owned(), 2 * GIB), ("late".to_owned(), 8 * MIB)];
    assert_eq!(sizes(&s), want, "volumes after kill -9");
    // a name freed by deletion can be used again, and starts empty
    s.create_volume("gone", "64MiB");
    qemu_io_ok(&s.uri("gone"), &["read -P 0 0 16M"]);
    s.stop();
    check_clean(&td.data());
}

#[test]
fn restart_right_after_kill9() {
    // Right after a killed server is reaped, its pool can be checked or served again at once.
    require_python_nbd();
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("busy", "1GiB");
    let mut refused = Vec::new();
    for round in 0..20 {
        let mut writer = Command::new("timeout")
            .args([
                "-k",
                "5",
                "60",
                PYTHON,
                "-c",
                CRASH_WRITER,
                &s.uri("busy"),
                &format!("busy{round}"),
                "69632",
                "65536",
                "flush",
            ])
            .env("PATH", peer_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300 + rand_below(200)));
        s.kill9_no_wait();
        if round % 2 == 0 {
            // what an operator runs after a crash
            let o = cli(&td.data(), &["check"]);
            if !o.status.success() {
                refused.push(format!("round {round}, check: {}", text(&o).trim()));
            }
            let _ = writer.wait();
            wait_pool_unlocked(&s.pool_path());
            s.restart();
        } else {
            // what a supervisor does after a crash
            if let Err(log) = s.try_restart() {
                let last = log.lines().last().unwrap_or("").to_owned();
                refused.push(format!("round {round}, serve: {last}"));
                wait_pool_unlocked(&s.pool_path());
                s.restart();
            }
            let _ = writer.wait();
        }
    }
    s.stop();
    check_clean(&td.data());
    assert!(
        refused.is_empty(),
        "right after the killed server was reaped, the pool was refused as in use in {} of 20 rounds:\n{}",
        refused.len(),
        refused.join("\n")
    );
}
