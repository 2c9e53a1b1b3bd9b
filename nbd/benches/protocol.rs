//! Protocol hot paths: request decode and reply encode (`nbd::proto`), and 4 KiB READs
//! through a whole server connection (header parse, validation, budget, the export
//! call, reply encode, the writer) over an in-memory pipe against the in-memory export,
//! at queue depth 1 and 32.
//!
//!     cargo bench -p nbd --bench protocol
//!
//! No root needed. The connection figures include the client's own work (a tokio
//! client on the same runtime as the server); compare them only with runs on the same
//! machine.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nbd::proto::*;
use nbd::{Extent, ServerConfig};

fn wire(c: &mut Criterion) {
    let mut g = c.benchmark_group("wire");
    let req = Request { flags: NBD_CMD_FLAG_FUA, command: Command::Write, handle: 7, offset: 1 << 30, length: 4096 };
    let bytes = req.encode();
    g.bench_function("request_parse", |b| b.iter(|| Request::parse(std::hint::black_box(&bytes)).unwrap()));
    g.bench_function("simple_reply_encode", |b| {
        b.iter(|| SimpleReply { error: 0, handle: std::hint::black_box(7) }.encode())
    });
    g.bench_function("offset_data_header_encode", |b| {
        b.iter(|| encode_offset_data_header(std::hint::black_box(7), 1 << 30, 4096, true))
    });
    // Block status of 64 alternating runs (a fragmented 4 MiB range).
    let extents: Vec<Extent> = (0..64).map(|i| Extent { length: 65536, hole: i % 2 == 1, zero: i % 2 == 1 }).collect();
    let descriptors: Vec<BlockDescriptor> =
        extents.iter().map(|e| BlockDescriptor { length: e.length as u32, status: allocation_status(e) }).collect();
    g.bench_function("block_status_64_descriptors_encode", |b| {
        b.iter(|| encode_block_status(std::hint::black_box(7), 1, &descriptors, true))
    });
    g.finish();
}

fn connection(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let registry = Arc::new(MemRegistry::default().with("disk", MemExport::new(64 << 20)));
    let (mut client, _task) = rt.block_on(async {
        let (mut client, task) = start(registry, ServerConfig::default());
        connect(&mut client, "disk", false, false).await;
        (client, task)
    });
    let lens: HashMap<u64, usize> = (0..32).map(|h| (h, 4096)).collect();
    let mut g = c.benchmark_group("connection");
    for depth in [1u64, 32] {
        g.throughput(Throughput::Elements(depth));
        g.bench_function(format!("read_4k_qd{depth}"), |b| {
            let mut next = 0u64;
            b.iter(|| {
                rt.block_on(async {
                    for h in 0..depth {
                        next = (next + 1) % 16384;
                        send_request(&mut client, Command::Read, 0, h, next * 4096, 4096).await;
                    }
                    for _ in 0..depth {
                        read_msg(&mut client, &lens).await;
                    }
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, wire, connection);
criterion_main!(benches);
