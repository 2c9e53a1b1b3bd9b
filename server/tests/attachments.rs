//! The storage host as a CSI backend, against real `ferrovol serve` processes and real
//! clients: attachments enforced on the NBD wire (qemu-io, nbdinfo, nbdsh), fencing on
//! unpublish, idempotent creates by name, host identity, and the audit line.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

/// `volume publish NAME --node NODE [flags] --json` → (export name, reply).
fn publish(s: &Server, vol: &str, node: &str, flags: &[&str]) -> (String, serde_json::Value) {
    let mut args = vec!["volume", "publish", vol, "--node", node, "--json"];
    args.extend_from_slice(flags);
    let a = json(&s.cli_ok(&args));
    (a["export_name"].as_str().unwrap().to_owned(), a)
}

fn qemu_io(uri: &str, read_only: bool, cmds: &[&str]) -> std::process::Output {
    let mut c = peer("qemu-io");
    c.args(["-f", "raw"]);
    if read_only {
        c.arg("-r");
    }
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri);
    output(&mut c)
}

fn qemu_io_ok(uri: &str, read_only: bool, cmds: &[&str]) -> String {
    let o = qemu_io(uri, read_only, cmds);
    let t = text(&o);
    assert!(o.status.success() && !t.contains("failed"), "qemu-io {cmds:?} on {uri} failed: {t}");
    t
}

#[test]
fn attached_access_serves_a_volume_only_with_its_key() {
    let td = TestDir::new();
    let s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached"]);
    s.create_volume("v", "64MiB");
    // No key: refused with a reason, over TCP; nothing is listed.
    let o = output(peer("nbdinfo").arg(s.uri("v")));
    assert!(!o.status.success(), "served without a key: {}", text(&o));
    let o = qemu_io(&s.uri("v"), true, &["read 0 4k"]);
    assert!(!o.status.success() && text(&o).contains("published to"), "the refusal says why: {}", text(&o));
    let o = output(peer("nbdinfo").args(["--list", &s.base_uri()]));
    assert!(!text(&o).contains("export=\"v\"") && !text(&o).contains("export: v"), "listed: {}", text(&o));

    let (name, a) = publish(&s, "v", "node-1", &[]);
    assert!(name.starts_with("v/") && name.len() == 2 + 32, "{name}");
    assert_eq!(a["nbd_addresses"], serde_json::json!([format!("127.0.0.1:{}", s.port)]));
    assert_eq!(a["size_bytes"], 64 * MIB);
    // Publishing again to the same node gives the same attachment, key included.
    assert_eq!(publish(&s, "v", "node-1", &[]).0, name);
    qemu_io_ok(&s.uri(&name), false, &["write -P 0x5a 0 1M", "read -P 0x5a 0 1M"]);

    // A wrong key, another volume's key, and a malformed one are refused. A key for a
    // volume that does not exist gets the same answer as a wrong key: no name leaks.
    let wrong = format!("v/{}", "0".repeat(32));
    let refused = |uri: &str| {
        let o = qemu_io(uri, true, &["read 0 4k"]);
        assert!(!o.status.success(), "{uri} was served");
        text(&o).replace(uri, "URI")
    };
    let wrong_key = refused(&s.uri(&wrong));
    let no_volume = refused(&s.uri(&format!("nothing/{}", "0".repeat(32))));
    assert!(wrong_key.contains("not published with this key"), "{wrong_key}");
    assert_eq!(no_volume.replace("nothing", "v"), wrong_key, "a missing volume is told apart from a wrong key");
    s.create_volume("w", "64MiB");
    let (w_name, _) = publish(&s, "w", "node-1", &[]);
    let crossed = format!("v/{}", &w_name[2..]);
    assert!(!qemu_io(&s.uri(&crossed), true, &["read 0 4k"]).status.success(), "w's key opened v");
    assert!(!qemu_io(&s.uri("v/zz"), true, &["read 0 4k"]).status.success());

    // A read-only attachment: served read-only, writes refused, reads served.
    let (ro, _) = publish(&s, "v", "node-2", &["--read-only"]);
    let info = text(&output(peer("nbdinfo").arg(s.uri(&ro))));
    assert!(info.contains("is_read_only: true"), "{info}");
    qemu_io_ok(&s.uri(&ro), true, &["read -P 0x5a 0 1M"]);
    // qemu-io refuses to open a read-only export for writing; a client that writes
    // anyway gets EPERM.
    assert!(!qemu_io(&s.uri(&ro), false, &["write -P 0x11 0 4k"]).status.success());
    let code = "try:\n    h.pwrite(b'x' * 4096, 0)\n    print('written')\nexcept nbd.Error as e:\n    print('refused', e.errno)";
    let o = output(peer("nbdsh").args(["-u", &s.uri(&ro), "-c", code]));
    assert!(text(&o).contains("refused EPERM"), "a read-only attachment wrote: {}", text(&o));
    qemu_io_ok(&s.uri(&name), true, &["read -P 0x5a 0 1M"]);

    // The unix socket serves by name whatever the TCP policy.
    qemu_io_ok(&s.unix_uri("v"), true, &["read -P 0x5a 0 1M"]);

    // volume info shows the attachments (no key), the label-less volume, written.
    let v = json(&s.cli_ok(&["volume", "info", "v", "--json"]));
    let nodes: Vec<_> = v["attachments"].as_array().unwrap().iter().map(|a| a["node_id"].as_str().unwrap()).collect();
    assert_eq!(nodes, ["node-1", "node-2"]);
    assert_eq!(v["pristine"], false);
    assert!(!v.to_string().contains(&name[2..]), "volume info shows a key");
    assert_eq!(json(&s.cli_ok(&["volume", "info", "w", "--json"]))["pristine"], true);

    // A published volume cannot be deleted; unpublished from every node, it can.
    assert!(s.cli_err(&["volume", "delete", "v"]).contains("published"));
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]);
    assert!(s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]).contains("was not published"));
    assert!(!qemu_io(&s.uri(&name), true, &["read 0 4k"]).status.success(), "the old key still opens");
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-2"]);
    s.cli_ok(&["volume", "delete", "v"]);
}

