//! Accept loops: `serve_tcp` and `serve_unix` serve several clients at once, a
//! misbehaving client does not disturb the others, and `shutdown` stops accepting.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use nbd::proto::*;
use nbd::ServerConfig;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::oneshot;

fn registry() -> Arc<MemRegistry> {
    Arc::new(MemRegistry::default().with("disk", MemExport::new(1 << 20)))
}

/// Writes and reads back a few bytes on an open session.
async fn round_trip<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(s: &mut S, seed: u8) {
    let data = [seed; 64];
    send_write(s, 0, 1, u64::from(seed) * 64, &data).await;
    assert_eq!(simple_reply(s, 1, 0).await.0, 0);
    send_request(s, Command::Read, 0, 2, u64::from(seed) * 64, 64).await;
    assert_eq!(simple_reply(s, 2, 64).await, (0, data.to_vec()));
}

#[tokio::test]
async fn tcp_clients_are_isolated_and_shutdown_stops_accepting() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(nbd::serve_tcp(listener, registry(), Arc::new(ServerConfig::default()), async move {
        let _ = stopped.await;
    }));

    let mut good = TcpStream::connect(addr).await.unwrap();
    connect(&mut good, "disk", false, false).await;
    round_trip(&mut good, 1).await;

    // a client that sends garbage in transmission, one that sends garbage in the
    // handshake, and one that connects and vanishes
    let mut bad = TcpStream::connect(addr).await.unwrap();
    connect(&mut bad, "disk", false, false).await;
    bad.write_all(&[0xff; 64]).await.unwrap();
    expect_closed(&mut bad).await;
    let mut rude = TcpStream::connect(addr).await.unwrap();
    greet(&mut rude, 0xffff_ffff).await;
    expect_closed(&mut rude).await;
    drop(TcpStream::connect(addr).await.unwrap());

    // the good client is unaffected, and a new one can still join
    round_trip(&mut good, 2).await;
    let mut late = TcpStream::connect(addr).await.unwrap();
    connect(&mut late, "disk", true, false).await;
    send_request(&mut late, Command::Read, 0, 5, 64, 64).await;
    let (data, _) = assemble_read(&structured_reply(&mut late, 5).await, 64, 64);
    assert_eq!(data, vec![1; 64]);

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap().unwrap();
    // accepted connections outlive the accept loop
    round_trip(&mut good, 3).await;
    // but nobody new is accepted
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn unix_socket() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let dir = std::env::temp_dir().join(format!("nbd-test-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(nbd::serve_unix(listener, registry(), Arc::new(ServerConfig::default()), async move {
        let _ = stopped.await;
    }));

    let mut a = UnixStream::connect(&path).await.unwrap();
    let mut b = UnixStream::connect(&path).await.unwrap();
    connect(&mut a, "disk", false, false).await;
    connect(&mut b, "disk", true, true).await;
    round_trip(&mut a, 4).await;
    send_request(&mut b, Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 9, 0, 4096).await;
    let chunks = structured_reply(&mut b, 9).await;
    assert_eq!(chunks[0].0.chunk_type, NBD_REPLY_TYPE_BLOCK_STATUS);
    // the write of `a` landed in block 0
    assert_eq!(&chunks[0].1[4..], &[0, 0, 0x10, 0, 0, 0, 0, 0]);
    send_request(&mut a, Command::Disc, 0, 0, 0, 0).await;
    expect_closed(&mut a).await;

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap().unwrap();
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `Server::shut_down` is a soft disconnect: a connection keeps working until then;
/// afterwards a WRITE (its payload read and dropped) and a READ each get NBD_ESHUTDOWN
/// on a connection that stays in step, and the server closes the connection once the
/// grace period has passed.
#[tokio::test]
async fn shut_down_answers_eshutdown_then_closes() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig {
        shutdown_grace: Duration::from_millis(500),
        soft_disconnect: nbd::SoftDisconnect::Eshutdown,
        ..Default::default()
    };
    let server = nbd::Server::new(registry(), config);
    tokio::spawn(server.clone().serve_tcp(listener, std::future::pending::<()>()));
    let mut c = TcpStream::connect(addr).await.unwrap();
    connect(&mut c, "disk", false, false).await;
    round_trip(&mut c, 1).await;

    server.shut_down();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    send_write(&mut c, 0, 7, 0, &[9; 4096]).await;
    assert_eq!(simple_reply(&mut c, 7, 0).await.0, 108, "WRITE after shutdown: NBD_ESHUTDOWN");
    send_request(&mut c, Command::Read, 0, 8, 0, 64).await;
    assert_eq!(simple_reply(&mut c, 8, 0).await.0, 108, "READ after shutdown: NBD_ESHUTDOWN");
    expect_closed(&mut c).await;
    assert!(started.elapsed() >= Duration::from_millis(300), "closed before the grace period");
    for _ in 0..100 {
        if server.connections() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the closed connection is still counted");
}

