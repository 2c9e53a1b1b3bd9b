//! A measurement tool, not part of ferrovol: the smallest read-only NBD server whose
//! socket receives, socket sends and O_DIRECT file reads are all entries of one
//! io_uring, with one `io_uring_enter` that submits and waits per step of its one
//! thread. It answers one question for BENCHMARKS.md: what a completion-based data
//! plane (the ring as the only place the thread waits) buys over ferrovol's present one
//! (tokio's epoll reactor, with the ring's eventfd in it), on the same machine and file.
//!
//! Serves FILE (raw, read-only, no mappings, no snapshots) as every export name, on
//! 127.0.0.1:PORT: `uring-proto FILE PORT`. The handshake (fixed newstyle,
//! `NBD_OPT_GO`/`NBD_OPT_INFO`/`NBD_OPT_EXPORT_NAME`, everything else `NBD_REP_ERR_UNSUP`,
//! so simple replies only) runs on a blocking acceptor thread, which then hands the
//! socket to the ring thread. Transmission: READ, FLUSH (a no-op: nothing is written)
//! and DISC; anything else gets `EINVAL`. Buffers: a READ's buffer belongs to its
//! connection's slot from submission until the send that carries it completes.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::mpsc;

use io_uring::{opcode, types, IoUring};

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const RECV_BUF: usize = 64 * 1024;
const MAX_READ: u32 = 32 << 20;
/// Replies gathered into one `sendmsg`.
const MAX_IOVECS: usize = 64;

// user_data: kind in the top byte, connection in the next 24 bits, slot in the low 32.
const K_RECV: u64 = 1;
const K_READ: u64 = 2;
const K_SEND: u64 = 3;
const K_WAKE: u64 = 4;

fn ud(kind: u64, conn: usize, slot: usize) -> u64 {
    (kind << 56) | ((conn as u64) << 32) | slot as u64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: uring-proto FILE PORT");
        std::process::exit(2);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&args[1])
        .unwrap_or_else(|e| panic!("open {}: {e}", args[1]));
    let size = file.metadata().expect("stat").len();
    let listener = TcpListener::bind(("127.0.0.1", args[2].parse::<u16>().expect("port"))).expect("bind");
    // SAFETY: eventfd returns a new fd or -1 (checked).
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(efd >= 0, "eventfd");
    // SAFETY: efd is a fresh fd owned by nobody else.
    let efd = unsafe { OwnedFd::from_raw_fd(efd) };
    let (tx, rx) = mpsc::channel::<TcpStream>();
    let wake = efd.as_raw_fd();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_nodelay(true);
            if handshake(&mut s, size).is_ok() && tx.send(s).is_ok() {
                let one = 1u64;
                // SAFETY: writes 8 bytes from a live u64 to the eventfd main keeps open.
                unsafe { libc::write(wake, (&one as *const u64).cast(), 8) };
            }
        }
    });
    Server::new(file, efd, rx).run();
}

fn read_exact(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

fn option_reply(s: &mut TcpStream, option: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    let mut r = Vec::with_capacity(20 + data.len());
    r.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    r.extend_from_slice(&option.to_be_bytes());
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&(data.len() as u32).to_be_bytes());
    r.extend_from_slice(data);
    s.write_all(&r)
}

/// Fixed newstyle negotiation up to the transmission phase (NBD proto.md).
fn handshake(s: &mut TcpStream, size: u64) -> std::io::Result<()> {
    // HAS_FLAGS | READ_ONLY | SEND_FLUSH | CAN_MULTI_CONN
    let tflags: u16 = 1 | 2 | 4 | (1 << 8);
    let mut hello = b"NBDMAGIC".to_vec();
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&3u16.to_be_bytes()); // FIXED_NEWSTYLE | NO_ZEROES
    s.write_all(&hello)?;
    let cflags = u32_at(&read_exact(s, 4)?, 0);
    loop {
        let h = read_exact(s, 16)?;
        if u64_at(&h, 0) != IHAVEOPT {
            return Err(std::io::Error::other("bad option magic"));
        }
        let (option, len) = (u32_at(&h, 8), u32_at(&h, 12));
        if len > 65536 {
            return Err(std::io::Error::other("option too long"));
        }
        let _data = read_exact(s, len as usize)?;
        match option {
            1 => {
                // NBD_OPT_EXPORT_NAME
                let mut r = size.to_be_bytes().to_vec();
                r.extend_from_slice(&tflags.to_be_bytes());
                if cflags & 2 == 0 {
                    r.extend_from_slice(&[0u8; 124]);
                }
                return s.write_all(&r);
            }
            6 | 7 => {
                // NBD_OPT_INFO, NBD_OPT_GO: NBD_INFO_EXPORT, then ACK.
                let mut info = 0u16.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&tflags.to_be_bytes());
                option_reply(s, option, 3, &info)?;
                option_reply(s, option, 1, &[])?;
                if option == 7 {
                    return Ok(());
                }
            }
            2 => {
                option_reply(s, option, 1, &[])?;
                return Err(std::io::Error::other("client aborted"));
            }
            _ => option_reply(s, option, 0x8000_0001, &[])?,
        }
    }
}