#[test]
fn open_access_on_loopback_serves_by_name() {
    let td = TestDir::new();
    let s = Server::start(&td.data()); // 127.0.0.1: auto is open
    s.create_volume("v", "16MiB");
    qemu_io_ok(&s.uri("v"), false, &["write -P 0x33 0 64k"]);
    let (name, _) = publish(&s, "v", "n", &["--read-only"]);
    // The key opens it too, read-only as published.
    qemu_io_ok(&s.uri(&name), true, &["read -P 0x33 0 64k"]);
    assert!(!qemu_io(&s.uri(&name), false, &["write 0 4k"]).status.success());
    let h = json(&s.cli_ok(&["host", "info", "--json"]));
    assert_eq!(h["nbd_access"], "open");
}

/// A writer on a published key is cut off by unpublish: once unpublish returns, no
/// write of it reaches the volume, and every write it saw acknowledged is there.
#[test]
fn unpublish_cuts_off_a_writer_and_keeps_what_was_acknowledged() {
    let td = TestDir::new();
    let s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached"]);
    s.create_volume("v", "64MiB");
    let (name, _) = publish(&s, "v", "node-1", &[]);
    // Writes block i (4 KiB) with byte (i % 250) + 1 and prints i once acknowledged,
    // until a write fails.
    let code = r#"
import sys
i = 0
try:
    while i < 16384:
        h.pwrite(bytes([i % 250 + 1]) * 4096, i * 4096)
        print(i, flush=True)
        i += 1
except Exception as e:
    print("error", e, flush=True)
"#;
    let mut writer = peer("nbdsh")
        .args(["-u", &s.uri(&name), "-c", code])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(writer.stdout.take().unwrap()).lines();
    let mut acked = Vec::new();
    while acked.len() < 200 {
        acked.push(lines.next().expect("writer output").unwrap());
    }
    let t = Instant::now();
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]);
    assert!(t.elapsed() < Duration::from_secs(20), "unpublish took {:?}", t.elapsed());
    // What the volume holds right after unpublish returned.
    let dump = |tag: &str| {
        let out = td.path().join(format!("after-{tag}.img"));
        let o = output(peer("nbdcopy").args([&s.unix_uri("v"), out.to_str().unwrap()]));
        assert!(o.status.success(), "{}", text(&o));
        std::fs::read(out).unwrap()
    };
    let first = dump("unpublish");
    for l in lines.by_ref() {
        acked.push(l.unwrap());
    }
    let _ = writer.wait();
    let last = acked.last().unwrap().clone();
    assert!(last.starts_with("error"), "the writer was not cut off: it ended with {last}");
    let acked: Vec<usize> = acked.iter().filter_map(|l| l.parse().ok()).collect();
    let n = *acked.last().unwrap() + 1;
    assert!(n < 16384, "the writer finished before it was cut off");
    for i in 0..n {
        let want = (i % 250 + 1) as u8;
        assert!(first[i * 4096..(i + 1) * 4096].iter().all(|&b| b == want), "acknowledged block {i} is not there");
    }
    // Nothing landed after unpublish returned: the volume has not changed since.
    std::thread::sleep(Duration::from_millis(500));
    assert!(dump("later") == first, "a write reached the volume after unpublish returned");
    // Blocks past the last acknowledged one are zero or the one write in flight.
    let written = (0..16384).filter(|&i| first[i * 4096] != 0).count();
    assert!(written <= n + 1, "{written} blocks written, {n} acknowledged");
}

