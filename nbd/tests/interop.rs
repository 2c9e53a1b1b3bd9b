//! Interoperability with real NBD clients: `nbdinfo` and `nbdsh` (libnbd) and `qemu-io`,
//! against `serve_tcp` on a loopback port. A tool that is not installed is skipped with a
//! printed message; a tool that is installed must succeed.

mod common;

use std::process::Output;
use std::sync::Arc;

use common::mem_export::{MemExport, MemRegistry};
use nbd::ServerConfig;
use tokio::net::TcpListener;
use tokio::process::Command;
use tokio::sync::oneshot;

const SIZE: u64 = 16 << 20;

/// Runs a tool; `None` when it is not installed.
async fn run(program: &str, args: &[&str], path_first: Option<&str>) -> Option<Output> {
    let mut cmd = Command::new(program);
    cmd.args(args).kill_on_drop(true);
    if let Some(dir) = path_first {
        let path = std::env::var("PATH").unwrap_or_default();
        cmd.env("PATH", format!("{dir}:{path}"));
    }
    let run = tokio::time::timeout(std::time::Duration::from_secs(60), cmd.output());
    match run.await.expect("tool finished within 60 s") {
        Ok(out) => Some(out),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("skipping {program}: not installed");
            None
        }
        Err(e) => panic!("running {program}: {e}"),
    }
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Lines of `nbdinfo --map`: (offset, length, type).
fn map_lines(out: &str) -> Vec<(u64, u64, u32)> {
    out.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}

const NBDSH_SCRIPT: &str = r#"
h.add_meta_context("base:allocation")
h.connect_uri(uri)
assert h.get_structured_replies_negotiated()
assert h.can_meta_context("base:allocation")
h.pwrite(b"\x11" * 8192, 1 << 20, nbd.CMD_FLAG_FUA)
assert h.pread(8192, 1 << 20) == b"\x11" * 8192
h.flush()
h.cache(65536, 0)
h.zero(4096, 2 << 20, nbd.CMD_FLAG_NO_HOLE)
h.trim(4096, 1 << 20)
seen = []
def cb(ctx, off, entries, err):
    seen.append((ctx, off, list(entries)))
h.block_status(8192, 1 << 20, cb, nbd.CMD_FLAG_REQ_ONE)
h.block_status(8192, 1 << 20, cb)
assert seen == [
    ("base:allocation", 1 << 20, [4096, 3]),
    ("base:allocation", 1 << 20, [4096, 3, 4096, 0]),
], seen
bufs = [nbd.Buffer(4096) for _ in range(64)]
for i in range(64):
    h.aio_pread(bufs[i], i * 4096)
while h.aio_in_flight() > 0:
    h.poll(-1)
try:
    h.zero(4096, 0, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE)
    raise AssertionError("fast zero without unmap should fail")
except nbd.Error as e:
    assert e.errno == "ENOTSUP", e.errno
h.shutdown()
print("nbdsh ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients() {
    let registry = Arc::new(MemRegistry::default().with("disk", MemExport::new(SIZE)));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = oneshot::channel::<()>();
    let server =
        tokio::spawn(nbd::serve_tcp(listener, Arc::clone(&registry), Arc::new(ServerConfig::default()), async move {
            let _ = stopped.await;
        }));
    let uri = format!("nbd://127.0.0.1:{port}/disk");

    if let Some(out) = run("nbdinfo", &["--json", &uri], None).await {
        let s = text(&out);
        assert!(out.status.success(), "{s}");
        for needle in [
            "\"export-size\": 16777216",
            "\"structured\": true",
            "\"base:allocation\"",
            "\"block_size_minimum\": 1",
            "\"block_size_preferred\": 4096",
            "\"block_size_maximum\": 1048576",
            "\"is_read_only\": false",
            "\"can_multi_conn\": true",
            "\"can_fast_zero\": true",
            "\"description\": \"in-memory test export\"",
        ] {
            assert!(s.contains(needle), "missing {needle} in {s}");
        }
        let list = run("nbdinfo", &["--list", "--json", &format!("nbd://127.0.0.1:{port}")], None).await.unwrap();
        assert!(list.status.success(), "{}", text(&list));
        assert!(text(&list).contains("\"export-name\": \"disk\""), "{}", text(&list));
    }

    if let Some(out) = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xab 4096 64k",
            "-c",
            "read -P 0xab 4096 64k",
            "-c",
            "read -P 0 0 4096",
            "-c",
            "read -P 0 69632 4096",
            &uri,
        ],
        None,
    )
    .await
    {
        let s = text(&out);
        assert!(out.status.success(), "{s}");
        assert!(s.contains("wrote 65536/65536 bytes at offset 4096"), "{s}");
        assert!(s.contains("read 65536/65536 bytes at offset 4096"), "{s}");
        assert!(!s.contains("Pattern verification failed"), "{s}");
        assert_eq!(registry.get("disk").snapshot(4096..4100), vec![0xab; 4]);
        // a wrong pattern is noticed, so the checks above are real
        let bad = run("qemu-io", &["-f", "raw", "-c", "read -P 0xac 4096 512", &uri], None).await.unwrap();
        assert!(text(&bad).contains("Pattern verification failed"), "{}", text(&bad));

        // block status through libnbd reflects the write
        if let Some(map) = run("nbdinfo", &["--map", &uri], None).await {
            let s = text(&map);
            assert!(map.status.success(), "{s}");
            assert_eq!(map_lines(&s), vec![(0, 4096, 3), (4096, 65536, 0), (69632, SIZE - 69632, 3)], "{s}");
        }
    }

    // nbdsh needs Python with the libnbd module; the system Python has it.
    let script = format!("uri = {uri:?}\n{NBDSH_SCRIPT}");
    if let Some(out) = run("nbdsh", &["-c", &script], Some("/usr/bin")).await {
        let s = text(&out);
        if s.contains("No module named") {
            println!("skipping nbdsh: libnbd Python module missing");
        } else {
            assert!(out.status.success(), "{s}");
            assert!(s.contains("nbdsh ok"), "{s}");
        }
    }

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
