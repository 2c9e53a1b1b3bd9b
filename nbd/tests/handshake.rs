//! Handshake and option haggling, driven byte by byte over an in-memory pipe.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use nbd::proto::*;
use nbd::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SIZE: u64 = 1 << 24;

fn registry() -> Arc<MemRegistry> {
    let mut described = MemExport::new(SIZE);
    described.description = "the first disk".into();
    Arc::new(MemRegistry::default().with("disk", described).with("ro", MemExport::new(1 << 20).read_only()))
}

fn start_default() -> (tokio::io::DuplexStream, ServerTask) {
    start(registry(), ServerConfig::default())
}

#[tokio::test]
async fn greeting_and_export_name_with_zeroes() {
    let (mut c, task) = start_default();
    let mut g = [0u8; 18];
    c.read_exact(&mut g).await.unwrap();
    assert_eq!(
        g,
        [
            0x4e, 0x42, 0x44, 0x4d, 0x41, 0x47, 0x49, 0x43, // NBDMAGIC
            0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, // IHAVEOPT
            0x00, 0x03, // FIXED_NEWSTYLE | NO_ZEROES
        ]
    );
    c.write_all(&[0, 0, 0, 1]).await.unwrap(); // fixed newstyle, zeroes wanted
    c.write_all(&[0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 1, 0, 0, 0, 4]).await.unwrap();
    c.write_all(b"disk").await.unwrap();
    let mut reply = [0u8; 134];
    c.read_exact(&mut reply).await.unwrap();
    assert_eq!(&reply[..8], &SIZE.to_be_bytes());
    let tflags = u16::from_be_bytes([reply[8], reply[9]]);
    // no structured replies were negotiated: no DF
    assert_eq!(
        tflags,
        NBD_FLAG_HAS_FLAGS
            | NBD_FLAG_SEND_FLUSH
            | NBD_FLAG_SEND_FUA
            | NBD_FLAG_SEND_TRIM
            | NBD_FLAG_SEND_WRITE_ZEROES
            | NBD_FLAG_SEND_FAST_ZERO
            | NBD_FLAG_CAN_MULTI_CONN
            | NBD_FLAG_SEND_CACHE
    );
    assert!(reply[10..].iter().all(|&b| b == 0));
    // transmission works right after
    send_request(&mut c, Command::Flush, 0, 7, 0, 0).await;
    assert_eq!(simple_reply(&mut c, 7, 0).await.0, 0);
    send_request(&mut c, Command::Disc, 0, 8, 0, 0).await;
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn export_name_without_zeroes() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    send_option(&mut c, NBD_OPT_EXPORT_NAME, b"ro").await;
    let mut reply = [0u8; 10];
    c.read_exact(&mut reply).await.unwrap();
    assert_eq!(&reply[..8], &(1u64 << 20).to_be_bytes());
    let tflags = u16::from_be_bytes([reply[8], reply[9]]);
    assert_ne!(tflags & NBD_FLAG_READ_ONLY, 0);
    // the next bytes are the reply to a request, not padding
    send_request(&mut c, Command::Read, 0, 1, 0, 8).await;
    let (err, data) = simple_reply(&mut c, 1, 8).await;
    assert_eq!((err, data), (0, vec![0; 8]));
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn go_reply_bytes() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    // NBD_OPT_GO "disk", no information requests
    c.write_all(b"IHAVEOPT").await.unwrap();
    c.write_all(&[0, 0, 0, 7, 0, 0, 0, 10, 0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 0]).await.unwrap();
    let magic = [0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9];

    let mut info = [0u8; 32];
    c.read_exact(&mut info).await.unwrap();
    assert_eq!(&info[..8], &magic);
    assert_eq!(&info[8..20], &[0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 12]); // GO, NBD_REP_INFO, 12
    assert_eq!(&info[20..22], &[0, 0]); // NBD_INFO_EXPORT
    assert_eq!(&info[22..30], &SIZE.to_be_bytes());

    let mut bs = [0u8; 34];
    c.read_exact(&mut bs).await.unwrap();
    assert_eq!(&bs[..8], &magic);
    assert_eq!(&bs[8..20], &[0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 14]);
    assert_eq!(&bs[20..22], &[0, 3]); // NBD_INFO_BLOCK_SIZE, sent although not requested
    assert_eq!(&bs[22..26], &1u32.to_be_bytes());
    assert_eq!(&bs[26..30], &4096u32.to_be_bytes());
    assert_eq!(&bs[30..34], &(1u32 << 20).to_be_bytes());

    let mut ack = [0u8; 20];
    c.read_exact(&mut ack).await.unwrap();
    assert_eq!(&ack[..8], &magic);
    assert_eq!(&ack[8..], &[0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 0]);

    send_request(&mut c, Command::Disc, 0, 1, 0, 0).await;
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn list_exports() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_LIST, &[]).await;
    let replies = read_option_replies(&mut c).await;
    assert_eq!(replies.len(), 3);
    let (h, d) = &replies[0];
    assert_eq!((h.option, h.reply_type), (NBD_OPT_LIST, NBD_REP_SERVER));
    assert_eq!(d, &[&[0u8, 0, 0, 4][..], b"disk", b"the first disk"].concat());
    let (h, d) = &replies[1];
    assert_eq!(h.reply_type, NBD_REP_SERVER);
    assert_eq!(&d[..6], &[0, 0, 0, 2, b'r', b'o']);
    assert_eq!(replies[2].0.reply_type, NBD_REP_ACK);

    // LIST with data is invalid, and haggling goes on
    send_option(&mut c, NBD_OPT_LIST, b"x").await;
    let (h, _) = read_option_reply(&mut c).await;
    assert_eq!(h.reply_type, NBD_REP_ERR_INVALID);
    send_option(&mut c, NBD_OPT_ABORT, &[]).await;
    let (h, _) = read_option_reply(&mut c).await;
    assert_eq!((h.option, h.reply_type, h.length), (NBD_OPT_ABORT, NBD_REP_ACK, 0));
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn info_with_block_size_name_and_description() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let req = InfoRequest {
        name: "disk".into(),
        requests: vec![NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE, 0x7777],
    };
    send_option(&mut c, NBD_OPT_INFO, &req.encode()).await;
    let replies = read_option_replies(&mut c).await;
    let mut seen = Vec::new();
    for (h, d) in &replies[..replies.len() - 1] {
        assert_eq!((h.option, h.reply_type), (NBD_OPT_INFO, NBD_REP_INFO));
        let t = u16::from_be_bytes([d[0], d[1]]);
        seen.push(t);
        match t {
            NBD_INFO_EXPORT => {
                assert_eq!(d.len(), 12);
                assert_eq!(&d[2..10], &SIZE.to_be_bytes());
            }
            NBD_INFO_NAME => assert_eq!(&d[2..], b"disk"),
            NBD_INFO_DESCRIPTION => assert_eq!(&d[2..], b"the first disk"),
            NBD_INFO_BLOCK_SIZE => {
                assert_eq!(d.len(), 14);
                assert_eq!(&d[2..], &[0, 0, 0, 1, 0, 0, 0x10, 0, 0, 0x10, 0, 0]);
            }
            other => panic!("unexpected info {other}"),
        }
    }
    seen.sort();
    assert_eq!(seen, vec![NBD_INFO_EXPORT, NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE]);
    assert_eq!(replies.last().unwrap().0.reply_type, NBD_REP_ACK);

    // INFO does not enter transmission: GO still works
    let go = InfoRequest { name: "disk".into(), requests: vec![] };
    send_option(&mut c, NBD_OPT_GO, &go.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    send_request(&mut c, Command::Disc, 0, 1, 0, 0).await;
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn unknown_export_is_an_error_reply_for_info_and_go() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    for option in [NBD_OPT_INFO, NBD_OPT_GO] {
        let req = InfoRequest { name: "nope".into(), requests: vec![] };
        send_option(&mut c, option, &req.encode()).await;
        let replies = read_option_replies(&mut c).await;
        assert_eq!(replies.len(), 1, "no NBD_REP_INFO before the error");
        assert_eq!((replies[0].0.option, replies[0].0.reply_type), (option, NBD_REP_ERR_UNKNOWN));
    }
    // the empty (default) name is unknown in this registry too
    send_option(&mut c, NBD_OPT_GO, &InfoRequest { name: String::new(), requests: vec![] }.encode()).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ERR_UNKNOWN);
    // and the client can go on to a real export
    send_option(&mut c, NBD_OPT_GO, &InfoRequest { name: "disk".into(), requests: vec![] }.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn unknown_export_with_export_name_closes() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_EXPORT_NAME, b"nope").await;
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::UnknownExport(n)) if n == "nope"));
}

