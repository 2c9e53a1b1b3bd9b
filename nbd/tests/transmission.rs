//! Transmission phase: commands, validation, simple and structured replies, block
//! status, concurrency and disconnects, against the in-memory export.

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry, BLOCK};
use nbd::proto::*;
use nbd::ServerConfig;
use tokio::io::{AsyncWriteExt, DuplexStream};

const SIZE: u64 = 1 << 24;
const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const ENOTSUP: u32 = 95;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

async fn open_with(
    registry: Arc<MemRegistry>,
    config: ServerConfig,
    name: &str,
    structured: bool,
    meta: bool,
) -> (DuplexStream, ServerTask, Session) {
    let (mut c, task) = start(registry, config);
    let session = connect(&mut c, name, structured, meta).await;
    (c, task, session)
}

fn disk_registry(export: MemExport) -> Arc<MemRegistry> {
    Arc::new(MemRegistry::default().with("disk", export))
}

async fn open(structured: bool, meta: bool) -> (DuplexStream, ServerTask, Arc<MemRegistry>) {
    let registry = disk_registry(MemExport::new(SIZE));
    let (c, task, session) = open_with(Arc::clone(&registry), ServerConfig::default(), "disk", structured, meta).await;
    assert_eq!(session.size, SIZE);
    (c, task, registry)
}

async fn disconnect(mut c: DuplexStream, task: ServerTask) {
    send_request(&mut c, Command::Disc, 0, u64::MAX, 0, 0).await;
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn simple_write_read_flush() {
    let (mut c, task, registry) = open(false, false).await;
    let data = pattern(8192, 1);
    send_write(&mut c, 0, 1, 4096, &data).await;
    assert_eq!(simple_reply(&mut c, 1, 0).await, (0, vec![]));
    send_write(&mut c, NBD_CMD_FLAG_FUA, 2, 100, b"fua").await;
    assert_eq!(simple_reply(&mut c, 2, 0).await.0, 0);
    send_request(&mut c, Command::Read, 0, 3, 4096, 8192).await;
    let (err, got) = simple_reply(&mut c, 3, 8192).await;
    assert_eq!(err, 0);
    assert_eq!(got, data);
    send_request(&mut c, Command::Flush, 0, 4, 0, 0).await;
    assert_eq!(simple_reply(&mut c, 4, 0).await.0, 0);
    assert_eq!(registry.get("disk").flushes.load(Ordering::SeqCst), 1);
    assert_eq!(registry.get("disk").snapshot(100..103), b"fua");
    // FUA on a read and CACHE are accepted
    send_request(&mut c, Command::Read, NBD_CMD_FLAG_FUA, 5, 100, 3).await;
    assert_eq!(simple_reply(&mut c, 5, 3).await, (0, b"fua".to_vec()));
    send_request(&mut c, Command::Cache, 0, 6, 0, 4096).await;
    assert_eq!(simple_reply(&mut c, 6, 0).await.0, 0);
    disconnect(c, task).await;
}

#[tokio::test]
async fn structured_write_read() {
    let (mut c, task, _) = open(true, false).await;
    let data = pattern(BLOCK as usize * 2, 7);
    send_write(&mut c, 0, 1, 0, &data).await;
    // non-READ success may use a simple reply even with structured replies
    assert_eq!(simple_reply(&mut c, 1, 0).await.0, 0);
    send_request(&mut c, Command::Read, 0, 2, 0, data.len() as u32).await;
    let chunks = structured_reply(&mut c, 2).await;
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].0.flags, NBD_REPLY_FLAG_DONE);
    let (got, types) = assemble_read(&chunks, 0, data.len());
    assert_eq!(types, vec![NBD_REPLY_TYPE_OFFSET_DATA]);
    assert_eq!(got, data);
    disconnect(c, task).await;
}

