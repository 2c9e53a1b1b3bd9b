//! Limits against abusive clients: the cap on connections in all and per export, and
//! the idle timeout. Each test also checks that a well-behaved client is not disturbed.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use nbd::proto::*;
use nbd::{Server, ServerConfig};
use tokio::io::AsyncReadExt;
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