#[tokio::test]
async fn unsupported_options() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    for (option, data) in [
        (0x1234u32, &b"hello"[..]),
        (NBD_OPT_STARTTLS, &[][..]),
        (NBD_OPT_EXTENDED_HEADERS, &[][..]),
        (NBD_OPT_PEEK_EXPORT, &[][..]),
    ] {
        send_option(&mut c, option, data).await;
        let (h, _) = read_option_reply(&mut c).await;
        assert_eq!((h.option, h.reply_type), (option, NBD_REP_ERR_UNSUP));
    }
    // the stream is still in sync
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn malformed_options_are_invalid() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let cases: Vec<(u32, Vec<u8>)> = vec![
        (NBD_OPT_GO, vec![0, 0, 0, 9, b'd']),         // name length past the end
        (NBD_OPT_INFO, vec![0, 0, 0, 0, 0, 2, 0, 3]), // 2 requests, 1 present
        (NBD_OPT_GO, vec![0, 0, 0, 1, 0xff, 0, 0]),   // invalid UTF-8
        (NBD_OPT_STRUCTURED_REPLY, vec![1]),          // takes no data
        (NBD_OPT_SET_META_CONTEXT, MetaContextRequest { export_name: "disk".into(), queries: vec![] }.encode()), // before structured
    ];
    for (option, data) in cases {
        send_option(&mut c, option, &data).await;
        let (h, _) = read_option_reply(&mut c).await;
        assert_eq!((h.option, h.reply_type), (option, NBD_REP_ERR_INVALID), "option {option}");
    }
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    // meta context request with a query length past the end
    send_option(&mut c, NBD_OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 50, b'b']).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ERR_INVALID);
    drop(c);
    finish(task).await.unwrap();
}