#[tokio::test]
async fn offset_hole_chunks_for_holes() {
    let (mut c, task, _) = open(true, false).await;
    let data = pattern(BLOCK as usize, 3);
    send_write(&mut c, 0, 1, BLOCK, &data).await;
    simple_reply(&mut c, 1, 0).await;
    // hole | data | hole, with unaligned edges
    let (offset, len) = (1000u64, 3 * BLOCK as usize);
    send_request(&mut c, Command::Read, 0, 2, offset, len as u32).await;
    let chunks = structured_reply(&mut c, 2).await;
    let (got, types) = assemble_read(&chunks, offset, len);
    assert_eq!(types, vec![NBD_REPLY_TYPE_OFFSET_HOLE, NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_TYPE_OFFSET_HOLE]);
    // only the last chunk is flagged DONE
    let flags: Vec<u16> = chunks.iter().map(|(h, _)| h.flags).collect();
    assert_eq!(flags, vec![0, 0, NBD_REPLY_FLAG_DONE]);
    let hole = &chunks[0].1;
    assert_eq!(u64::from_be_bytes(hole[..8].try_into().unwrap()), 1000);
    assert_eq!(u32::from_be_bytes(hole[8..].try_into().unwrap()), (BLOCK - 1000) as u32);
    let mut expected = vec![0u8; len];
    let at = (BLOCK - offset) as usize;
    expected[at..at + BLOCK as usize].copy_from_slice(&data);
    assert_eq!(got, expected);

    // with DF the same read is one data chunk, zeros included
    send_request(&mut c, Command::Read, NBD_CMD_FLAG_DF, 3, offset, len as u32).await;
    let chunks = structured_reply(&mut c, 3).await;
    let (got, types) = assemble_read(&chunks, offset, len);
    assert_eq!(types, vec![NBD_REPLY_TYPE_OFFSET_DATA]);
    assert_eq!(got, expected);
    disconnect(c, task).await;
}

#[tokio::test]
async fn out_of_range_keeps_connection_usable() {
    for structured in [false, true] {
        let (mut c, task, _) = open(structured, false).await;
        let cases = [
            (Command::Read, SIZE - 10, 20, EINVAL),
            (Command::Trim, SIZE, 1, EINVAL),
            (Command::Cache, u64::MAX - 1, 2, EINVAL),
            (Command::WriteZeroes, SIZE - 1, 2, ENOSPC),
        ];
        for (i, (cmd, offset, len, expected)) in cases.into_iter().enumerate() {
            let handle = 100 + i as u64;
            send_request(&mut c, cmd, 0, handle, offset, len).await;
            let errno = if structured {
                let (errno, message) = chunk_error(&structured_reply(&mut c, handle).await);
                assert!(message.contains("end of the export"), "{message}");
                errno
            } else {
                simple_reply(&mut c, handle, 0).await.0
            };
            assert_eq!(errno, expected, "{cmd:?} structured={structured}");
        }
        // a write past the end: ENOSPC, payload consumed
        send_write(&mut c, 0, 7, SIZE - 2, b"abcd").await;
        let errno = if structured {
            chunk_error(&structured_reply(&mut c, 7).await).0
        } else {
            simple_reply(&mut c, 7, 0).await.0
        };
        assert_eq!(errno, ENOSPC);
        // still in sync
        send_write(&mut c, 0, 8, SIZE - 4, b"tail").await;
        assert_eq!(simple_reply(&mut c, 8, 0).await.0, 0);
        send_request(&mut c, Command::Read, 0, 9, SIZE - 4, 4).await;
        if structured {
            let (got, _) = assemble_read(&structured_reply(&mut c, 9).await, SIZE - 4, 4);
            assert_eq!(got, b"tail");
        } else {
            assert_eq!(simple_reply(&mut c, 9, 4).await, (0, b"tail".to_vec()));
        }
        disconnect(c, task).await;
    }
}

#[tokio::test]
async fn zero_length_requests_are_einval() {
    let (mut c, task, _) = open(false, false).await;
    send_request(&mut c, Command::Read, 0, 1, 0, 0).await;
    assert_eq!(simple_reply(&mut c, 1, 0).await, (EINVAL, vec![]));
    send_request(&mut c, Command::Write, 0, 2, 0, 0).await;
    assert_eq!(simple_reply(&mut c, 2, 0).await, (EINVAL, vec![]));
    disconnect(c, task).await;
}