/// The default soft disconnect closes: after `Server::shut_down` a request is neither
/// run nor answered (a reconnecting client sends it again elsewhere) and the connection
/// closes at once, well before a long grace period; earlier writes stay.
#[tokio::test]
async fn shut_down_closes_without_running_new_requests() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig { shutdown_grace: Duration::from_secs(30), ..Default::default() };
    let registry = registry();
    let server = nbd::Server::new(registry.clone(), config);
    tokio::spawn(server.clone().serve_tcp(listener, std::future::pending::<()>()));
    let mut c = TcpStream::connect(addr).await.unwrap();
    connect(&mut c, "disk", false, false).await;
    round_trip(&mut c, 1).await;

    server.shut_down();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    // The server may close before or after the WRITE is sent.
    let mut w = Request { flags: 0, command: Command::Write, handle: 7, offset: 4096, length: 4096 }.encode().to_vec();
    w.extend_from_slice(&[9; 4096]);
    let _ = c.write_all(&w).await;
    expect_closed(&mut c).await;
    assert!(started.elapsed() < Duration::from_secs(5), "not closed at once");
    let disk = registry.get("disk");
    assert_eq!(disk.snapshot(4096..8192), vec![0; 4096], "a WRITE sent after the shutdown ran");
    assert_eq!(disk.snapshot(64..128), vec![1; 64], "the write before the shutdown is gone");
}

/// Starts a current-thread runtime on a thread named `name`; returns its handle and the
/// sender that stops it.
fn runtime_thread(name: &str) -> (tokio::runtime::Handle, oneshot::Sender<()>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let handle = rt.handle().clone();
    let (stop, stopped) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            rt.block_on(async {
                let _ = stopped.await;
            })
        })
        .unwrap();
    (handle, stop)
}

#[tokio::test]
async fn connections_are_placed_on_the_runtime_serving_the_fewest() {
    // Each read records the thread it runs on, at its offset / 64.
    let seen: Arc<std::sync::Mutex<Vec<(u64, String)>>> = Arc::default();
    let s = seen.clone();
    let export = MemExport::new(1 << 20).with_read_delay(move |offset| {
        let name = std::thread::current().name().unwrap_or("?").to_owned();
        s.lock().unwrap().push((offset / 64, name));
        Duration::ZERO
    });
    let registry = Arc::new(MemRegistry::default().with("disk", export));
    let (a, stop_a) = runtime_thread("dp-a");
    let (b, stop_b) = runtime_thread("dp-b");
    let server = nbd::Server::new_on(registry, ServerConfig::default(), vec![a, b]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let accept = tokio::spawn(server.clone().serve_tcp(listener, async move {
        let _ = stopped.await;
    }));

    // Four clients, each connected (and so placed) before the next: they alternate.
    let mut clients = Vec::new();
    for i in 0..4u8 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        connect(&mut c, "disk", false, false).await;
        round_trip(&mut c, i).await;
        clients.push(c);
    }
    let threads = |seen: &[(u64, String)]| {
        (0..4).map(|i| seen.iter().find(|(s, _)| *s == i).unwrap().1.clone()).collect::<Vec<_>>()
    };
    assert_eq!(threads(&seen.lock().unwrap()), ["dp-a", "dp-b", "dp-a", "dp-b"]);

    // Two of dp-a's clients leave: the next two go to dp-a, which now serves fewer.
    drop(clients.remove(2));
    drop(clients.remove(0));
    while server.connections() > 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seen.lock().unwrap().clear();
    for i in 0..2u8 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        connect(&mut c, "disk", false, false).await;
        round_trip(&mut c, i).await;
        clients.push(c);
    }
    let seen = seen.lock().unwrap().clone();
    assert!(seen.iter().all(|(_, t)| t == "dp-a"), "{seen:?}");
    // Clients on both runtimes still work.
    for (i, c) in clients.iter_mut().enumerate() {
        round_trip(c, 10 + i as u8).await;
    }
    stop.send(()).unwrap();
    accept.await.unwrap().unwrap();
    drop(clients);
    let _ = (stop_a.send(()), stop_b.send(()));
}