/// proto.md "Option haggling": the server skips an option's data by its length and
/// replies. Beyond what this server buffers (64 KiB), data up to 16 MiB is read and
/// thrown away: a known option gets NBD_REP_ERR_TOO_BIG, an unknown one
/// NBD_REP_ERR_UNSUP, NBD_OPT_ABORT its ACK; the session goes on in sync.
#[tokio::test]
async fn oversized_options_are_skipped_and_answered() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    for (option, len, want) in [
        (NBD_OPT_LIST, 64 * 1024 + 1, NBD_REP_ERR_TOO_BIG),
        (NBD_OPT_SET_META_CONTEXT, 200 * 1024, NBD_REP_ERR_TOO_BIG),
        (0x1234, 100 * 1024, NBD_REP_ERR_UNSUP),
    ] {
        send_option(&mut c, option, &vec![0xaa; len]).await;
        let (h, _) = read_option_reply(&mut c).await;
        assert_eq!((h.option, h.reply_type), (option, want), "option {option} with {len} bytes");
    }
    send_option(&mut c, NBD_OPT_LIST, &[]).await;
    let replies = read_option_replies(&mut c).await;
    assert_eq!(replies.last().unwrap().0.reply_type, NBD_REP_ACK, "in sync after the skipped data");
    send_option(&mut c, NBD_OPT_ABORT, &vec![0; 70 * 1024]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn oversized_option_disconnects() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    // claims 1 GiB of option data; the server must not wait for or allocate it
    c.write_all(&OptionHeader { option: NBD_OPT_LIST, length: 1 << 30 }.encode()).await.unwrap();
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))));
}