#[tokio::test]
async fn oversized_write_is_discarded_without_allocating() {
    let registry = disk_registry(MemExport::new(SIZE));
    let (mut c, task, session) = open_with(Arc::clone(&registry), ServerConfig::default(), "disk", false, false).await;
    let max = session.block_size.2;
    assert_eq!(max, 1 << 20);
    let big = 8 * max as usize;
    // send header and payload concurrently with reading the reply
    let payload = vec![0xAB; big];
    send_request(&mut c, Command::Write, 0, 1, 0, big as u32).await;
    c.write_all(&payload).await.unwrap();
    assert_eq!(simple_reply(&mut c, 1, 0).await.0, EINVAL);
    // oversized read too
    send_request(&mut c, Command::Read, 0, 2, 0, max + 1).await;
    assert_eq!(simple_reply(&mut c, 2, 0).await, (EINVAL, vec![]));
    // the connection is usable and nothing was written
    send_request(&mut c, Command::Read, 0, 3, 0, 16).await;
    assert_eq!(simple_reply(&mut c, 3, 16).await, (0, vec![0; 16]));
    let export = registry.get("disk");
    assert_eq!(export.max_write_alloc.load(Ordering::SeqCst), 0, "no buffer for the rejected write");
    // a maximum-sized write is fine
    send_write(&mut c, 0, 4, 0, &vec![1; max as usize]).await;
    assert_eq!(simple_reply(&mut c, 4, 0).await.0, 0);
    assert_eq!(export.max_write_alloc.load(Ordering::SeqCst), u64::from(max));
    disconnect(c, task).await;
}

#[tokio::test]
async fn bad_request_magic_disconnects() {
    let (mut c, task, _) = open(false, false).await;
    let mut header = Request { flags: 0, command: Command::Read, handle: 1, offset: 0, length: 512 }.encode();
    header[0] = 0x12;
    c.write_all(&header).await.unwrap();
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))));
}

#[tokio::test]
async fn bad_magic_still_answers_requests_in_flight() {
    let export = MemExport::new(SIZE).with_read_delay(|_| Duration::from_millis(100));
    let registry = disk_registry(export);
    let (mut c, task, _) = open_with(registry, ServerConfig::default(), "disk", false, false).await;
    send_request(&mut c, Command::Read, 0, 1, 0, 8).await;
    c.write_all(&[0u8; REQUEST_HEADER_LEN]).await.unwrap();
    assert_eq!(simple_reply(&mut c, 1, 8).await, (0, vec![0; 8]));
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Protocol(_))));
}

#[tokio::test]
async fn a_panicking_handler_ends_only_its_connection() {
    // A read of the first block panics inside the export; one of block 1 is slow.
    let mut export =
        MemExport::new(SIZE).with_read_delay(|off| Duration::from_millis(if off == BLOCK { 200 } else { 0 }));
    export.panic_on_read = Some(0..BLOCK);
    let registry = disk_registry(export);
    let (mut other, other_task, _) =
        open_with(Arc::clone(&registry), ServerConfig::default(), "disk", false, false).await;
    let (mut c, task, _) = open_with(registry, ServerConfig::default(), "disk", false, false).await;
    send_write(&mut c, 0, 1, BLOCK, &pattern(8, 7)).await;
    assert_eq!(simple_reply(&mut c, 1, 0).await.0, 0);
    send_request(&mut c, Command::Read, 0, 2, BLOCK, 8).await;
    send_request(&mut c, Command::Read, 0, 3, 0, 8).await;
    // The slow read, in flight when its neighbour panicked, is still answered.
    assert_eq!(simple_reply(&mut c, 2, 8).await, (0, pattern(8, 7)));
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::HandlerPanicked)));
    // The other connection to the same export goes on.
    send_write(&mut other, 0, 1, 2 * BLOCK, &pattern(8, 9)).await;
    assert_eq!(simple_reply(&mut other, 1, 0).await.0, 0);
    send_request(&mut other, Command::Read, 0, 2, 2 * BLOCK, 8).await;
    assert_eq!(simple_reply(&mut other, 2, 8).await, (0, pattern(8, 9)));
    disconnect(other, other_task).await;
}