#[test]
fn attachments_and_keys_survive_a_crash() {
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached"]);
    s.create_volume("v", "16MiB");
    let host = json(&s.cli_ok(&["host", "info", "--json"]));
    let (name, _) = publish(&s, "v", "node-1", &["--exclusive"]);
    // Durable on return: a kill -9 right after keeps it.
    s.kill9();
    s.restart();
    qemu_io_ok(&s.uri(&name), false, &["write -P 0x77 0 64k", "read -P 0x77 0 64k"]);
    let v = json(&s.cli_ok(&["volume", "info", "v", "--json"]));
    assert_eq!(v["attachments"][0]["node_id"], "node-1");
    assert_eq!(v["attachments"][0]["exclusive"], true);
    // Exclusive: another node is refused.
    assert!(s.cli_err(&["volume", "publish", "v", "--node", "node-2"]).contains("node-1"));
    // The host id is the pool's, stable across restarts.
    let again = json(&s.cli_ok(&["host", "info", "--json"]));
    assert_eq!(host["host_id"], again["host_id"]);
    assert_eq!(host["host_id"], s.pool_status()["uuid"]);
    assert_eq!(again["format_version"], 5);
    s.cli_ok(&["volume", "unpublish", "v", "--node", "node-1"]);
    s.kill9();
    s.restart();
    assert!(!qemu_io(&s.uri(&name), true, &["read 0 4k"]).status.success(), "the unpublished key opens");
}

#[test]
fn advertised_addresses_are_reported() {
    let td = TestDir::new();
    let s = Server::start_with(
        &td.data(),
        "2GiB",
        &["--advertise", "storage-1.example:10809", "--advertise", "10.0.0.7:10809"],
    );
    s.create_volume("v", "16MiB");
    let want = serde_json::json!(["storage-1.example:10809", "10.0.0.7:10809"]);
    assert_eq!(publish(&s, "v", "n", &[]).1["nbd_addresses"], want);
    assert_eq!(json(&s.cli_ok(&["host", "info", "--json"]))["nbd_addresses"], want);
}

