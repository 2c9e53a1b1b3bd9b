//! A thin pool running out of space: allocating writes get ENOSPC, overwrites of
//! written data keep working, nothing written before is lost, trimming gives space
//! back, and the pool stays consistent (`ferrovol check` clean).

mod common;

use common::*;

fn status_u64(s: &Server, field: &str) -> u64 {
    let st = s.pool_status();
    st[field].as_u64().unwrap_or_else(|| panic!("pool status has no {field}: {st}"))
}

/// The qemu-io pattern byte of 1 MiB chunk `i`.
fn pat(i: u64) -> u64 {
    1 + (i * 7) % 250
}

/// qemu-io reads verifying the volume after the fill and the overwrites: chunk i of
/// [0, k) MiB holds pat(i), except chunk 0 (0xee), pieces of chunks 2 and 3, and, once
/// `trimmed`, chunks 4..8 (zeros); space past the fill reads as zeros.
fn expected_reads(k: u64, trimmed: bool) -> Vec<String> {
    let mut r = vec!["read -P 0xee 0 1M".to_owned()];
    r.push(format!("read -P {} {} 100", pat(2), 2 * MIB));
    r.push(format!("read -P 0xdd {} 1000", 2 * MIB + 100));
    r.push(format!("read -P {} {} {}", pat(2), 2 * MIB + 1100, MIB - 1100));
    r.push(format!("read -P {} {} 65535", pat(3), 3 * MIB));
    r.push(format!("read -P 0xcc {} 1", 3 * MIB + 65535));
    r.push(format!("read -P {} {} {}", pat(3), 3 * MIB + 65536, MIB - 65536));
    for i in 4..k {
        if trimmed && i < 8 {
            r.push(format!("read -P 0 {} 1M", i * MIB));
        } else {
            r.push(format!("read -P {} {} 1M", pat(i), i * MIB));
        }
    }
    r.push(format!("read -P 0 {} 1M", 900 * MIB));
    r.push(format!("read -P 0 {} 1M", GIB - MIB));
    r
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn enospc_then_overwrites_work_and_nothing_is_lost() {
    // On a full pool allocating writes get ENOSPC, overwrites work, nothing written is lost, and a trim makes room.
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "64MiB", &[]);
    let capacity = status_u64(&s, "capacity_bytes");
    assert!((32 * MIB..=64 * MIB).contains(&capacity), "capacity of a 64 MiB pool: {capacity}");
    assert_eq!(status_u64(&s, "used_bytes"), 0, "used bytes of a new pool");
    s.create_volume("big", "1GiB");
    let info = json(&s.cli_ok(&["volume", "info", "big", "--json"]));
    assert_eq!(info["size_bytes"].as_u64(), Some(GIB), "a thin volume may be larger than the pool: {info}");
    let uri = s.uri("big");

    // fill, 1 MiB at a time, until a write is refused
    let mut full_at = None;
    for i in 0..(capacity / MIB + 8) {
        let o = qemu_io(&uri, &[&format!("write -P {} {} 1M", pat(i), i * MIB)]);
        if !qemu_io_succeeded(&o) {
            assert!(
                text(&o).contains("No space left on device"),
                "write {i} failed, but not with ENOSPC:\n{}",
                text(&o)
            );
            full_at = Some(i);
            break;
        }
    }
    let k = full_at
        .unwrap_or_else(|| panic!("{} MiB written to a pool of {capacity} bytes without ENOSPC", capacity / MIB + 8));
    assert!(k * MIB <= capacity, "wrote {k} MiB into a pool of {capacity} bytes");
    assert!(k * MIB + 8 * MIB >= capacity, "ENOSPC after only {k} MiB of a {capacity} byte pool");
    assert!(s.is_running(), "server died at ENOSPC");
    // the failed 1 MiB write may have needed more units than were left: fill what
    // remains one data unit at a time, into chunk k
    let unit = status_u64(&s, "unit_size_bytes");
    let mut units = 0;
    loop {
        assert!(units < MIB / unit, "chunk {k} filled completely after a 1 MiB write into it failed");
        let o = qemu_io(&uri, &[&format!("write -P {} {} {unit}", pat(k), k * MIB + units * unit)]);
        if !qemu_io_succeeded(&o) {
            assert!(
                text(&o).contains("No space left on device"),
                "unit write failed, but not with ENOSPC:\n{}",
                text(&o)
            );
            break;
        }
        units += 1;
    }
    let used = status_u64(&s, "used_bytes");
    assert!(
        used <= capacity && used >= k * MIB + units * unit,
        "used {used} after writing {k} MiB + {units} units (capacity {capacity})"
    );

    // more allocating writes fail the same way: small, unaligned, far away, zero-with-no-unmap
    for cmd in [
        format!("write -P 0x01 {} 4096", 900 * MIB),
        format!("write -P 0x02 {} 10", 700 * MIB + 3),
        format!("write -P 0x03 {} 2M", (k + 1) * MIB),
        format!("write -P 0x04 {} 4096", k * MIB + units * unit),
        format!("write -z {} 4096", 800 * MIB), // zeroes without unmap must allocate
    ] {
        let o = qemu_io(&uri, &[&cmd]);
        assert!(text(&o).contains("No space left on device"), "{cmd} on a full pool:\n{}", text(&o));
    }

    // overwrites of written data succeed: whole chunks, unaligned pieces, single bytes
    qemu_io_ok(
        &uri,
        &[
            "write -P 0xee 0 1M",
            "read -P 0xee 0 1M",
            &format!("write -P 0xdd {} 1000", 2 * MIB + 100),
            &format!("read -P 0xdd {} 1000", 2 * MIB + 100),
            &format!("write -f -P 0xcc {} 1", 3 * MIB + 65535),
            "flush",
        ],
    );

    // everything written before the failure reads back
    let mut reads = expected_reads(k, false);
    if units > 0 {
        reads.push(format!("read -P {} {} {}", pat(k), k * MIB, units * unit));
    }
    qemu_io_ok(&uri, &refs(&reads));

    // trimming 4 MiB and flushing makes room for new allocating writes
    let free_before = status_u64(&s, "free_bytes");
    qemu_io_ok(&uri, &[&format!("discard {} 4M", 4 * MIB), "flush", &format!("read -P 0 {} 4M", 4 * MIB)]);
    let free_after = status_u64(&s, "free_bytes");
    assert!(free_after >= free_before + 4 * MIB, "free bytes after trimming 4 MiB: {free_before} -> {free_after}");
    qemu_io_ok(
        &uri,
        &[&format!("write -P 0x99 {} 2M", (k + 1) * MIB), &format!("read -P 0x99 {} 2M", (k + 1) * MIB), "flush"],
    );

    // the pool is consistent, and the data survives a restart
    s.stop();
    check_clean(&td.data());
    s.restart();
    let uri = s.uri("big"); // a restarted server listens on a new port
    let mut after = expected_reads(k, true);
    if units > 0 {
        after.push(format!("read -P {} {} {}", pat(k), k * MIB, units * unit));
    }
    after.push(format!("read -P 0x99 {} 2M", (k + 1) * MIB));
    qemu_io_ok(&uri, &refs(&after));
    s.stop();
    check_clean(&td.data());
}