/// proto.md "Client flags": a flag the server does not know ends the session.
#[tokio::test]
async fn bad_client_flags_disconnect() {
    for flags in [NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 5, NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 31] {
        let (mut c, task) = start_default();
        greet(&mut c, flags).await;
        expect_closed(&mut c).await;
        assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))), "flags {flags:#x}");
    }
}

#[tokio::test]
async fn bad_option_magic_disconnects() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    c.write_all(b"IHAVEOPX\0\0\0\x03\0\0\0\0").await.unwrap();
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))));
}

#[tokio::test]
async fn client_leaving_during_haggling_is_fine() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    read_option_reply(&mut c).await;
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn handshake_timeout() {
    let config = ServerConfig { handshake_timeout: Duration::from_millis(200), ..Default::default() };
    let (mut c, task) = start(registry(), config);
    let mut g = [0u8; 18];
    c.read_exact(&mut g).await.unwrap();
    // never answer
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::HandshakeTimeout(_))));
}

/// The handshake timeout is on progress: a client that takes four times it to reach
/// the transmission phase, sending an option and reading its reply every half timeout,
/// is not closed (nbdinfo --list over TCP takes about 200 ms per export).
#[tokio::test]
async fn handshake_timeout_counts_progress_not_the_whole_handshake() {
    let config = ServerConfig { handshake_timeout: Duration::from_millis(300), ..Default::default() };
    let (mut c, task) = start(registry(), config);
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        send_option(&mut c, NBD_OPT_LIST, &[]).await;
        assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    }
    let req = InfoRequest { name: "disk".into(), requests: vec![] };
    send_option(&mut c, NBD_OPT_GO, &req.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    send_request(&mut c, Command::Disc, 0, 1, 0, 0).await;
    finish(task).await.unwrap();
}