/// Creates by name are idempotent with exist_ok, also when ten race.
#[test]
fn creates_by_name_are_idempotent() {
    let td = TestDir::new();
    let s = Server::start(&td.data());
    let ten: Vec<_> = (0..10)
        .map(|_| {
            std::process::Command::new(BIN)
                .arg("--data-dir")
                .arg(&s.dir)
                .args(["volume", "create", "pvc-1", "--size", "1GiB", "--label", "pvc=ns/claim", "--exist-ok"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in ten {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let vols = s.volumes();
    let vols = vols.as_array().unwrap();
    assert_eq!(vols.len(), 1, "{vols:?}");
    assert_eq!(vols[0]["labels"]["pvc"], "ns/claim");
    // Another size, or other labels: ALREADY_EXISTS; without --exist-ok too.
    assert!(s
        .cli_err(&["volume", "create", "pvc-1", "--size", "2GiB", "--exist-ok", "--label", "pvc=ns/claim"])
        .contains("size"));
    assert!(s.cli_err(&["volume", "create", "pvc-1", "--size", "1GiB", "--exist-ok"]).contains("labels"));
    assert!(s.cli_err(&["volume", "create", "pvc-1", "--size", "1GiB", "--label", "pvc=ns/claim"]).contains("exists"));

    // Snapshots and clones through the API.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        use mgmt_api::{pb, ErrorKind};
        let c = mgmt_api::Client::connect_unix(&s.dir.join("ferrovol.sock")).await.unwrap();
        let snap = |vol: &str| pb::CreateSnapshotRequest {
            volume: vol.into(),
            snapshot: "s1".into(),
            labels: [("k".to_owned(), "v".to_owned())].into(),
            exist_ok: true,
        };
        let a = c.create_snapshot_with(snap("pvc-1")).await.unwrap();
        let b = c.create_snapshot_with(snap("pvc-1")).await.unwrap();
        assert_eq!(a.id, b.id);
        let mut other = snap("pvc-1");
        other.labels.clear();
        assert_eq!(c.create_snapshot_with(other).await.unwrap_err().kind(), ErrorKind::AlreadyExists);

        c.create_volume("pvc-2", 1 << 30).await.unwrap();
        let clone = |src: &str| pb::CloneVolumeRequest {
            source: src.into(),
            name: "pvc-3".into(),
            exist_ok: true,
            ..Default::default()
        };
        let a = c.clone_volume_with(clone("pvc-1@s1")).await.unwrap();
        assert_eq!(a.labels["ferrovol/origin"], "pvc-1@s1");
        let b = c.clone_volume_with(clone("pvc-1@s1")).await.unwrap();
        assert_eq!(a.id, b.id);
        let e = c.clone_volume_with(clone("pvc-2")).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
        assert!(e.to_string().contains("pvc-1@s1"), "{e}");
        // A plain volume of that name is no clone of anything.
        let e = c
            .clone_volume_with(pb::CloneVolumeRequest { name: "pvc-2".into(), ..clone("pvc-1@s1") })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
    });
}

/// Every call that changes something writes an audit line naming the caller.
#[test]
fn changes_are_audited() {
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("v", "16MiB");
    let (name, _) = publish(&s, "v", "node-9", &[]);
    s.cli_err(&["volume", "delete", "v"]);
    s.cli_ok(&["volume", "info", "v"]);
    let log = s.log_text();
    let audit: Vec<_> = log.lines().filter(|l| l.contains("ferrovol::audit")).collect();
    let uid = own_uid();
    let line = |call: &str| audit.iter().find(|l| l.contains(&format!("call=\"{call}\""))).copied();
    let c = line("CreateVolume").unwrap_or_else(|| panic!("no CreateVolume audit line in\n{log}"));
    assert!(c.contains(&format!("caller=\"uid={uid}\"")) && c.contains("outcome=\"ok\""), "{c}");
    let p = line("PublishVolume").expect("PublishVolume audited");
    assert!(p.contains("node-9") && !p.contains(&name[2..]), "{p}");
    let d = line("DeleteVolume").expect("DeleteVolume audited");
    assert!(d.contains("FailedPrecondition"), "{d}");
    assert!(line("GetVolume").is_none(), "reads are not audited");
}

/// This process's uid, from /proc (no libc call).
fn own_uid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A WRITE whose payload is still arriving when the node is unpublished, and whose
/// unpublish call is cancelled by its caller: a retried unpublish waits for the
/// connection, and the write, once its payload is in, does not reach the volume.
#[test]
fn a_write_still_arriving_at_unpublish_never_lands() {
    use std::io::{Read, Write};
    let td = TestDir::new();
    let s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached"]);
    s.create_volume("v", "16MiB");
    let (name, _) = publish(&s, "v", "node-1", &[]);
    let tcp = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = RawNbd::open(tcp, &name).unwrap().s;
    let mut req = 0x2560_9513u32.to_be_bytes().to_vec();
    req.extend_from_slice(&0u16.to_be_bytes()); // flags
    req.extend_from_slice(&1u16.to_be_bytes()); // NBD_CMD_WRITE
    req.extend_from_slice(&7u64.to_be_bytes()); // cookie
    req.extend_from_slice(&0u64.to_be_bytes()); // offset
    req.extend_from_slice(&(1u32 << 20).to_be_bytes()); // 1 MiB
    c.write_all(&req).unwrap();
    c.write_all(&vec![0xcc; 100_000]).unwrap();
    // The caller of the first unpublish goes away after 2 s (the connection holds on).
    let o = output(
        std::process::Command::new("timeout").args(["-s", "KILL", "2", BIN]).arg("--data-dir").arg(&s.dir).args([
            "volume",
            "unpublish",
            "v",
            "--node",
            "node-1",
        ]),
    );
    assert!(!o.status.success(), "unpublish returned while a write was arriving: {}", text(&o));
    // The retry must wait for that connection.
    let dir = s.dir.clone();
    let retry = std::thread::spawn(move || cli(&dir, &["volume", "unpublish", "v", "--node", "node-1"]));
    std::thread::sleep(Duration::from_secs(1));
    assert!(!retry.is_finished(), "the retried unpublish did not wait for the connection");
    c.write_all(&vec![0xcc; (1 << 20) - 100_000]).unwrap();
    let mut reply = [0u8; 16];
    // An error reply, or a connection closed without one.
    if c.read_exact(&mut reply).is_ok() {
        assert_ne!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), 0, "the write succeeded");
    }
    let o = retry.join().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = qemu_io(&s.unix_uri("v"), true, &["read -P 0 0 1M"]);
    assert!(o.status.success() && !text(&o).contains("failed") && !text(&o).contains("mismatch"), "{}", text(&o));
}

/// A raw NBD client on any stream: EXPORT_NAME handshake, then simple requests.
struct RawNbd<S> {
    s: S,
    cookie: u64,
}

impl<S: std::io::Read + std::io::Write> RawNbd<S> {
    fn open(mut s: S, name: &str) -> std::io::Result<RawNbd<S>> {
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting)?;
        s.write_all(&3u32.to_be_bytes())?;
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
        opt.extend_from_slice(name.as_bytes());
        s.write_all(&opt)?;
        let mut export = [0u8; 10];
        s.read_exact(&mut export)?;
        Ok(RawNbd { s, cookie: 0 })
    }

    /// One request; Ok(errno) with its payload (READ) read into `data`.
    fn request(&mut self, cmd: u16, offset: u64, len: u32, data: &mut [u8]) -> std::io::Result<u32> {
        self.cookie += 1;
        let mut req = 0x2560_9513u32.to_be_bytes().to_vec();
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&cmd.to_be_bytes());
        req.extend_from_slice(&self.cookie.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        if cmd == 1 {
            req.extend_from_slice(data);
        }
        self.s.write_all(&req)?;
        let mut reply = [0u8; 16];
        self.s.read_exact(&mut reply)?;
        let errno = u32::from_be_bytes(reply[4..8].try_into().unwrap());
        assert_eq!(u64::from_be_bytes(reply[8..16].try_into().unwrap()), self.cookie);
        if cmd == 0 && errno == 0 {
            self.s.read_exact(data)?;
        }
        Ok(errno)
    }
}