/// A 4 KiB-aligned buffer for O_DIRECT reads.
struct Buf {
    ptr: *mut u8,
    cap: usize,
}

impl Buf {
    fn new(len: usize) -> Buf {
        let cap = len.div_ceil(4096).max(1) * 4096;
        let layout = std::alloc::Layout::from_size_align(cap, 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Buf { ptr, cap }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.cap, 4096).unwrap()) };
    }
}

/// One reply waiting to be sent, or being sent: the 16-byte simple reply header and
/// the READ data after it.
struct Reply {
    header: [u8; 16],
    data: Option<(Buf, usize)>,
}

struct Conn {
    sock: OwnedFd,
    rbuf: Box<[u8; RECV_BUF]>,
    rstart: usize,
    rend: usize,
    /// READs in the kernel: (handle, buffer, length), by slot.
    reads: Vec<Option<(u64, Buf, usize)>>,
    free_reads: Vec<usize>,
    queued: VecDeque<Reply>,
    /// The replies of the `sendmsg` in flight, its iovecs and its header; empty when none.
    sending: Vec<Reply>,
    iovecs: Vec<libc::iovec>,
    msg: Box<libc::msghdr>,
    send_in_flight: bool,
    /// Bytes of the `sendmsg` in flight already sent by earlier, short, completions.
    send_done: usize,
    closing: bool,
    recv_in_flight: bool,
}

struct Server {
    ring: IoUring,
    file: File,
    efd: OwnedFd,
    wake_buf: Box<u64>,
    rx: mpsc::Receiver<TcpStream>,
    conns: Vec<Option<Conn>>,
}

impl Server {
    fn new(file: File, efd: OwnedFd, rx: mpsc::Receiver<TcpStream>) -> Server {
        Server { ring: IoUring::new(1024).expect("io_uring"), file, efd, wake_buf: Box::new(0), rx, conns: Vec::new() }
    }

