//! The Linux kernel's NBD client against ferrovol, in a VM booted by
//! ../shared/tools/nbd-vm: ext4 on /dev/nbd0, files written and checksummed, e2fsck
//! clean; then the server is killed with SIGKILL and restarted, and a second VM
//! reconnects with two connections, finds the file system clean and every checksum
//! intact, and fstrim gives the space of a deleted file back to the pool.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovol");

fn nbd_vm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/nbd-vm/run.sh")
}

fn guest(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kernel").join(name)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(dir: &Path, port: u16) -> Child {
    start_with(dir, port, &[])
}

/// `ferrovol serve` on `dir` with a 4 GiB pool, NBD on `port`, and `extra` flags;
/// returns once it serves.
fn start_with(dir: &Path, port: u16, extra: &[&str]) -> Child {
    let child = Command::new(BIN)
        .args([
            "--data-dir",
            dir.to_str().unwrap(),
            "serve",
            "--pool-size",
            "4GiB",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !(dir.join("ferrovol.sock").exists() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()) {
        assert!(t.elapsed() < Duration::from_secs(30), "server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn cli(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN).arg("--data-dir").arg(dir).args(args).output().unwrap();
    assert!(out.status.success(), "ferrovol {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn allocated(dir: &Path) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&cli(dir, &["volume", "info", "kvol", "--json"])).unwrap();
    v["allocated_bytes"].as_u64().unwrap()
}

/// A running server on a fresh data dir with volume `kvol` of `size`, and the folder
/// shared with the guest. Drop order keeps the temp dir until the end of the test.
struct Setup {
    dir: PathBuf,
    share: PathBuf,
    port: u16,
    server: Child,
    _tmp: tempfile::TempDir,
}

fn setup(size: &str) -> Setup {
    assert!(
        nbd_vm().exists(),
        "{} is missing: the tests need the shared nbd-vm tool (and `bash ../shared/tools/nbd-vm/setup.sh`)",
        nbd_vm().display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let share = tmp.path().join("share");
    std::fs::create_dir_all(&share).unwrap();
    let port = free_port();
    let server = start(&dir, port);
    cli(&dir, &["volume", "create", "kvol", "--size", size]);
    Setup { dir, share, port, server, _tmp: tmp }
}

fn run_guest(script: &str, port: u16, share: &Path) {
    run_guest_env(script, share, &[format!("PORT={port}"), "EXPORT=kvol".into()]);
}

#[test]
fn kernel_client_ext4_survives_sigkill_and_trims() {
    let Setup { dir, share, port, mut server, _tmp } = setup("512MiB");
    run_guest("guest-write.sh", port, &share);
    let written = allocated(&dir);
    assert!(written >= 24 << 20, "24 MiB file written but only {written} bytes allocated");

    server.kill().unwrap(); // SIGKILL: no final checkpoint; the log must carry everything flushed
    server.wait().unwrap();
    let out = Command::new(BIN).arg("--data-dir").arg(&dir).arg("check").output().unwrap();
    assert!(out.status.success(), "check after SIGKILL: {}", String::from_utf8_lossy(&out.stdout));

    let mut server = start(&dir, port);
    run_guest("guest-verify.sh", port, &share);
    let after = allocated(&dir);
    assert!(after + (16 << 20) <= written, "fstrim of a 24 MiB file freed too little: {written} -> {after} bytes");
    Command::new("kill").arg("-TERM").arg(server.id().to_string()).status().unwrap();
    assert!(server.wait().unwrap().success(), "clean shutdown");
    let out = Command::new(BIN).arg("--data-dir").arg(&dir).arg("check").output().unwrap();
    assert!(out.status.success(), "check after shutdown: {}", String::from_utf8_lossy(&out.stdout));
}

/// Runs `script` in a fresh VM. A VM whose guest kernel died before it reached init
/// (exit 125 and no `guest-uptime-at-init` figure: seen once as an int3 Oops while
/// the emulated CPUs patched kernel text during boot) never ran the script, so that
/// boot is retried, at most twice; a VM that dies once the script has started fails.
fn run_guest_env(script: &str, share: &Path, env: &[String]) {
    run_guest_with(script, share, env, &[]);
}

/// [`run_guest_env`] with more arguments for run.sh (`-f HOST:GUEST` files, `-m`).
fn run_guest_with(script: &str, share: &Path, env: &[String], extra: &[String]) {
    for attempt in 1..=3 {
        let mut c = Command::new("bash");
        c.arg(nbd_vm()).args(["-t", "900", "-s", share.to_str().unwrap()]).args(extra);
        for e in env {
            c.args(["-e", e]);
        }
        let out = c.arg(guest(script)).output().unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprint!("{stderr}");
        let died_in_boot = out.status.code() == Some(125) && stderr.contains("guest-uptime-at-init=?s");
        if died_in_boot && attempt < 3 {
            eprintln!("guest kernel died before init (attempt {attempt}); booting again");
            continue;
        }
        assert!(
            out.status.success(),
            "guest script {script} {env:?} failed with {} (see the console output above)",
            out.status
        );
        return;
    }
}

/// `ferrovol nbd attach` in the guest, through the kernel's generic netlink interface
/// (no nbd-client; the module loads on demand): a volume attached, formatted, written, listed with its backend identifier, detached; attached
/// again with two connections on the device asked for, its file intact and e2fsck clean;
/// a device in use and a missing export refused; nothing left attached.
#[test]
fn ferrovol_nbd_attach_uses_the_kernels_netlink_interface() {
    let Setup { dir, share, port, mut server, _tmp } = setup("256MiB");
    // The binary without its debug info travels into the guest's RAM.
    let bin = dir.with_file_name("ferrovol");
    let st = Command::new("objcopy").args(["--strip-debug", BIN, bin.to_str().unwrap()]).status().unwrap();
    assert!(st.success(), "objcopy --strip-debug");
    run_guest_with(
        "guest-attach.sh",
        &share,
        &[format!("PORT={port}")],
        &["-f".into(), format!("{}:/usr/bin/ferrovol", bin.display())],
    );
    server.kill().unwrap();
    server.wait().unwrap();
}

/// ext4 on a volume, snapshot, more writes; the snapshot exported read-only passes
/// e2fsck -fn, mounts read-only with the old files intact and none of the new ones,
/// and the kernel cannot write to it.
#[test]
fn kernel_client_mounts_a_snapshot_read_only() {
    let Setup { dir, share, port, mut server, _tmp } = setup("256MiB");
    let env = |phase: &str| {
        vec![format!("PORT={port}"), "EXPORT=kvol".into(), "SNAPSHOT=kvol@snap".into(), format!("PHASE={phase}")]
    };
    run_guest_env("guest-snapshot.sh", &share, &env("write"));
    cli(&dir, &["snapshot", "create", "kvol", "snap"]);
    run_guest_env("guest-snapshot.sh", &share, &env("change"));
    run_guest_env("guest-snapshot.sh", &share, &env("verify"));
    Command::new("kill").arg("-TERM").arg(server.id().to_string()).status().unwrap();
    assert!(server.wait().unwrap().success(), "clean shutdown");
    let out = Command::new(BIN).arg("--data-dir").arg(&dir).arg("check").output().unwrap();
    assert!(out.status.success(), "check: {}", String::from_utf8_lossy(&out.stdout));
}

/// The kernel client opens a volume by its attachment's export name (VOLUME/KEY) on a
/// server that serves TCP clients only so; unpublish cuts it off: a write after it
/// fails, the old key is refused, and what was written before is on the volume while
/// nothing of the later write is.
#[test]
fn kernel_client_attaches_with_its_key_and_is_cut_off_by_unpublish() {
    assert!(nbd_vm().exists(), "{} is missing", nbd_vm().display());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let share = tmp.path().join("share");
    std::fs::create_dir_all(&share).unwrap();
    let port = free_port();
    let mut server = start_with(&dir, port, &["--nbd-access", "attached"]);
    cli(&dir, &["volume", "create", "kvol", "--size", "64MiB"]);
    let a: serde_json::Value =
        serde_json::from_str(&cli(&dir, &["volume", "publish", "kvol", "--node", "vm-node", "--json"])).unwrap();
    let export = a["export_name"].as_str().unwrap().to_owned();
    let mut vm = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "900", "-s", share.to_str().unwrap()])
        .args(["-e", &format!("PORT={port}"), "-e", &format!("EXPORT={export}")])
        .arg(guest("guest-fence.sh"))
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !share.join("written").exists() {
        if let Some(st) = vm.try_wait().unwrap() {
            panic!("the guest ended ({st}) before it wrote");
        }
        assert!(t.elapsed() < Duration::from_secs(600), "the guest did not write");
        std::thread::sleep(Duration::from_millis(200));
    }
    cli(&dir, &["volume", "unpublish", "kvol", "--node", "vm-node"]);
    std::fs::write(share.join("unpublished"), b"").unwrap();
    assert!(vm.wait().unwrap().success(), "guest-fence.sh failed (see its output above)");
    // What the guest wrote before is there; nothing of the write after.
    let img = tmp.path().join("kvol.img");
    let sock = dir.join("nbd.sock");
    let out = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(format!("nbd+unix:///kvol?socket={}", sock.display()))
        .arg(&img)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img convert: {}", String::from_utf8_lossy(&out.stderr));
    let data = std::fs::read(&img).unwrap();
    let before = std::fs::read(share.join("a")).unwrap();
    assert_eq!(&data[..1 << 20], &before[..], "the write made before unpublish is not on the volume");
    assert!(data[1 << 20..2 << 20].iter().all(|&b| b == 0), "a write after unpublish reached the volume");
    Command::new("kill").arg("-TERM").arg(server.id().to_string()).status().unwrap();
    assert!(server.wait().unwrap().success(), "clean shutdown");
}

/// A TCP proxy on the host between the guest and the server, whose connections can be
/// cut at once (a network cut, as the kernel client sees it).
struct Proxy {
    port: u16,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(to: u16) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Default::default();
        let c = conns.clone();
        std::thread::spawn(move || {
            for client in l.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", to)) else { continue };
                let mut held = c.lock().unwrap();
                held.push(client.try_clone().unwrap());
                held.push(server.try_clone().unwrap());
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server.try_clone().unwrap(), client.try_clone().unwrap()),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, conns }
    }

    /// Closes every connection made so far.
    fn cut(&self) {
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Waits for the guest's file `name` in `share`, or fails if the guest ended.
fn wait_guest(vm: &mut Child, share: &Path, name: &str) {
    let t = Instant::now();
    while !share.join(name).exists() {
        if let Some(st) = vm.try_wait().unwrap() {
            panic!("the guest ended ({st}) before step {name}");
        }
        assert!(t.elapsed() < Duration::from_secs(900), "the guest never reached step {name}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `ferrovol nbd watch` keeps a mounted volume going through a network cut (the proxy
/// closes every connection), a clean restart of the server and a restart of the watcher
/// itself, with no I/O error and every fsynced file intact; `nbd resize` shows a grown
/// volume to the mounted file system; the kernel refuses a reconnect to another volume;
/// after a SIGKILL of the server (a new crash generation) the device is fenced rather
/// than reconnected; with a short dead timeout and the server gone, I/O fails cleanly
/// and the device is listed as reconnecting. The volume is opened with its key
/// (`--nbd-access attached`), refused without it. Script: tests/kernel/guest-reconnect.sh.
#[test]
fn ferrovol_nbd_watch_reconnects_within_a_crash_generation_and_fences_across() {
    assert!(nbd_vm().exists(), "{} is missing", nbd_vm().display());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let share = tmp.path().join("share");
    std::fs::create_dir_all(&share).unwrap();
    let port = free_port();
    let attached = ["--nbd-access", "attached"];
    let mut server = start_with(&dir, port, &attached);
    cli(&dir, &["volume", "create", "kvol", "--size", "256MiB"]);
    // Larger than kvol will grow to: the kernel, not a size check, refuses the reconnect.
    cli(&dir, &["volume", "create", "other", "--size", "512MiB"]);
    let a: serde_json::Value =
        serde_json::from_str(&cli(&dir, &["volume", "publish", "kvol", "--node", "vm-node", "--json"])).unwrap();
    let export = a["export_name"].as_str().unwrap().to_owned();
    let b: serde_json::Value =
        serde_json::from_str(&cli(&dir, &["volume", "publish", "other", "--node", "vm-node", "--json"])).unwrap();
    let other = b["export_name"].as_str().unwrap().to_owned();
    let proxy = Proxy::start(port);
    let bin = dir.with_file_name("ferrovol");
    let st = Command::new("objcopy").args(["--strip-debug", BIN, bin.to_str().unwrap()]).status().unwrap();
    assert!(st.success(), "objcopy --strip-debug");
    let mut vm = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "1200", "-s", share.to_str().unwrap()])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .args(["-e", &format!("PORT={}", proxy.port), "-e", &format!("EXPORT={export}")])
        .args(["-e", &format!("OTHER={other}")])
        .arg(guest("guest-reconnect.sh"))
        .spawn()
        .unwrap();
    let done = |name: &str| std::fs::write(share.join(name), b"").unwrap();
    let term = |server: &mut Child| {
        Command::new("kill").arg("-TERM").arg(server.id().to_string()).status().unwrap();
        assert!(server.wait().unwrap().success(), "clean shutdown");
    };

    wait_guest(&mut vm, &share, "cut");
    proxy.cut();
    done("cut-done");

    wait_guest(&mut vm, &share, "restart");
    term(&mut server);
    let mut server = start_with(&dir, port, &attached);
    done("restart-done");

    wait_guest(&mut vm, &share, "grow");
    cli(&dir, &["volume", "resize", "kvol", "--size", "384MiB"]);
    done("grow-done");

    wait_guest(&mut vm, &share, "kill");
    server.kill().unwrap();
    server.wait().unwrap();
    let mut server = start_with(&dir, port, &attached);
    done("kill-done");

    wait_guest(&mut vm, &share, "down");
    server.kill().unwrap();
    server.wait().unwrap();
    done("down-done");

    let st = vm.wait().unwrap();
    assert!(st.success(), "guest-reconnect.sh failed with {st} (see its output above)");
    let out = Command::new(BIN).arg("--data-dir").arg(&dir).arg("check").output().unwrap();
    assert!(out.status.success(), "check: {}", String::from_utf8_lossy(&out.stdout));
}