/// Writers on four nodes' keys while a manager publishes and unpublishes them at random
/// moments, on two data-plane threads: every write a writer saw acknowledged is on the
/// volume when the unpublish returns, and nothing reaches a node's region between its
/// unpublish returning and its next publish. Seeded; `FENCE_SEED` replays one.
#[test]
fn random_unpublishes_against_writers_keep_the_fence() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const NODES: usize = 4;
    const BLOCKS: u64 = 256; // 4 KiB blocks per node's region
    let seed: u64 = std::env::var("FENCE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("FENCE_SEED={seed}");
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let td = TestDir::new();
    let s = Server::start_with(&td.data(), "2GiB", &["--nbd-access", "attached", "--dataplane-threads", "2"]);
    s.create_volume("v", "16MiB");
    // Per node: the export name to use now (None: unpublished), and per block the
    // last sequence number acknowledged.
    type Slot = Mutex<(Option<String>, HashMap<u64, u64>)>;
    let slots: Arc<Vec<Slot>> = Arc::new((0..NODES).map(|_| Mutex::new((None, HashMap::new()))).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let port = s.port;
    let writers: Vec<_> = (0..NODES)
        .map(|n| {
            let (slots, stop) = (Arc::clone(&slots), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut seq = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let Some(name) = slots[n].lock().unwrap().0.clone() else {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    };
                    let Ok(tcp) = std::net::TcpStream::connect(("127.0.0.1", port)) else { continue };
                    let Ok(mut c) = RawNbd::open(tcp, &name) else { continue };
                    loop {
                        seq += 1;
                        let block = seq % BLOCKS;
                        let mut data = vec![0u8; 4096];
                        data[..8].copy_from_slice(&seq.to_le_bytes());
                        let offset = (n as u64 * BLOCKS + block) * 4096;
                        match c.request(1, offset, 4096, &mut data) {
                            Ok(0) => {
                                slots[n].lock().unwrap().1.insert(block, seq);
                            }
                            _ => break,
                        }
                    }
                }
            })
        })
        .collect();
    let sock = s.nbd_socket();
    let read_region = |n: usize| -> Vec<u64> {
        let mut c = RawNbd::open(std::os::unix::net::UnixStream::connect(&sock).unwrap(), "v").unwrap();
        let mut data = vec![0u8; (BLOCKS * 4096) as usize];
        assert_eq!(c.request(0, n as u64 * BLOCKS * 4096, (BLOCKS * 4096) as u32, &mut data).unwrap(), 0);
        data.chunks(4096).map(|b| u64::from_le_bytes(b[..8].try_into().unwrap())).collect()
    };
    // A node's region as its last unpublish left it.
    let mut fenced: Vec<Option<Vec<u64>>> = vec![None; NODES];
    for round in 0..40 {
        let n = (next() % NODES as u64) as usize;
        let node = format!("node-{n}");
        let published = slots[n].lock().unwrap().0.is_some();
        if published {
            s.cli_ok(&["volume", "unpublish", "v", "--node", &node]);
            let region = read_region(n);
            let acked = {
                let mut slot = slots[n].lock().unwrap();
                slot.0 = None;
                slot.1.clone()
            };
            for (block, seq) in acked {
                assert!(
                    region[block as usize] >= seq,
                    "round {round}: node {n} block {block}: acknowledged {seq}, volume holds {}",
                    region[block as usize]
                );
            }
            fenced[n] = Some(region);
        } else {
            if let Some(before) = &fenced[n] {
                assert!(read_region(n) == *before, "round {round}: node {n}'s region changed while it was unpublished");
            }
            let (name, _) = publish(&s, "v", &node, &[]);
            slots[n].lock().unwrap().0 = Some(name);
        }
        std::thread::sleep(Duration::from_millis(next() % 80));
    }
    // Every node unpublished at the end, and checked once more after a pause.
    for n in 0..NODES {
        if slots[n].lock().unwrap().0.is_some() {
            s.cli_ok(&["volume", "unpublish", "v", "--node", &format!("node-{n}")]);
            slots[n].lock().unwrap().0 = None;
            fenced[n] = Some(read_region(n));
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    for (n, before) in fenced.iter().enumerate() {
        if let Some(before) = before {
            assert!(read_region(n) == *before, "node {n}'s region changed after its last unpublish");
        }
    }
    let total: u64 = (0..NODES).map(|n| slots[n].lock().unwrap().1.len() as u64).sum();
    assert!(total > 0, "no write was acknowledged at all");
}
