//! A minimal raw NBD client for protocol tests, built on `nbd::proto`.
//!
//! Lives here: starting a server over an in-memory duplex stream, the client side of
//! the greeting, option requests and replies, transmission requests, and reading simple
//! replies and structured reply chunks.
//! Not here: any validation beyond what each test asserts.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nbd::proto::*;
use nbd::ServerConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

use super::mem_export::MemRegistry;

pub type ServerTask = JoinHandle<Result<(), nbd::Error>>;

/// Starts `serve_connection` on one end of a duplex pipe; returns the other end.
pub fn start(registry: Arc<MemRegistry>, config: ServerConfig) -> (DuplexStream, ServerTask) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let task = tokio::spawn(nbd::serve_connection(registry, server, Arc::new(config)));
    (client, task)
}

/// Waits for the server task and returns its result.
pub async fn finish(task: ServerTask) -> Result<(), nbd::Error> {
    tokio::time::timeout(Duration::from_secs(10), task).await.expect("server ended").expect("no panic")
}

/// Reads and checks the greeting, then sends `client_flags`.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, client_flags: u32) {
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await.unwrap();
    assert_eq!(&g[..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    assert_eq!(u16::from_be_bytes([g[16], g[17]]), NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
    s.write_all(&client_flags.to_be_bytes()).await.unwrap();
}

pub async fn send_option<S: AsyncWrite + Unpin>(s: &mut S, option: u32, data: &[u8]) {
    let h = OptionHeader { option, length: data.len() as u32 };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(data).await.unwrap();
}

pub async fn read_option_reply<S: AsyncRead + Unpin>(s: &mut S) -> (OptionReplyHeader, Vec<u8>) {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).await.unwrap();
    let h = OptionReplyHeader::parse(&h).unwrap();
    let mut data = vec![0u8; h.length as usize];
    s.read_exact(&mut data).await.unwrap();
    (h, data)
}

/// Reads option replies until a final one (ACK or an error); returns all of them.
pub async fn read_option_replies<S: AsyncRead + Unpin>(s: &mut S) -> Vec<(OptionReplyHeader, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let r = read_option_reply(s).await;
        let t = r.0.reply_type;
        out.push(r);
        if t == NBD_REP_ACK || t & NBD_REP_FLAG_ERROR != 0 {
            return out;
        }
    }
}

/// What a successful `NBD_OPT_GO` told the client.
#[derive(Debug, Clone, Copy)]
pub struct Session {
    pub size: u64,
    pub tflags: u16,
    pub block_size: (u32, u32, u32),
    pub context_id: Option<u32>,
}

/// Greets, optionally negotiates structured replies and `base:allocation`, then GO.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    name: &str,
    structured: bool,
    meta: bool,
) -> Session {
    greet(s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    if structured {
        send_option(s, NBD_OPT_STRUCTURED_REPLY, &[]).await;
        let (h, _) = read_option_reply(s).await;
        assert_eq!(h.reply_type, NBD_REP_ACK);
    }
    let mut context_id = None;
    if meta {
        let q = MetaContextRequest { export_name: name.into(), queries: vec![BASE_ALLOCATION.into()] };
        send_option(s, NBD_OPT_SET_META_CONTEXT, &q.encode()).await;
        for (h, data) in read_option_replies(s).await {
            if h.reply_type == NBD_REP_META_CONTEXT {
                assert_eq!(&data[4..], BASE_ALLOCATION.as_bytes());
                context_id = Some(u32::from_be_bytes(data[..4].try_into().unwrap()));
            } else {
                assert_eq!(h.reply_type, NBD_REP_ACK);
            }
        }
    }
    let go = InfoRequest { name: name.into(), requests: vec![NBD_INFO_BLOCK_SIZE] };
    send_option(s, NBD_OPT_GO, &go.encode()).await;
    let mut size = None;
    let mut tflags = 0;
    let mut block_size = (0, 0, 0);
    for (h, data) in read_option_replies(s).await {
        assert_eq!(h.option, NBD_OPT_GO);
        match h.reply_type {
            NBD_REP_INFO => match u16::from_be_bytes([data[0], data[1]]) {
                NBD_INFO_EXPORT => {
                    size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()));
                    tflags = u16::from_be_bytes([data[10], data[11]]);
                }
                NBD_INFO_BLOCK_SIZE => {
                    let v = |i: usize| u32::from_be_bytes(data[i..i + 4].try_into().unwrap());
                    block_size = (v(2), v(6), v(10));
                }
                _ => {}
            },
            NBD_REP_ACK => {}
            other => panic!("GO failed with reply type {other:#x}"),
        }
    }
    Session { size: size.expect("NBD_INFO_EXPORT"), tflags, block_size, context_id }
}

pub async fn send_request<S: AsyncWrite + Unpin>(
    s: &mut S,
    command: Command,
    flags: u16,
    handle: u64,
    offset: u64,
    length: u32,
) {
    let r = Request { flags, command, handle, offset, length };
    s.write_all(&r.encode()).await.unwrap();
}

pub async fn send_write<S: AsyncWrite + Unpin>(s: &mut S, flags: u16, handle: u64, offset: u64, data: &[u8]) {
    send_request(s, Command::Write, flags, handle, offset, data.len() as u32).await;
    s.write_all(data).await.unwrap();
}