#[test]
fn concurrent_writers_hit_enospc_and_pool_stays_consistent() {
    // Parallel writers filling the pool get errors, the server survives, and the pool's accounting stays consistent.
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "64MiB", &["--unit-size", "16KiB"]);
    let capacity = status_u64(&s, "capacity_bytes");
    s.create_volume("a", "1GiB");
    s.create_volume("b", "1GiB");
    qemu_io_ok(&s.uri("b"), &["write -P 0x0b 512M 8M", "flush"]);
    let src = td.path().join("src.bin");
    std::fs::write(&src, random_bytes(96 * MIB as usize)).unwrap();
    let mut copy = peer("nbdcopy");
    copy.args(["--connections=4", "--requests=16"]).arg(&src).arg(s.uri("a"));
    let copy = copy
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let fio_uri = format!("--uri={}", s.uri("b"));
    let fio = output(peer("fio").current_dir(td.path()).args([
        "--name=f",
        "--ioengine=nbd",
        &fio_uri,
        "--rw=randwrite",
        "--bs=64k",
        "--iodepth=8",
        "--numjobs=2",
        "--size=96m",
    ]));
    let copy = copy.wait_with_output().unwrap();
    assert!(!copy.status.success(), "nbdcopy of 96 MiB into a {capacity} byte pool succeeded:\n{}", text(&copy));
    let fio_text = text(&fio);
    assert!(
        !fio.status.success() || fio_text.contains("No space left") || fio_text.contains("err=28"),
        "fio on a full pool saw no error:\n{fio_text}"
    );
    assert!(s.is_running(), "server died at ENOSPC:\n{}", s.log_text());

    // accounting: used never above capacity, and equal to what the volumes hold
    let st = s.pool_status();
    let used = st["used_bytes"].as_u64().unwrap();
    let free = st["free_bytes"].as_u64().unwrap();
    let meta = st["metadata_bytes"].as_u64().unwrap();
    assert!(used <= capacity, "used {used} > capacity {capacity}");
    assert_eq!(used + free + meta, capacity, "used + free + metadata != capacity: {st}");
    // What stopped the writers is the metadata reserve: free space beyond it is less
    // than a few writes' worth.
    let reserved = st["reserved_bytes"].as_u64().unwrap();
    assert!(reserved > 0 && reserved <= free && free - reserved < MIB, "free and reserved at ENOSPC: {st}");
    let allocated: u64 = s.volumes().as_array().unwrap().iter().map(|v| v["allocated_bytes"].as_u64().unwrap()).sum();
    assert_eq!(allocated, used, "volumes' allocated bytes vs pool used bytes: {st}");

    // the server still serves: overwrite what nbdcopy wrote at the start of "a"
    let o = qemu_io(&s.uri("a"), &["read 0 4096"]);
    assert!(qemu_io_succeeded(&o), "read after ENOSPC: {}", text(&o));
    let map = output(peer("nbdinfo").args(["--map", "--json", &s.uri("a")]));
    let ext = json(&String::from_utf8_lossy(&map.stdout));
    let first_data = ext.as_array().unwrap().iter().find(|e| e["type"].as_u64() == Some(0)).cloned();
    if let Some(e) = first_data {
        let off = e["offset"].as_u64().unwrap();
        qemu_io_ok(&s.uri("a"), &[&format!("write -P 0x5e {off} 4096"), &format!("read -P 0x5e {off} 4096"), "flush"]);
    }
    s.stop();
    check_clean(&td.data());
    s.restart();
    let b_alloc = json(&s.cli_ok(&["volume", "info", "b", "--json"]))["allocated_bytes"].as_u64().unwrap();
    assert!(b_alloc >= 8 * MIB, "volume b holds {b_alloc} bytes");
    let free = status_u64(&s, "free_bytes");
    s.cli_ok(&["volume", "delete", "b"]);
    qemu_io_ok(&s.uri("a"), &["flush"]);
    let free_after = status_u64(&s, "free_bytes");
    assert!(free_after >= free + b_alloc, "deleting a volume of {b_alloc} bytes: free {free} -> {free_after}");
    // and the space is usable: a fresh 8 MiB write to "a" succeeds
    qemu_io_ok(&s.uri("a"), &["write -P 0x6a 900M 8M", "read -P 0x6a 900M 8M"]);
    s.stop();
    check_clean(&td.data());
}