/// The largest handshake timeout (the CLI takes any number of seconds) is served like
/// any other: a client that takes a moment to choose its export gets it, and nothing
/// overflows computing the deadline.
#[tokio::test]
async fn the_largest_handshake_timeout_serves_clients() {
    let config = ServerConfig { handshake_timeout: Duration::MAX, ..Default::default() };
    let (mut c, task) = start(registry(), config);
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let req = InfoRequest { name: "disk".into(), requests: vec![] };
    send_option(&mut c, NBD_OPT_GO, &req.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    send_request(&mut c, Command::Disc, 0, 1, 0, 0).await;
    finish(task).await.unwrap();
}

/// A client that keeps sending bytes, one at a time, never finishes its handshake: it is
/// closed once ten handshake timeouts have passed, so it cannot hold a connection slot
/// for ever.
#[tokio::test]
async fn a_trickling_handshake_is_closed_after_ten_timeouts() {
    let config = ServerConfig { handshake_timeout: Duration::from_millis(100), ..Default::default() };
    let (mut c, task) = start(registry(), config);
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let started = tokio::time::Instant::now();
    let trickle = async {
        // The header of an option whose data never ends, a byte every 50 ms.
        let header = OptionHeader { option: NBD_OPT_GO, length: 4000 }.encode();
        for b in header.iter().chain(std::iter::repeat(&0u8)) {
            if c.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), trickle).await.expect("the trickling client is closed");
    assert!(started.elapsed() >= Duration::from_millis(900), "closed before ten timeouts: {:?}", started.elapsed());
    assert!(matches!(finish(task).await, Err(nbd::Error::HandshakeTimeout(_))));
}

#[tokio::test]
async fn meta_context_list_and_set() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);

    let list = |queries: &[&str]| {
        MetaContextRequest { export_name: "disk".into(), queries: queries.iter().map(|q| q.to_string()).collect() }
            .encode()
    };
    // LIST: no query, "base:" and "base:allocation" all find base:allocation with id 0
    for queries in [&[][..], &["base:"][..], &["base:allocation"][..], &["x-foo:bar", "base:"][..]] {
        send_option(&mut c, NBD_OPT_LIST_META_CONTEXT, &list(queries)).await;
        let replies = read_option_replies(&mut c).await;
        assert_eq!(replies.len(), 2, "{queries:?}");
        assert_eq!(replies[0].0.reply_type, NBD_REP_META_CONTEXT);
        assert_eq!(replies[0].1, [&[0u8, 0, 0, 0][..], b"base:allocation"].concat());
        assert_eq!(replies[1].0.reply_type, NBD_REP_ACK);
    }
    // LIST: other namespaces and unknown leaves are ignored
    for queries in [&["qemu:dirty-bitmap:a"][..], &["base:nothing"][..]] {
        send_option(&mut c, NBD_OPT_LIST_META_CONTEXT, &list(queries)).await;
        let replies = read_option_replies(&mut c).await;
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].0.reply_type, NBD_REP_ACK);
    }
    // SET: "base:" selects nothing
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &list(&["base:"])).await;
    let replies = read_option_replies(&mut c).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].0.reply_type, NBD_REP_ACK);
    // SET: unknown export
    let unknown = MetaContextRequest { export_name: "nope".into(), queries: vec!["base:allocation".into()] };
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &unknown.encode()).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ERR_UNKNOWN);
    // SET: base:allocation gets a nonzero id
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &list(&["base:allocation", "base:allocation"])).await;
    let replies = read_option_replies(&mut c).await;
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].0.reply_type, NBD_REP_META_CONTEXT);
    assert_eq!(replies[0].1, [&[0u8, 0, 0, 1][..], b"base:allocation"].concat());
    assert_eq!(replies[1].0.reply_type, NBD_REP_ACK);
    // GO: structured replies bring NBD_FLAG_SEND_DF
    send_option(&mut c, NBD_OPT_GO, &InfoRequest { name: "disk".into(), requests: vec![] }.encode()).await;
    let replies = read_option_replies(&mut c).await;
    let (_, info) = replies.iter().find(|(_, d)| d[..2] == [0, 0]).unwrap();
    let tflags = u16::from_be_bytes([info[10], info[11]]);
    assert_ne!(tflags & NBD_FLAG_SEND_DF, 0);
    // BLOCK_STATUS works with the id handed out
    send_request(&mut c, Command::BlockStatus, 0, 5, 0, 4096).await;
    let chunks = structured_reply(&mut c, 5).await;
    assert_eq!(chunks[0].0.chunk_type, NBD_REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(&chunks[0].1[..4], &[0, 0, 0, 1]);
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn meta_context_for_another_export_does_not_enable_block_status() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    read_option_reply(&mut c).await;
    let q = MetaContextRequest { export_name: "ro".into(), queries: vec!["base:allocation".into()] };
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &q.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.len(), 2);
    send_option(&mut c, NBD_OPT_GO, &InfoRequest { name: "disk".into(), requests: vec![] }.encode()).await;
    read_option_replies(&mut c).await;
    send_request(&mut c, Command::BlockStatus, 0, 9, 0, 4096).await;
    let (errno, _) = chunk_error(&structured_reply(&mut c, 9).await);
    assert_eq!(errno, 22);
    drop(c);
    finish(task).await.unwrap();
}