/// One message from the server in the transmission phase.
#[derive(Debug)]
pub enum Msg {
    Simple { handle: u64, error: u32, data: Vec<u8> },
    Chunk { header: ChunkHeader, payload: Vec<u8> },
}

impl Msg {
    pub fn handle(&self) -> u64 {
        match self {
            Msg::Simple { handle, .. } => *handle,
            Msg::Chunk { header, .. } => header.handle,
        }
    }
}

/// Reads one reply message. `read_lens` maps handles of outstanding simple-reply READs to
/// their length, so that the data after a successful simple reply can be consumed.
pub async fn read_msg<S: AsyncRead + Unpin>(s: &mut S, read_lens: &HashMap<u64, usize>) -> Msg {
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).await.unwrap();
    match u32::from_be_bytes(magic) {
        NBD_SIMPLE_REPLY_MAGIC => {
            let mut b = [0u8; SIMPLE_REPLY_LEN];
            b[..4].copy_from_slice(&magic);
            s.read_exact(&mut b[4..]).await.unwrap();
            let r = SimpleReply::parse(&b).unwrap();
            let mut data = Vec::new();
            if r.error == 0 {
                if let Some(&len) = read_lens.get(&r.handle) {
                    data = vec![0; len];
                    s.read_exact(&mut data).await.unwrap();
                }
            }
            Msg::Simple { handle: r.handle, error: r.error, data }
        }
        NBD_STRUCTURED_REPLY_MAGIC => {
            let mut b = [0u8; CHUNK_HEADER_LEN];
            b[..4].copy_from_slice(&magic);
            s.read_exact(&mut b[4..]).await.unwrap();
            let header = ChunkHeader::parse(&b).unwrap();
            let mut payload = vec![0; header.length as usize];
            s.read_exact(&mut payload).await.unwrap();
            Msg::Chunk { header, payload }
        }
        other => panic!("bad reply magic {other:#x}"),
    }
}

/// Reads a simple reply to a non-READ request (or a READ of `read_len` bytes).
pub async fn simple_reply<S: AsyncRead + Unpin>(s: &mut S, handle: u64, read_len: usize) -> (u32, Vec<u8>) {
    let lens = HashMap::from([(handle, read_len)]);
    match read_msg(s, &lens).await {
        Msg::Simple { handle: h, error, data } => {
            assert_eq!(h, handle);
            (error, data)
        }
        other => panic!("expected a simple reply, got {other:?}"),
    }
}

/// Reads the chunks of one structured reply up to the one flagged DONE.
pub async fn structured_reply<S: AsyncRead + Unpin>(s: &mut S, handle: u64) -> Vec<(ChunkHeader, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        match read_msg(s, &HashMap::new()).await {
            Msg::Chunk { header, payload } => {
                assert_eq!(header.handle, handle);
                let done = header.flags & NBD_REPLY_FLAG_DONE != 0;
                out.push((header, payload));
                if done {
                    return out;
                }
            }
            other => panic!("expected a structured chunk, got {other:?}"),
        }
    }
}

/// The error of a one-chunk `NBD_REPLY_TYPE_ERROR` reply, with its message.
pub fn chunk_error(chunks: &[(ChunkHeader, Vec<u8>)]) -> (u32, String) {
    assert_eq!(chunks.len(), 1, "{chunks:?}");
    let (h, p) = &chunks[0];
    assert_eq!(h.chunk_type, NBD_REPLY_TYPE_ERROR);
    assert_ne!(h.flags & NBD_REPLY_FLAG_DONE, 0);
    let errno = u32::from_be_bytes(p[..4].try_into().unwrap());
    let len = u16::from_be_bytes([p[4], p[5]]) as usize;
    assert_eq!(p.len(), 6 + len);
    (errno, String::from_utf8(p[6..].to_vec()).unwrap())
}

/// Reassembles the data of a structured READ reply of `len` bytes at `offset`;
/// returns the data and the chunk types in order.
pub fn assemble_read(chunks: &[(ChunkHeader, Vec<u8>)], offset: u64, len: usize) -> (Vec<u8>, Vec<u16>) {
    let mut data = vec![0xEEu8; len];
    let mut covered = 0usize;
    let mut types = Vec::new();
    for (h, p) in chunks {
        types.push(h.chunk_type);
        match h.chunk_type {
            NBD_REPLY_TYPE_OFFSET_DATA => {
                let at = (u64::from_be_bytes(p[..8].try_into().unwrap()) - offset) as usize;
                data[at..at + p.len() - 8].copy_from_slice(&p[8..]);
                covered += p.len() - 8;
            }
            NBD_REPLY_TYPE_OFFSET_HOLE => {
                assert_eq!(p.len(), 12);
                let at = (u64::from_be_bytes(p[..8].try_into().unwrap()) - offset) as usize;
                let n = u32::from_be_bytes(p[8..12].try_into().unwrap()) as usize;
                assert!(n > 0);
                data[at..at + n].fill(0);
                covered += n;
            }
            NBD_REPLY_TYPE_NONE => {}
            other => panic!("unexpected chunk type {other:#x}"),
        }
    }
    assert_eq!(covered, len, "content chunks must cover the request exactly");
    (data, types)
}

/// Asserts that the server closes the connection (EOF) without sending anything more.
pub async fn expect_closed<S: AsyncRead + Unpin>(s: &mut S) {
    let mut b = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b))
        .await
        .expect("server should close the connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "expected EOF");
}