    fn push(&mut self, e: io_uring::squeue::Entry) {
        // SAFETY: every entry's buffers live in `self.conns` (or `wake_buf`) until its
        // completion is processed; a full queue is drained by submitting first.
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit().expect("io_uring_enter");
        }
    }

    fn arm_wake(&mut self) {
        let p = &mut *self.wake_buf as *mut u64 as *mut u8;
        let e = opcode::Read::new(types::Fd(self.efd.as_raw_fd()), p, 8).build().user_data(ud(K_WAKE, 0, 0));
        self.push(e);
    }

    fn arm_recv(&mut self, c: usize) {
        let conn = self.conns[c].as_mut().unwrap();
        if conn.recv_in_flight || conn.closing {
            return;
        }
        if conn.rstart > 0 {
            conn.rbuf.copy_within(conn.rstart..conn.rend, 0);
            conn.rend -= conn.rstart;
            conn.rstart = 0;
        }
        let room = RECV_BUF - conn.rend;
        let p = conn.rbuf[conn.rend..].as_mut_ptr();
        let fd = conn.sock.as_raw_fd();
        conn.recv_in_flight = true;
        self.push(opcode::Recv::new(types::Fd(fd), p, room as u32).build().user_data(ud(K_RECV, c, 0)));
    }

    fn run(mut self) {
        self.arm_wake();
        loop {
            self.ring.submit_and_wait(1).expect("io_uring_enter");
            let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (u, res) in cqes {
                let (kind, c, slot) = (u >> 56, ((u >> 32) & 0xff_ffff) as usize, (u & 0xffff_ffff) as usize);
                match kind {
                    K_WAKE => self.accept(),
                    K_RECV => self.on_recv(c, res),
                    K_READ => self.on_read(c, slot, res),
                    K_SEND => self.on_send(c, res),
                    _ => unreachable!(),
                }
            }
        }
    }

    fn accept(&mut self) {
        while let Ok(s) = self.rx.try_recv() {
            let conn = Conn {
                sock: s.into(),
                rbuf: Box::new([0; RECV_BUF]),
                rstart: 0,
                rend: 0,
                reads: Vec::new(),
                free_reads: Vec::new(),
                queued: VecDeque::new(),
                sending: Vec::new(),
                iovecs: Vec::with_capacity(2 * MAX_IOVECS),
                // SAFETY: an all-zero msghdr is a valid empty one.
                msg: Box::new(unsafe { std::mem::zeroed() }),
                send_in_flight: false,
                send_done: 0,
                closing: false,
                recv_in_flight: false,
            };
            let c = match self.conns.iter().position(Option::is_none) {
                Some(i) => i,
                None => {
                    self.conns.push(None);
                    self.conns.len() - 1
                }
            };
            self.conns[c] = Some(conn);
            self.arm_recv(c);
        }
        self.arm_wake();
    }

    fn on_recv(&mut self, c: usize, res: i32) {
        let fd = self.file.as_raw_fd();
        let Some(conn) = self.conns[c].as_mut() else { return };
        conn.recv_in_flight = false;
        if res <= 0 {
            conn.closing = true;
            self.maybe_close(c);
            return;
        }
        conn.rend += res as usize;
        let mut entries = Vec::new();
        while conn.rend - conn.rstart >= 28 {
            let h = &conn.rbuf[conn.rstart..conn.rstart + 28];
            let (magic, kind, handle, offset, len) =
                (u32_at(h, 0), u16::from_be_bytes([h[6], h[7]]), u64_at(h, 8), u64_at(h, 16), u32_at(h, 24));
            conn.rstart += 28;
            if magic != REQUEST_MAGIC {
                conn.closing = true;
                break;
            }
            match kind {
                0 if len > 0 && len <= MAX_READ => {
                    let buf = Buf::new(len as usize);
                    let p = buf.ptr;
                    let slot = match conn.free_reads.pop() {
                        Some(s) => s,
                        None => {
                            conn.reads.push(None);
                            conn.reads.len() - 1
                        }
                    };
                    conn.reads[slot] = Some((handle, buf, len as usize));
                    entries.push(
                        opcode::Read::new(types::Fd(fd), p, len).offset(offset).build().user_data(ud(K_READ, c, slot)),
                    );
                }
                2 => conn.closing = true,
                3 => conn.queued.push_back(Reply { header: header(0, handle), data: None }),
                _ => conn.queued.push_back(Reply { header: header(libc::EINVAL as u32, handle), data: None }),
            }
        }
        for e in entries {
            self.push(e);
        }
        self.arm_recv(c);
        self.arm_send(c);
        self.maybe_close(c);
    }

    fn on_read(&mut self, c: usize, slot: usize, res: i32) {
        let conn = self.conns[c].as_mut().unwrap();
        let (handle, buf, len) = conn.reads[slot].take().unwrap();
        conn.free_reads.push(slot);
        let reply = if res as usize == len {
            Reply { header: header(0, handle), data: Some((buf, len)) }
        } else {
            Reply { header: header(libc::EIO as u32, handle), data: None }
        };
        conn.queued.push_back(reply);
        self.arm_send(c);
    }

    fn arm_send(&mut self, c: usize) {
        let conn = self.conns[c].as_mut().unwrap();
        if conn.send_in_flight || conn.queued.is_empty() {
            return;
        }
        conn.sending.clear();
        while conn.sending.len() < MAX_IOVECS {
            let Some(r) = conn.queued.pop_front() else { break };
            conn.sending.push(r);
        }
        conn.send_done = 0;
        self.submit_send(c);
    }

    /// Submits the rest of `sending` (after `send_done` bytes) as one `sendmsg`.
    fn submit_send(&mut self, c: usize) {
        let conn = self.conns[c].as_mut().unwrap();
        conn.iovecs.clear();
        let mut skip = conn.send_done;
        for r in &conn.sending {
            let mut parts: [(*const u8, usize); 2] = [(r.header.as_ptr(), 16), (std::ptr::null(), 0)];
            if let Some((b, len)) = &r.data {
                parts[1] = (b.ptr, *len);
            }
            for (p, l) in parts {
                if l == 0 {
                    continue;
                }
                if skip >= l {
                    skip -= l;
                    continue;
                }
                // SAFETY: `skip < l` bytes into a live buffer of `l` bytes.
                conn.iovecs.push(libc::iovec { iov_base: unsafe { p.add(skip) } as *mut _, iov_len: l - skip });
                skip = 0;
            }
        }
        conn.msg.msg_iov = conn.iovecs.as_mut_ptr();
        conn.msg.msg_iovlen = conn.iovecs.len();
        conn.send_in_flight = true;
        let e = opcode::SendMsg::new(types::Fd(conn.sock.as_raw_fd()), &*conn.msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(ud(K_SEND, c, 0));
        self.push(e);
    }

    fn on_send(&mut self, c: usize, res: i32) {
        let conn = self.conns[c].as_mut().unwrap();
        conn.send_in_flight = false;
        if res < 0 {
            conn.closing = true;
            conn.queued.clear();
            conn.sending.clear();
            self.maybe_close(c);
            return;
        }
        let total: usize = conn.sending.iter().map(|r| 16 + r.data.as_ref().map_or(0, |d| d.1)).sum();
        conn.send_done += res as usize;
        if conn.send_done < total {
            self.submit_send(c);
            return;
        }
        conn.sending.clear();
        self.arm_send(c);
        self.maybe_close(c);
    }

    fn maybe_close(&mut self, c: usize) {
        let conn = self.conns[c].as_ref().unwrap();
        let busy = conn.recv_in_flight
            || conn.send_in_flight
            || !conn.queued.is_empty()
            || conn.reads.iter().any(Option::is_some);
        if conn.closing && !busy {
            let conn = self.conns[c].take().unwrap();
            drop(TcpStream::from(conn.sock));
        } else if conn.closing && conn.recv_in_flight {
            // Wake the pending receive so the connection can end.
            let fd = conn.sock.as_raw_fd();
            // SAFETY: shuts down a socket this connection owns.
            unsafe { libc::shutdown(fd, libc::SHUT_RD) };
        }
    }
}

fn header(error: u32, handle: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&error.to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h
}