#[tokio::test]
async fn unknown_command_and_bad_flags_are_einval() {
    for structured in [false, true] {
        let (mut c, task, _) = open(structured, false).await;
        let cases = [
            (Command::Unsupported(9), 0u16),
            (Command::Unsupported(0xffff), 0),
            (Command::Write, NBD_CMD_FLAG_DF),
            (Command::Trim, NBD_CMD_FLAG_FAST_ZERO),
            (Command::Read, NBD_CMD_FLAG_REQ_ONE),
            (Command::Flush, NBD_CMD_FLAG_NO_HOLE),
            (Command::Read, 1 << 12),
            // not negotiated
            (Command::BlockStatus, 0),
        ];
        for (i, (cmd, flags)) in cases.into_iter().enumerate() {
            let handle = i as u64;
            // write payloads are consumed even when the request is refused
            let len = if cmd == Command::Write { 3 } else { 512 };
            send_request(&mut c, cmd, flags, handle, 0, len).await;
            if cmd == Command::Write {
                c.write_all(b"xyz").await.unwrap();
            }
            let errno = if structured {
                chunk_error(&structured_reply(&mut c, handle).await).0
            } else {
                simple_reply(&mut c, handle, 0).await.0
            };
            assert_eq!(errno, EINVAL, "{cmd:?} flags {flags:#x}");
        }
        send_request(&mut c, Command::Read, 0, 99, 0, 3).await;
        if structured {
            assert_eq!(assemble_read(&structured_reply(&mut c, 99).await, 0, 3).0, vec![0; 3]);
        } else {
            assert_eq!(simple_reply(&mut c, 99, 3).await, (0, vec![0; 3]));
        }
        disconnect(c, task).await;
    }
}

#[tokio::test]
async fn read_only_export_refuses_writes() {
    let mut export = MemExport::new(SIZE).read_only();
    export.flags.can_trim = true;
    let registry = disk_registry(export);
    let (mut c, task, session) = open_with(registry, ServerConfig::default(), "disk", false, false).await;
    assert_ne!(session.tflags & NBD_FLAG_READ_ONLY, 0);
    send_write(&mut c, 0, 1, 0, b"data").await;
    assert_eq!(simple_reply(&mut c, 1, 0).await.0, EPERM);
    send_request(&mut c, Command::Trim, 0, 2, 0, 4096).await;
    assert_eq!(simple_reply(&mut c, 2, 0).await.0, EPERM);
    send_request(&mut c, Command::WriteZeroes, 0, 3, 0, 4096).await;
    assert_eq!(simple_reply(&mut c, 3, 0).await.0, EPERM);
    send_request(&mut c, Command::Read, 0, 4, 0, 4).await;
    assert_eq!(simple_reply(&mut c, 4, 4).await, (0, vec![0; 4]));
    disconnect(c, task).await;
}

#[tokio::test]
async fn replies_come_out_of_order() {
    // later offsets complete first
    let export = MemExport::new(SIZE).with_read_delay(|offset| Duration::from_millis(20 * (8 - offset / BLOCK).min(8)));
    let registry = disk_registry(export);
    let (mut c, task, _) = open_with(Arc::clone(&registry), ServerConfig::default(), "disk", false, false).await;
    for i in 0..8u64 {
        send_write(&mut c, 0, 1000 + i, i * BLOCK, &pattern(BLOCK as usize, i as u8)).await;
        assert_eq!(simple_reply(&mut c, 1000 + i, 0).await.0, 0);
    }
    let mut lens = HashMap::new();
    for i in 0..8u64 {
        send_request(&mut c, Command::Read, 0, i, i * BLOCK, BLOCK as u32).await;
        lens.insert(i, BLOCK as usize);
    }
    let mut order = Vec::new();
    for _ in 0..8 {
        match read_msg(&mut c, &lens).await {
            Msg::Simple { handle, error, data } => {
                assert_eq!(error, 0);
                assert_eq!(data, pattern(BLOCK as usize, handle as u8));
                order.push(handle);
            }
            other => panic!("{other:?}"),
        }
    }
    let sent: Vec<u64> = (0..8).collect();
    assert_ne!(order, sent, "replies should not come back in send order");
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, sent);
    disconnect(c, task).await;
}