/// A full pool grown online through the CLI takes the writes it refused, keeps what it
/// held, refuses to shrink with a clear error, and is still grown after a kill -9.
#[test]
fn a_full_pool_grown_through_the_cli_takes_more_writes() {
    let td = TestDir::new();
    let mut s = Server::start_with(&td.data(), "32MiB", &[]);
    let capacity = status_u64(&s, "capacity_bytes");
    assert_eq!(status_u64(&s, "size_bytes"), 32 * MIB);
    s.create_volume("v", "1GiB");
    let uri = s.uri("v");
    let mut k = 0;
    while qemu_io_succeeded(&qemu_io(&uri, &[&format!("write -P {} {} 1M", pat(k), k * MIB)])) {
        k += 1;
        assert!(k * MIB <= capacity, "{k} MiB written into a pool of {capacity} bytes");
    }
    let refused = qemu_io(&uri, &[&format!("write -P {} {} 1M", pat(k), k * MIB)]);
    assert!(text(&refused).contains("No space left on device"), "{}", text(&refused));

    let err = s.cli_err(&["pool", "grow", "--size", "0"]);
    assert!(err.contains("not a pool size"), "--size 0: {err}");
    let err = s.cli_err(&["pool", "grow", "--size", "16MiB"]);
    assert!(err.contains("never shrinks"), "a smaller size: {err}");
    assert_eq!(status_u64(&s, "size_bytes"), 32 * MIB, "a refused grow changes nothing");
    let out = s.cli_ok(&["pool", "grow", "--size", "96MiB"]);
    assert!(out.contains("pool grown from 32.0 MiB to 96.0 MiB"), "{out}");
    assert_eq!(status_u64(&s, "capacity_bytes"), capacity + 64 * MIB);
    assert_eq!(std::fs::metadata(s.pool_path()).unwrap().len(), 96 * MIB, "the pool file is lengthened");
    let again = s.cli_ok(&["pool", "grow"]);
    assert!(again.contains("nothing to grow"), "{again}");

    // The writes it refused now fit, up to what it held before and as much again.
    let more = k + 2 * (capacity / MIB) / 3;
    for i in k..more {
        let o = qemu_io(&uri, &[&format!("write -P {} {} 1M", pat(i), i * MIB), "flush"]);
        assert!(qemu_io_succeeded(&o), "write {i} into the grown pool: {}", text(&o));
    }
    s.kill9();
    s.restart();
    assert_eq!(status_u64(&s, "size_bytes"), 96 * MIB, "the grown size after a kill -9");
    let reads: Vec<String> = (0..more).map(|i| format!("read -P {} {} 1M", pat(i), i * MIB)).collect();
    let o = qemu_io(&s.uri("v"), &refs(&reads));
    assert!(qemu_io_succeeded(&o), "data after the grow and the kill: {}", text(&o));
    s.stop();
    check_clean(&td.data());
    // A restart with a larger --pool-size grows the pool file; a smaller one keeps it.
    let mut s = Server::start_with(&td.data(), "128MiB", &[]);
    assert_eq!(status_u64(&s, "size_bytes"), 128 * MIB, "serve --pool-size larger than the pool");
    s.stop();
    let mut s = Server::start_with(&td.data(), "64MiB", &[]);
    assert_eq!(status_u64(&s, "size_bytes"), 128 * MIB, "serve --pool-size smaller than the pool");
    let o = qemu_io(&s.uri("v"), &refs(&reads));
    assert!(qemu_io_succeeded(&o), "data after the restarts: {}", text(&o));
    s.stop();
    check_clean(&td.data());
}
