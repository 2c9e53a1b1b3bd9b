//! Shared helpers for the integration tests: a `Server` guard around `ferrovol serve`,
//! the CLI, and the NBD peer tools (qemu-io, qemu-img, nbdinfo, nbdcopy, nbdsh, fio).
//!
//! Peer tools are real Debian programs; a missing one fails the test with the name of
//! the package to install (a skipped test would hide a broken CI machine).

#![allow(dead_code)]

pub mod certs;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_ferrovol");
pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * 1024 * 1024;

/// The system python3 (the one with Debian's libnbd binding `import nbd`).
pub const PYTHON: &str = "/usr/bin/python3";

/// Seconds any single peer command may run before it is killed (a hang is a failure).
pub const PEER_TIMEOUT_S: u64 = 120;

/// PATH for peer tools: Debian's /usr/bin first, so nbdsh finds the system python3.
pub fn peer_path() -> String {
    format!("/usr/bin:/bin:/usr/sbin:/sbin:{}", std::env::var("PATH").unwrap_or_default())
}

/// The Debian package that provides `tool`.
fn package_of(tool: &str) -> &'static str {
    match tool {
        "qemu-io" | "qemu-img" => "qemu-utils",
        "nbdinfo" | "nbdcopy" => "libnbd-bin",
        "nbdsh" => "python3-libnbd",
        "fio" => "fio",
        "nbdkit" => "nbdkit",
        "timeout" | "sha256sum" => "coreutils",
        "flock" => "util-linux",
        "bash" => "bash",
        _ => "(unknown package)",
    }
}

/// Panics unless `tool` is on the peer PATH, naming the Debian package to install.
pub fn require(tool: &str) {
    let found = peer_path().split(':').any(|d| !d.is_empty() && Path::new(d).join(tool).is_file());
    assert!(found, "required peer tool `{tool}` is not installed: apt-get install {}", package_of(tool));
    if tool == "nbdsh" {
        require_python_nbd();
    }
}