#[tokio::test]
async fn backpressure_still_answers_everything() {
    let export = MemExport::new(SIZE).with_read_delay(|offset| Duration::from_millis(offset % 3));
    let registry = disk_registry(export);
    let config = ServerConfig { max_in_flight_requests: 2, max_in_flight_bytes: 4096, ..Default::default() };
    let (mut c, task, _) = open_with(registry, config, "disk", false, false).await;
    let n = 40u64;
    let mut lens = HashMap::new();
    // the duplex pipe holds 1 MiB: 40 headers fit without the client reading
    for i in 0..n {
        send_request(&mut c, Command::Read, 0, i, i * 8192, 8192).await;
        lens.insert(i, 8192);
    }
    let mut seen = Vec::new();
    for _ in 0..n {
        let m = read_msg(&mut c, &lens).await;
        seen.push(m.handle());
    }
    seen.sort();
    assert_eq!(seen, (0..n).collect::<Vec<_>>());
    disconnect(c, task).await;
}

#[tokio::test]
async fn disc_waits_for_requests_in_flight() {
    let export = MemExport::new(SIZE).with_read_delay(|_| Duration::from_millis(150));
    let registry = disk_registry(export);
    let (mut c, task, _) = open_with(registry, ServerConfig::default(), "disk", true, false).await;
    for i in 0..4u64 {
        send_request(&mut c, Command::Read, 0, i, i * 512, 512).await;
    }
    send_request(&mut c, Command::Disc, 0, 99, 0, 0).await;
    let mut done = Vec::new();
    for _ in 0..4 {
        match read_msg(&mut c, &HashMap::new()).await {
            Msg::Chunk { header, .. } => {
                assert_ne!(header.flags & NBD_REPLY_FLAG_DONE, 0);
                done.push(header.handle);
            }
            other => panic!("{other:?}"),
        }
    }
    done.sort();
    assert_eq!(done, vec![0, 1, 2, 3]);
    expect_closed(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn client_closing_without_disc_is_clean() {
    let (mut c, task, _) = open(false, false).await;
    send_request(&mut c, Command::Flush, 0, 1, 0, 0).await;
    simple_reply(&mut c, 1, 0).await;
    drop(c);
    finish(task).await.unwrap();
}

#[tokio::test]
async fn client_closing_mid_request_is_an_io_error() {
    let (mut c, task, _) = open(false, false).await;
    send_request(&mut c, Command::Write, 0, 1, 0, 100).await;
    c.write_all(&[1; 10]).await.unwrap();
    drop(c);
    assert!(matches!(finish(task).await, Err(nbd::Error::Io(_))));
}

fn descriptors(payload: &[u8]) -> (u32, Vec<(u32, u32)>) {
    let id = u32::from_be_bytes(payload[..4].try_into().unwrap());
    let d = payload[4..]
        .chunks(8)
        .map(|c| (u32::from_be_bytes(c[..4].try_into().unwrap()), u32::from_be_bytes(c[4..].try_into().unwrap())))
        .collect();
    (id, d)
}

#[tokio::test]
async fn block_status() {
    let registry = disk_registry(MemExport::new(SIZE));
    let (mut c, task, session) = open_with(Arc::clone(&registry), ServerConfig::default(), "disk", true, true).await;
    let id = session.context_id.expect("base:allocation negotiated");
    send_write(&mut c, 0, 1, 2 * BLOCK, &pattern(BLOCK as usize, 0)).await;
    simple_reply(&mut c, 1, 0).await;
    let hole = NBD_STATE_HOLE | NBD_STATE_ZERO;
    let b = BLOCK as u32;

    // full map: hole, data, hole
    send_request(&mut c, Command::BlockStatus, 0, 2, 0, 4 * b).await;
    let chunks = structured_reply(&mut c, 2).await;
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].0.chunk_type, NBD_REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(chunks[0].0.flags, NBD_REPLY_FLAG_DONE);
    assert_eq!(descriptors(&chunks[0].1), (id, vec![(2 * b, hole), (b, 0), (b, hole)]));

    // REQ_ONE: exactly one descriptor, not longer than the request
    send_request(&mut c, Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 3, 0, 4 * b).await;
    let chunks = structured_reply(&mut c, 3).await;
    assert_eq!(descriptors(&chunks[0].1), (id, vec![(2 * b, hole)]));
    send_request(&mut c, Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 4, 2 * BLOCK + 100, 200).await;
    let chunks = structured_reply(&mut c, 4).await;
    assert_eq!(descriptors(&chunks[0].1), (id, vec![(200, 0)]));

    // past the end
    send_request(&mut c, Command::BlockStatus, 0, 5, SIZE - 512, 1024).await;
    assert_eq!(chunk_error(&structured_reply(&mut c, 5).await).0, EINVAL);

    // trim turns data back into a hole; write zeroes with NO_HOLE allocates
    send_request(&mut c, Command::Trim, 0, 6, 2 * BLOCK, BLOCK as u32).await;
    assert_eq!(simple_reply(&mut c, 6, 0).await.0, 0);
    send_request(&mut c, Command::WriteZeroes, NBD_CMD_FLAG_NO_HOLE, 7, 0, b).await;
    assert_eq!(simple_reply(&mut c, 7, 0).await.0, 0);
    send_request(&mut c, Command::BlockStatus, 0, 8, 0, 4 * b).await;
    let chunks = structured_reply(&mut c, 8).await;
    assert_eq!(descriptors(&chunks[0].1), (id, vec![(b, 0), (3 * b, hole)]));
    let export = registry.get("disk");
    assert_eq!(export.snapshot(2 * BLOCK as usize..3 * BLOCK as usize), vec![0; BLOCK as usize]);
    disconnect(c, task).await;
}

#[tokio::test]
async fn fast_zero_failure_is_reported() {
    let (mut c, task, _) = open(true, false).await;
    send_request(&mut c, Command::WriteZeroes, NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_NO_HOLE, 1, 0, 4096).await;
    assert_eq!(chunk_error(&structured_reply(&mut c, 1).await).0, ENOTSUP);
    send_request(&mut c, Command::WriteZeroes, NBD_CMD_FLAG_FAST_ZERO, 2, 0, 4096).await;
    assert_eq!(simple_reply(&mut c, 2, 0).await.0, 0);
    disconnect(c, task).await;
}

#[tokio::test]
async fn export_errors_become_error_replies() {
    for structured in [false, true] {
        let mut export = MemExport::new(SIZE);
        export.poison = Some(4096..8192);
        let registry = disk_registry(export);
        let (mut c, task, _) = open_with(registry, ServerConfig::default(), "disk", structured, false).await;
        send_request(&mut c, Command::Read, 0, 1, 4000, 200).await;
        if structured {
            let (errno, message) = chunk_error(&structured_reply(&mut c, 1).await);
            assert_eq!((errno, message.as_str()), (EIO, "read failed"));
        } else {
            // no data follows a simple error reply
            assert_eq!(simple_reply(&mut c, 1, 0).await, (EIO, vec![]));
        }
        send_request(&mut c, Command::Read, 0, 2, 0, 8).await;
        if structured {
            assert_eq!(assemble_read(&structured_reply(&mut c, 2).await, 0, 8).0, vec![0; 8]);
        } else {
            assert_eq!(simple_reply(&mut c, 2, 8).await, (0, vec![0; 8]));
        }
        disconnect(c, task).await;
    }
}

#[tokio::test]
async fn alignment_to_minimum_block_size() {
    let mut export = MemExport::new(SIZE);
    export.sizes.minimum = 512;
    let registry = disk_registry(export);
    let (mut c, task, session) = open_with(registry, ServerConfig::default(), "disk", false, false).await;
    assert_eq!(session.block_size.0, 512);
    send_request(&mut c, Command::Read, 0, 1, 100, 512).await;
    assert_eq!(simple_reply(&mut c, 1, 0).await.0, EINVAL);
    send_write(&mut c, 0, 2, 0, &[1; 100]).await;
    assert_eq!(simple_reply(&mut c, 2, 0).await.0, EINVAL);
    send_request(&mut c, Command::Read, 0, 3, 512, 512).await;
    assert_eq!(simple_reply(&mut c, 3, 512).await, (0, vec![0; 512]));
    disconnect(c, task).await;
}