/// proto.md "Newstyle negotiation": a client without NBD_FLAG_C_FIXED_NEWSTYLE gets
/// its NBD_OPT_EXPORT_NAME served (the 124 zero bytes too, as it did not set
/// NBD_FLAG_C_NO_ZEROES); any other option from it can only be answered by closing.
#[tokio::test]
async fn a_client_without_fixed_newstyle_is_served_export_name() {
    let (mut c, task) = start_default();
    greet(&mut c, 0).await;
    send_option(&mut c, NBD_OPT_EXPORT_NAME, b"disk").await;
    let mut reply = [0u8; 8 + 2 + 124];
    c.read_exact(&mut reply).await.unwrap();
    assert_eq!(u64::from_be_bytes(reply[..8].try_into().unwrap()), SIZE);
    assert!(reply[10..].iter().all(|b| *b == 0), "the 124 zero bytes");
    drop(c);
    finish(task).await.unwrap();

    let (mut c, task) = start_default();
    greet(&mut c, 0).await;
    send_option(&mut c, NBD_OPT_LIST, &[]).await;
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))));
}

/// proto.md "NBD_OPT_ABORT": the server replies NBD_REP_ACK whatever data came with it,
/// and copes with a client that closes without reading the reply.
#[tokio::test]
async fn abort_is_acknowledged_with_data_and_without_a_reader() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_ABORT, b"abc").await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    expect_closed(&mut c).await;
    finish(task).await.unwrap();

    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_ABORT, &[]).await;
    drop(c);
    finish(task).await.unwrap();
}

/// proto.md "NBD_OPT_LIST_META_CONTEXT": before structured replies the server MAY
/// refuse it with NBD_REP_ERR_INVALID (this one does); NBD_OPT_STRUCTURED_REPLY twice
/// is acknowledged twice (the spec allows either).
#[tokio::test]
async fn list_meta_context_needs_structured_replies_which_may_be_asked_twice() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let q = MetaContextRequest { export_name: "disk".into(), queries: vec![] }.encode();
    send_option(&mut c, NBD_OPT_LIST_META_CONTEXT, &q).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ERR_INVALID);
    for _ in 0..2 {
        send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    }
    send_option(&mut c, NBD_OPT_LIST_META_CONTEXT, &q).await;
    let replies = read_option_replies(&mut c).await;
    assert!(replies.iter().any(|(h, _)| h.reply_type == NBD_REP_META_CONTEXT), "contexts listed once structured");
    drop(c);
    finish(task).await.unwrap();
}

/// proto.md "NBD_OPT_INFO": each information type is answered once however often it is
/// asked for.
#[tokio::test]
async fn repeated_info_requests_are_answered_once() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let q = InfoRequest { name: "disk".into(), requests: vec![NBD_INFO_NAME, NBD_INFO_NAME, NBD_INFO_BLOCK_SIZE] };
    send_option(&mut c, NBD_OPT_INFO, &q.encode()).await;
    let replies = read_option_replies(&mut c).await;
    let names = replies
        .iter()
        .filter(|(h, d)| h.reply_type == NBD_REP_INFO && u16::from_be_bytes([d[0], d[1]]) == NBD_INFO_NAME)
        .count();
    assert_eq!(names, 1, "{replies:?}");
    drop(c);
    finish(task).await.unwrap();
}

/// proto.md "NBD_OPT_EXPORT_NAME": a name the server cannot take (here a NUL in it)
/// cannot get an error reply: the session ends.
#[tokio::test]
async fn an_export_name_with_a_nul_closes() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_EXPORT_NAME, b"di\0sk").await;
    expect_closed(&mut c).await;
    assert!(finish(task).await.is_err());
}