/// Panics unless /usr/bin/python3 can `import nbd`.
pub fn require_python_nbd() {
    let ok = Path::new(PYTHON).is_file()
        && Command::new(PYTHON)
            .args(["-c", "import nbd"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    assert!(ok, "{PYTHON} cannot `import nbd`: apt-get install python3-libnbd");
}

/// A command running peer `tool` under `timeout`, with /usr/bin first on PATH.
pub fn peer(tool: &str) -> Command {
    require(tool);
    let mut c = Command::new("timeout");
    c.args(["-k", "5", &PEER_TIMEOUT_S.to_string(), tool]).env("PATH", peer_path());
    c
}

/// Runs `cmd` and returns its output (stdout and stderr captured).
pub fn output(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// stdout followed by stderr, as text.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `ferrovol --data-dir DIR ARGS...`.
pub fn cli(dir: &Path, args: &[&str]) -> Output {
    output(Command::new(BIN).arg("--data-dir").arg(dir).args(args).env("FERROVOL_LOG", "warn"))
}

/// `ferrovol --data-dir DIR ARGS...`, which must succeed; returns stdout.
pub fn cli_ok(dir: &Path, args: &[&str]) -> String {
    let o = cli(dir, args);
    assert!(o.status.success(), "ferrovol {args:?} failed ({}): {}", o.status, text(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// `ferrovol --data-dir DIR ARGS...`, which must fail; returns stdout+stderr.
pub fn cli_err(dir: &Path, args: &[&str]) -> String {
    let o = cli(dir, args);
    assert!(!o.status.success(), "ferrovol {args:?} succeeded but must fail: {}", text(&o));
    text(&o)
}

/// `ferrovol check` on a stopped pool: must exit 0 and print "clean".
pub fn check_clean(dir: &Path) {
    let o = cli(dir, &["check"]);
    let t = text(&o);
    assert!(
        o.status.success() && t.lines().any(|l| l.trim() == "clean"),
        "ferrovol check is not clean ({}):\n{t}",
        o.status
    );
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// True if nobody holds an exclusive lock on `pool`, nor on `<pool>.creating` (where a
/// new pool is formatted), flock(1) getting a shared one. A missing file counts as
/// unlocked and is never created: flock(1) opens with O_CREAT, and a 0-byte `pool.img`
/// left by the check would be refused as corrupt by the next start.
pub fn pool_unlocked(pool: &Path) -> bool {
    require("flock");
    let mut creating = pool.as_os_str().to_owned();
    creating.push(".creating");
    [pool, Path::new(&creating)]
        .iter()
        .filter(|p| p.exists())
        .all(|p| output(Command::new("flock").args(["--nonblock", "--shared"]).arg(p).arg("true")).status.success())
}

/// Waits up to 10 s for the exclusive lock on `pool` to go away.
pub fn wait_pool_unlocked(pool: &Path) {
    let t = Instant::now();
    while !pool_unlocked(pool) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} still locked 10 s after the server was killed",
            pool.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

static LOGS: AtomicUsize = AtomicUsize::new(0);

/// A running `ferrovol serve`; killed (SIGKILL) when dropped.
pub struct Server {
    child: Option<Child>,
    pub dir: PathBuf,
    pub port: u16,
    pub log: PathBuf,
    pool_size: String,
    extra: Vec<String>,
    /// Where the server's stderr goes instead of the log file (`/dev/full`, a FIFO).
    pub stderr_to: Option<PathBuf>,
}

impl Server {
    /// Starts `ferrovol serve` on `dir` with a 2 GiB pool and waits until it serves.
    pub fn start(dir: &Path) -> Server {
        Server::start_with(dir, "2GiB", &[])
    }

    /// Starts `ferrovol serve --pool-size POOL_SIZE EXTRA...` on `dir` and waits until
    /// the management socket and the NBD TCP port accept connections.
    pub fn start_with(dir: &Path, pool_size: &str, extra: &[&str]) -> Server {
        let mut s = Server {
            child: None,
            dir: dir.to_owned(),
            port: 0,
            log: PathBuf::new(),
            pool_size: pool_size.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            stderr_to: None,
        };
        s.launch();
        s
    }

    /// [`Server::start_with`] with the server's stdout and stderr sent to `stderr_to`
    /// (readiness is still seen on its sockets).
    pub fn start_logging_to(dir: &Path, pool_size: &str, extra: &[&str], stderr_to: &Path) -> Server {
        let mut s = Server {
            child: None,
            dir: dir.to_owned(),
            port: 0,
            log: PathBuf::new(),
            pool_size: pool_size.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            stderr_to: Some(stderr_to.to_owned()),
        };
        s.launch();
        s
    }

    /// Starts the server again on the same data dir (after `stop` or `kill9`).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart of a running server");
        self.launch();
    }

    /// Starts the server again; Err(its log) if it exited instead of serving.
    pub fn try_restart(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "restart of a running server");
        self.try_launch()
    }

    fn launch(&mut self) {
        if let Err(log) = self.try_launch() {
            panic!("ferrovol serve exited before serving:\n{log}");
        }
    }

    fn try_launch(&mut self) -> Result<(), String> {
        for _attempt in 0..5 {
            let port = free_port();
            let n = LOGS.fetch_add(1, Ordering::SeqCst);
            let log = self.dir.with_file_name(format!(
                "{}-serve-{n}.log",
                self.dir.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
            ));
            let logf = match &self.stderr_to {
                Some(to) => std::fs::OpenOptions::new().write(true).open(to).unwrap(),
                None => std::fs::File::create(&log).unwrap(),
            };
            let mut child = Command::new(BIN)
                .arg("--data-dir")
                .arg(&self.dir)
                .args(["serve", "--pool-size", &self.pool_size, "--listen", &format!("127.0.0.1:{port}")])
                .args(&self.extra)
                .stdin(Stdio::null())
                .stdout(logf.try_clone().unwrap())
                .stderr(logf)
                .spawn()
                .expect("spawn ferrovol serve");
            let t = Instant::now();
            loop {
                if let Some(st) = child.try_wait().unwrap() {
                    let l = std::fs::read_to_string(&log).unwrap_or_default();
                    if l.contains("bind NBD") && l.contains("in use") {
                        break; // port taken meanwhile: try another
                    }
                    return Err(format!("(exit {st})\n{l}"));
                }
                if UnixStream::connect(self.dir.join("ferrovol.sock")).is_ok()
                    && TcpStream::connect(("127.0.0.1", port)).is_ok()
                {
                    self.child = Some(child);
                    self.port = port;
                    self.log = log;
                    return Ok(());
                }
                if t.elapsed() > Duration::from_secs(30) {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "ferrovol serve not ready after 30 s:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("could not find a free TCP port for ferrovol serve");
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// nbd://127.0.0.1:PORT/NAME
    pub fn uri(&self, name: &str) -> String {
        format!("nbd://127.0.0.1:{}/{name}", self.port)
    }

    /// nbd://127.0.0.1:PORT (no export name; for listing).
    pub fn base_uri(&self) -> String {
        format!("nbd://127.0.0.1:{}", self.port)
    }

    pub fn nbd_socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    /// nbd+unix:///NAME?socket=DIR/nbd.sock
    pub fn unix_uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.nbd_socket().display())
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        cli(&self.dir, args)
    }

    pub fn cli_ok(&self, args: &[&str]) -> String {
        cli_ok(&self.dir, args)
    }

    pub fn cli_err(&self, args: &[&str]) -> String {
        cli_err(&self.dir, args)
    }

    /// Creates volume `name` of `size` (e.g. "1GiB").
    pub fn create_volume(&self, name: &str, size: &str) {
        self.cli_ok(&["volume", "create", name, "--size", size]);
    }

    /// `pool status --json`.
    pub fn pool_status(&self) -> serde_json::Value {
        json(&self.cli_ok(&["pool", "status", "--json"]))
    }

    /// `volume list --json`.
    pub fn volumes(&self) -> serde_json::Value {
        json(&self.cli_ok(&["volume", "list", "--json"]))
    }

    /// True while the server process runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// The pool file: `--pool PATH` if given, else DIR/pool.img.
    pub fn pool_path(&self) -> PathBuf {
        match self.extra.iter().position(|a| a == "--pool") {
            Some(i) => PathBuf::from(&self.extra[i + 1]),
            None => self.dir.join("pool.img"),
        }
    }

    /// SIGKILL (no flush, no checkpoint), reap the process, and wait until its lock on
    /// the pool file is gone (the kernel may drop it a little after the process exits
    /// while I/O was in flight; see `restart_right_after_kill9` in persistence.rs).
    pub fn kill9(&mut self) {
        self.kill9_no_wait();
        wait_pool_unlocked(&self.pool_path());
    }

    /// SIGKILL and reap the process; returns as soon as the process is gone.
    pub fn kill9_no_wait(&mut self) {
        let mut c = self.child.take().expect("server is running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// SIGTERM and wait for a clean exit (status 0) within 30 s.
    pub fn stop(&mut self) {
        let st = self.terminate();
        assert!(st.success(), "ferrovol serve did not exit cleanly on SIGTERM ({st}):\n{}", self.log_text());
    }

    /// SIGTERM; returns the exit status (killed after 30 s).
    pub fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("server is running");
        let ok = Command::new("kill").args(["-TERM", &c.id().to_string()]).status().unwrap();
        assert!(ok.success(), "kill -TERM failed");
        let t = Instant::now();
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                return st;
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = c.kill();
                let _ = c.wait();
                panic!("ferrovol serve still running 30 s after SIGTERM:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            let l = self.log_text();
            let tail: Vec<&str> = l.lines().rev().take(40).collect();
            eprintln!("--- last lines of the server log {} ---", self.log.display());
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// A per-test temporary directory, with the data dir at `<tmp>/data`.
pub struct TestDir {
    pub tmp: tempfile::TempDir,
}

impl TestDir {
    pub fn new() -> TestDir {
        TestDir { tmp: tempfile::Builder::new().prefix("ferrovol-it-").tempdir().unwrap() }
    }
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }
    pub fn data(&self) -> PathBuf {
        self.tmp.path().join("data")
    }
}

/// Runs qemu-io (raw format) with the given commands on one connection.
pub fn qemu_io(uri: &str, cmds: &[&str]) -> Output {
    let mut c = peer("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri);
    output(&mut c)
}

/// True if a qemu-io run reported success: exit 0, and no line mentioning a failure.
pub fn qemu_io_succeeded(o: &Output) -> bool {
    let t = text(o).to_lowercase();
    o.status.success() && !t.contains("fail") && !t.contains("error") && !t.contains("pattern verification")
}

/// qemu-io commands that must all succeed (writes done, pattern reads verified).
pub fn qemu_io_ok(uri: &str, cmds: &[&str]) {
    let o = qemu_io(uri, cmds);
    assert!(qemu_io_succeeded(&o), "qemu-io {cmds:?} on {uri} failed ({}):\n{}", o.status, text(&o));
}

/// Runs a Python program with /usr/bin/python3 (libnbd binding available as `nbd`).
pub fn python(code: &str, args: &[&str]) -> Output {
    require_python_nbd();
    let mut c = Command::new("timeout");
    c.args(["-k", "5", &PEER_TIMEOUT_S.to_string(), PYTHON, "-c", code]).args(args).env("PATH", peer_path());
    output(&mut c)
}

/// A Python program that must exit 0; returns its stdout.
pub fn python_ok(code: &str, args: &[&str]) -> String {
    let o = python(code, args);
    assert!(o.status.success(), "python failed ({}):\n{}", o.status, text(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// `len` random bytes from /dev/urandom.
pub fn random_bytes(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut v).unwrap();
    v
}

/// SHA-256 of a file, hex (sha256sum).
pub fn sha256(path: &Path) -> String {
    let o = output(Command::new("sha256sum").arg(path));
    assert!(o.status.success(), "sha256sum {}: {}", path.display(), text(&o));
    String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap().to_owned()
}

/// A pseudo-random u64 in [0, n) (time and pid seeded; good enough for kill timing).
pub fn rand_below(n: u64) -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let mut x = t ^ (u64::from(std::process::id()) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x % n.max(1)
}

/// `GET /metrics` from a server started with `--metrics-listen 127.0.0.1:port`.
pub fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "scrape: {out}");
    out
}

/// The value of the sample `name` (with its labels, as printed), or None.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
