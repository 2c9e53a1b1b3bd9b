//! Limits against abusive clients: the cap on connections in all and per export, the
//! idle timeout, the server-wide payload budget and the stall timeout. Each test also
//! checks that a well-behaved client is not disturbed.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use nbd::proto::*;
use nbd::{Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn registry() -> Arc<MemRegistry> {
    Arc::new(MemRegistry::default().with("a", MemExport::new(1 << 20)).with("b", MemExport::new(1 << 20)))
}

async fn start(config: ServerConfig) -> (std::net::SocketAddr, Arc<Server<MemRegistry>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::new(registry(), config);
    tokio::spawn(server.clone().serve_tcp(listener, std::future::pending::<()>()));
    (addr, server)
}

async fn read_works(s: &mut TcpStream, handle: u64) {
    send_request(s, Command::Read, 0, handle, 0, 512).await;
    assert_eq!(simple_reply(s, handle, 512).await.0, 0, "read on a connection within the limits");
}

/// Sends NBD_OPT_GO for `name`; returns the final reply type.
async fn go(s: &mut TcpStream, name: &str) -> u32 {
    greet(s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    let req = InfoRequest { name: name.into(), requests: vec![] };
    send_option(s, NBD_OPT_GO, &req.encode()).await;
    read_option_replies(s).await.last().unwrap().0.reply_type
}

async fn wait_for_connections(server: &Server<MemRegistry>, n: usize) {
    for _ in 0..500 {
        if server.connections() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("server counts {} connections, expected {n}", server.connections());
}

#[tokio::test]
async fn per_export_cap_refuses_go_with_policy_and_frees_on_disconnect() {
    let (addr, server) = start(ServerConfig { max_connections_per_export: 2, ..Default::default() }).await;
    let mut c1 = TcpStream::connect(addr).await.unwrap();
    connect(&mut c1, "a", false, false).await;
    let mut c2 = TcpStream::connect(addr).await.unwrap();
    connect(&mut c2, "a", false, false).await;

    // A third GO to "a" is refused by policy; the connection stays in haggling and can
    // pick another export instead.
    let mut c3 = TcpStream::connect(addr).await.unwrap();
    assert_eq!(go(&mut c3, "a").await, NBD_REP_ERR_POLICY);
    let req = InfoRequest { name: "b".into(), requests: vec![] };
    send_option(&mut c3, NBD_OPT_GO, &req.encode()).await;
    assert_eq!(read_option_replies(&mut c3).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    read_works(&mut c3, 1).await;

    // NBD_OPT_EXPORT_NAME cannot be refused with a reply: the server closes.
    let mut c4 = TcpStream::connect(addr).await.unwrap();
    greet(&mut c4, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    send_option(&mut c4, NBD_OPT_EXPORT_NAME, b"a").await;
    expect_closed(&mut c4).await;

    read_works(&mut c1, 2).await;
    // When one leaves, a new client gets in.
    send_request(&mut c2, Command::Disc, 0, 3, 0, 0).await;
    expect_closed(&mut c2).await;
    wait_for_connections(&server, 2).await;
    let mut c5 = TcpStream::connect(addr).await.unwrap();
    assert_eq!(go(&mut c5, "a").await, NBD_REP_ACK);
    read_works(&mut c5, 4).await;
}

#[tokio::test]
async fn total_cap_closes_extra_clients_at_once() {
    let (addr, server) = start(ServerConfig { max_connections: 2, ..Default::default() }).await;
    let mut c1 = TcpStream::connect(addr).await.unwrap();
    connect(&mut c1, "a", false, false).await;
    // A client still in the handshake counts too.
    let mut c2 = TcpStream::connect(addr).await.unwrap();
    let mut greeting = [0u8; GREETING_LEN];
    c2.read_exact(&mut greeting).await.unwrap();
    wait_for_connections(&server, 2).await;

    let mut c3 = TcpStream::connect(addr).await.unwrap();
    expect_closed(&mut c3).await;
    read_works(&mut c1, 1).await;

    drop(c2);
    wait_for_connections(&server, 1).await;
    let mut c4 = TcpStream::connect(addr).await.unwrap();
    connect(&mut c4, "b", false, false).await;
    read_works(&mut c4, 2).await;
}

#[tokio::test]
async fn idle_connections_are_closed_busy_ones_are_not() {
    let idle = Duration::from_millis(600);
    let (addr, server) = start(ServerConfig { idle_timeout: Some(idle), ..Default::default() }).await;
    let mut quiet = TcpStream::connect(addr).await.unwrap();
    connect(&mut quiet, "a", false, false).await;
    let mut busy = TcpStream::connect(addr).await.unwrap();
    connect(&mut busy, "b", false, false).await;
    // The busy client sends a request every 100 ms for 1.8 s (three idle periods).
    for h in 0..18 {
        read_works(&mut busy, h).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    expect_closed(&mut quiet).await;
    read_works(&mut busy, 100).await;
    wait_for_connections(&server, 1).await;
}

#[tokio::test]
async fn without_an_idle_timeout_idle_connections_stay() {
    let (addr, server) = start(ServerConfig::default()).await;
    let mut c = TcpStream::connect(addr).await.unwrap();
    connect(&mut c, "a", false, false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.connections(), 1);
    read_works(&mut c, 1).await;
}

const MIB: u32 = 1 << 20;

/// A server whose export "big" is 64 MiB with READs and WRITEs of up to 16 MiB: its
/// first 16 MiB filled with a pattern that [`read_big`] checks, the rest every other
/// 4 KiB block written (so that its block status is 12,288 extents).
async fn start_big(config: ServerConfig) -> std::net::SocketAddr {
    start_big_server(config).await.0
}

/// [`start_big`], also returning the server and its exports.
async fn start_big_server(config: ServerConfig) -> (std::net::SocketAddr, Arc<Server<MemRegistry>>, Arc<MemRegistry>) {
    let mut big = MemExport::new(64 << 20);
    big.sizes.maximum = 16 * MIB;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let registry = Arc::new(MemRegistry::default().with("big", big));
    let server = Server::new(registry.clone(), config);
    tokio::spawn(server.clone().serve_tcp(listener, std::future::pending::<()>()));
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap(); // each WRITE's header and payload go out at once
    connect(&mut s, "big", false, false).await;
    for i in 0..16u64 {
        let offset = i * u64::from(MIB);
        let data: Vec<u8> = (0..u64::from(MIB)).map(|k| pattern(offset + k)).collect();
        send_write(&mut s, 0, i, offset, &data).await;
        assert_eq!(simple_reply(&mut s, i, 0).await.0, 0);
    }
    for (i, offset) in (16u64 << 20..64 << 20).step_by(8192).enumerate() {
        send_write(&mut s, 0, i as u64, offset, &[1; 4096]).await;
        assert_eq!(simple_reply(&mut s, i as u64, 0).await.0, 0);
    }
    (addr, server, registry)
}

/// The byte at `offset` of "big" (in its first 16 MiB).
fn pattern(offset: u64) -> u8 {
    (offset % u64::from(MIB)) as u8 ^ (offset / u64::from(MIB)) as u8 ^ (offset >> 12) as u8
}

/// A connection to "big" with a small receive buffer, so that replies it does not read
/// back up into the server soon.
async fn small_window(addr: std::net::SocketAddr, structured: bool) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    connect(&mut s, "big", structured, structured).await;
    s
}

/// A connection to "big" that sends `reads` READs of 4 MiB and never reads a reply.
async fn stalled_reader(addr: std::net::SocketAddr, reads: u64) -> TcpStream {
    let mut s = small_window(addr, false).await;
    for h in 0..reads {
        send_request(&mut s, Command::Read, 0, h, 0, 4 * MIB).await;
    }
    s
}

/// Reads `len` bytes at `offset` of "big" on `s` and checks them.
async fn read_big(s: &mut TcpStream, handle: u64, offset: u64, len: u32) {
    send_request(s, Command::Read, 0, handle, offset, len).await;
    let (error, data) = simple_reply(s, handle, len as usize).await;
    assert_eq!(error, 0);
    assert!(data.iter().enumerate().all(|(k, &b)| b == pattern(offset + k as u64)), "data of read {handle}");
}

/// A 4 MiB READ (more than a connection's unmetered allowance) on a new connection,
/// answered and checked on a task of its own.
async fn large_read(addr: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    let mut large = TcpStream::connect(addr).await.unwrap();
    connect(&mut large, "big", false, false).await;
    tokio::spawn(async move { read_big(&mut large, 3, 7 << 20, 4 * MIB).await })
}

/// Asserts that `waiting` is still waiting after half a second, then, once `release`
/// has run, that it finishes within 10 s.
async fn waits_until(waiting: tokio::task::JoinHandle<()>, what: &str, release: impl FnOnce()) {
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "{what}: a 4 MiB READ must wait for the server-wide budget");
    release();
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap_or_else(|_| panic!("{what}: the waiting READ is answered once the budget is free"))
        .unwrap();
}

#[tokio::test]
async fn a_client_holding_the_server_budget_slows_others_but_cannot_stop_them() {
    // One client sends 4 MiB READs and reads no reply: its replies hold the whole 8 MiB
    // server-wide budget. Another client's 4 MiB READ waits for it; a client with
    // READs of up to 2 MiB in flight in all still gets them answered, four at a time
    // too; and when the stalled client goes, the waiting READ is answered.
    let config = ServerConfig { max_total_in_flight_bytes: 8 << 20, ..Default::default() };
    let addr = start_big(config).await;
    let stalled = stalled_reader(addr, 32).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut small = TcpStream::connect(addr).await.unwrap();
    connect(&mut small, "big", false, false).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        read_big(&mut small, 1, 3 << 20, 2 * MIB).await;
        read_big(&mut small, 2, 5 << 20, 4096).await;
        for h in 0..4u64 {
            send_request(&mut small, Command::Read, 0, 10 + h, h << 20, 256 << 10).await;
        }
        let lens = (0..4u64).map(|h| (10 + h, 256 << 10)).collect();
        for _ in 0..4 {
            match read_msg(&mut small, &lens).await {
                Msg::Simple { error: 0, handle, data } => {
                    let offset = (handle - 10) << 20;
                    assert!(data.iter().enumerate().all(|(k, &b)| b == pattern(offset + k as u64)));
                }
                other => panic!("{other:?}"),
            }
        }
    })
    .await
    .expect("READs of up to 2 MiB in flight are answered while the server budget is held");

    let waiting = large_read(addr).await;
    waits_until(waiting, "stalled reader", || drop(stalled)).await;
}

#[tokio::test]
async fn write_headers_without_payload_hold_only_one_chunk_each() {
    // Clients that send the header of a 4 MiB WRITE and no payload are charged only the
    // first 256 KiB piece of it (the piece the server waits to read), from their own
    // unmetered allowance: eight of them leave the 8 MiB server budget free.
    let config = ServerConfig { max_total_in_flight_bytes: 8 << 20, ..Default::default() };
    let addr = start_big(config).await;
    let mut headers = Vec::new();
    for h in 0..8 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        connect(&mut c, "big", false, false).await;
        send_request(&mut c, Command::Write, 0, h, 0, 4 * MIB).await;
        headers.push(c);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let read = large_read(addr).await;
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("a 4 MiB READ beside eight payload-less WRITE headers")
        .unwrap();
}

#[tokio::test]
async fn block_status_replies_count_against_the_server_budget() {
    // Block status replies over a fragmented range hold up to 512 KiB each: a client
    // that sends many and reads none holds the server's budget as READ data would.
    let config = ServerConfig { max_total_in_flight_bytes: 4 << 20, ..Default::default() };
    let addr = start_big(config).await;
    let mut stalled = small_window(addr, true).await;
    for h in 0..128 {
        send_request(&mut stalled, Command::BlockStatus, 0, h, 16 << 20, 48 * MIB).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = large_read(addr).await;
    waits_until(waiting, "block status", || drop(stalled)).await;
}

#[tokio::test]
async fn a_small_connection_budget_does_not_shrink_the_server_charge() {
    // With a 1 MiB budget per connection a 4 MiB READ still holds 4 MiB of the server's
    // budget: four stalled connections with one each fill the 8 MiB.
    let config =
        ServerConfig { max_in_flight_bytes: 1 << 20, max_total_in_flight_bytes: 8 << 20, ..Default::default() };
    let addr = start_big(config).await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_reader(addr, 1).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = large_read(addr).await;
    waits_until(waiting, "small connection budget", || drop(stalled)).await;
}

/// Reads and discards until the server closes `s` (EOF or reset); panics after `within`.
async fn drained_until_closed(s: &mut TcpStream, within: Duration) {
    let mut buf = vec![0u8; 1 << 16];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .expect("the server should close a stalled connection");
}

#[tokio::test]
async fn stalled_clients_are_closed_after_the_stall_timeout() {
    // A client that stops reading replies, and one that sends a WRITE header and part
    // of its payload, are closed once the stall timeout passes; the budget they held
    // is free again. A client that pauses between requests but reads its replies is
    // not closed, nor is one that takes four times the stall timeout to read a 16 MiB
    // reply (1 MiB every 0.25 s): the timeout is on progress, not on the whole reply.
    let config = ServerConfig {
        max_total_in_flight_bytes: 8 << 20,
        stall_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let addr = start_big(config).await;
    let mut reader = stalled_reader(addr, 32).await;
    let mut writer = TcpStream::connect(addr).await.unwrap();
    connect(&mut writer, "big", false, false).await;
    send_request(&mut writer, Command::Write, 0, 1, 0, MIB).await;
    writer.write_all(&[7u8; 100]).await.unwrap();
    let mut steady = TcpStream::connect(addr).await.unwrap();
    connect(&mut steady, "big", false, false).await;
    let slow = tokio::spawn(async move {
        let mut slow = small_window(addr, false).await;
        send_request(&mut slow, Command::Read, 0, 7, 0, 16 * MIB).await;
        let mut got = vec![0u8; 16 + 16 * MIB as usize];
        for piece in got.chunks_mut(MIB as usize) {
            tokio::time::sleep(Duration::from_millis(250)).await;
            slow.read_exact(piece).await.unwrap();
        }
        assert!(got[16..].iter().enumerate().all(|(k, &b)| b == pattern(k as u64)), "the slowly read reply");
    });

    // The steady client reads 4 KiB every 200 ms through the stall timeout and beyond.
    for h in 0..10 {
        read_big(&mut steady, 10 + h, h << 20, 4096).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drained_until_closed(&mut reader, Duration::from_secs(10)).await;
    drained_until_closed(&mut writer, Duration::from_secs(10)).await;
    // The budget the stalled reader held is free: a READ needing most of it is answered.
    tokio::time::timeout(Duration::from_secs(10), read_big(&mut steady, 99, 4 << 20, 4 * MIB))
        .await
        .expect("a 4 MiB READ after the stalled client was closed");
    // Nothing of the half-sent WRITE was applied.
    read_big(&mut steady, 100, 0, 4096).await;
    tokio::time::timeout(Duration::from_secs(30), slow).await.expect("the slow reader finishes").unwrap();
}

#[tokio::test]
async fn requests_waiting_for_the_server_budget_get_eshutdown_at_shutdown() {
    // A stalled reader holds the whole 8 MiB server budget. Another client's 4 MiB READ
    // waits for it, and so does the rest of a third client's 16 MiB WRITE payload once
    // its first 2 MiB (that connection's own allowance) are in. When the server begins
    // shutting down, neither has run: both are answered NBD_ESHUTDOWN at once (the
    // WRITE after its payload was read and dropped) while the stalled reader still
    // holds the budget, and the WRITE changed nothing.
    let config = ServerConfig {
        max_total_in_flight_bytes: 8 << 20,
        shutdown_grace: Duration::from_secs(30),
        soft_disconnect: nbd::SoftDisconnect::Eshutdown,
        ..Default::default()
    };
    let (addr, server, registry) = start_big_server(config).await;
    let stalled = stalled_reader(addr, 32).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut reader = TcpStream::connect(addr).await.unwrap();
    connect(&mut reader, "big", false, false).await;
    send_request(&mut reader, Command::Read, 0, 1, 4 << 20, 4 * MIB).await;
    // A small send buffer, so that the payload cannot hide in socket buffers.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_send_buffer_size(64 << 10).unwrap();
    let mut writer = socket.connect(addr).await.unwrap();
    connect(&mut writer, "big", false, false).await;
    let (mut from_writer, mut to_writer) = writer.into_split();
    let payload = tokio::spawn(async move {
        send_write(&mut to_writer, 0, 2, 0, &vec![0xee; 16 * MIB as usize]).await;
        to_writer
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!payload.is_finished(), "the rest of the WRITE payload waits for the server budget");

    server.shut_down();
    let answered = async {
        assert_eq!(simple_reply(&mut reader, 1, 0).await.0, 108, "the waiting READ: NBD_ESHUTDOWN");
        assert_eq!(simple_reply(&mut from_writer, 2, 0).await.0, 108, "the waiting WRITE: NBD_ESHUTDOWN");
    };
    tokio::time::timeout(Duration::from_secs(10), answered).await.expect("answered while the budget is held");
    let _to_writer = payload.await.unwrap();
    let first: Vec<u8> = (0..u64::from(MIB)).map(pattern).collect();
    assert!(registry.get("big").snapshot(0..MIB as usize) == first, "the WRITE was not applied");
    drop(stalled);
}

#[tokio::test]
async fn writes_beyond_the_server_budget_complete_and_do_not_deadlock() {
    // With an 8 MiB server budget: one 16 MiB WRITE (more than the budget and a
    // connection's 2 MiB allowance together), then eight 8 MiB WRITEs at once on eight
    // connections. Each must be answered. Before, a WRITE took the server's budget a
    // piece at a time as its payload arrived and held what it had while waiting for
    // more: the single WRITE waited forever, and the eight deadlocked each other.
    let config = ServerConfig { max_total_in_flight_bytes: 8 << 20, ..Default::default() };
    let (addr, _server, registry) = start_big_server(config).await;
    let mut one = TcpStream::connect(addr).await.unwrap();
    one.set_nodelay(true).unwrap();
    connect(&mut one, "big", false, false).await;
    let big = vec![0x5a; 16 * MIB as usize];
    let written = async {
        send_write(&mut one, 0, 1, 0, &big).await;
        simple_reply(&mut one, 1, 0).await.0
    };
    let error = tokio::time::timeout(Duration::from_secs(20), written).await.expect("a 16 MiB WRITE is answered");
    assert_eq!(error, 0);
    assert!(registry.get("big").snapshot(0..16 * MIB as usize) == big, "the 16 MiB WRITE's data");

    let mut writers = Vec::new();
    for w in 0..8u64 {
        writers.push(tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.set_nodelay(true).unwrap();
            connect(&mut c, "big", false, false).await;
            send_write(&mut c, 0, w, w * 8 * u64::from(MIB), &vec![w as u8; 8 * MIB as usize]).await;
            simple_reply(&mut c, w, 0).await.0
        }));
    }
    for (w, writer) in writers.into_iter().enumerate() {
        let error = tokio::time::timeout(Duration::from_secs(20), writer)
            .await
            .unwrap_or_else(|_| panic!("WRITE {w} of eight concurrent 8 MiB WRITEs is answered"))
            .unwrap();
        assert_eq!(error, 0);
    }
    let data = registry.get("big").snapshot(0..64 * MIB as usize);
    for w in 0..8usize {
        assert!(
            data[w * 8 * MIB as usize..(w + 1) * 8 * MIB as usize].iter().all(|&b| b == w as u8),
            "WRITE {w}'s data"
        );
    }
}