/// proto.md "NBD_OPT_SET_META_CONTEXT": a later SET replaces the earlier selection even
/// when it fails, so block status is then not negotiated (EINVAL).
#[tokio::test]
async fn a_failed_set_meta_context_clears_the_selection() {
    let (mut c, task) = start_default();
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    let good = MetaContextRequest { export_name: "disk".into(), queries: vec![BASE_ALLOCATION.into()] };
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &good.encode()).await;
    assert!(read_option_replies(&mut c).await.iter().any(|(h, _)| h.reply_type == NBD_REP_META_CONTEXT));
    let bad = MetaContextRequest { export_name: "nope".into(), queries: vec![BASE_ALLOCATION.into()] };
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &bad.encode()).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ERR_UNKNOWN);
    let go = InfoRequest { name: "disk".into(), requests: vec![] };
    send_option(&mut c, NBD_OPT_GO, &go.encode()).await;
    assert_eq!(read_option_replies(&mut c).await.last().unwrap().0.reply_type, NBD_REP_ACK);
    send_request(&mut c, Command::BlockStatus, 0, 9, 0, 4096).await;
    let chunks = structured_reply(&mut c, 9).await;
    assert_eq!(chunk_error(&chunks).0, 22, "EINVAL: block status without a selected context");
    drop(c);
    let _ = finish(task).await;
}

/// proto.md "Termination": once the server shuts down it SHOULD answer options with
/// NBD_REP_ERR_SHUTDOWN; NBD_OPT_ABORT is still acknowledged.
#[tokio::test]
async fn options_during_shutdown_get_err_shutdown() {
    let (mut c, s) = tokio::io::duplex(1 << 20);
    let server = nbd::Server::new(registry(), ServerConfig::default());
    let task = tokio::spawn({
        let server = Arc::clone(&server);
        async move { server.serve_connection(s).await }
    });
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    server.shut_down();
    for (option, data) in
        [(NBD_OPT_LIST, Vec::new()), (NBD_OPT_GO, InfoRequest { name: "disk".into(), requests: vec![] }.encode())]
    {
        send_option(&mut c, option, &data).await;
        let (h, _) = read_option_reply(&mut c).await;
        assert_eq!((h.option, h.reply_type), (option, NBD_REP_ERR_SHUTDOWN));
    }
    send_option(&mut c, NBD_OPT_ABORT, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    finish(task).await.unwrap();
}

/// proto.md "FORCEDTLS mode": before STARTTLS every option but NBD_OPT_STARTTLS and
/// NBD_OPT_ABORT, known or not, of any length, gets NBD_REP_ERR_TLS_REQD and nothing
/// else.
#[tokio::test]
async fn forced_tls_refuses_every_option_before_starttls() {
    let tls = nbd::NbdTls {
        mode: nbd::TlsMode::Required,
        source: Arc::new(nbd::testing::test_tls_config()) as Arc<dyn nbd::TlsSource>,
    };
    let (mut c, task) = start(registry(), ServerConfig { tls: Some(tls), ..ServerConfig::default() });
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE).await;
    let go = InfoRequest { name: "disk".into(), requests: vec![NBD_INFO_BLOCK_SIZE] }.encode();
    let meta = MetaContextRequest { export_name: "disk".into(), queries: vec![] }.encode();
    for (option, data) in [
        (NBD_OPT_GO, go.clone()),
        (NBD_OPT_INFO, go),
        (NBD_OPT_LIST, Vec::new()),
        (NBD_OPT_STRUCTURED_REPLY, Vec::new()),
        (NBD_OPT_SET_META_CONTEXT, meta.clone()),
        (NBD_OPT_LIST_META_CONTEXT, meta),
        (NBD_OPT_EXTENDED_HEADERS, Vec::new()),
        (0x1234, b"x".to_vec()),
        // Data past what the server buffers changes nothing: TLS first.
        (NBD_OPT_LIST, vec![0; 70 * 1024]),
    ] {
        send_option(&mut c, option, &data).await;
        let (h, _) = read_option_reply(&mut c).await;
        assert_eq!((h.option, h.reply_type), (option, NBD_REP_ERR_TLS_REQD), "option {option}");
    }
    send_option(&mut c, NBD_OPT_ABORT, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}
