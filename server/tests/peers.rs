//! ferrovol volumes driven by independent NBD clients: qemu-io, qemu-img, nbdinfo,
//! nbdcopy and fio's nbd engine, over TCP and the unix socket.

mod common;

use common::*;

/// qemu-io commands writing and verifying patterns: aligned, unaligned (1000, 4097,
/// 8191), straddling a data-unit boundary, and 8 MiB large.
fn pattern_cmds(unit: u64) -> Vec<String> {
    let m = MIB;
    let u = unit; // first unit boundary
    vec![
        // aligned
        "write -P 0x11 0 65536".to_owned(),
        "read -P 0x11 0 65536".to_owned(),
        // unaligned offsets inside a written block
        "write -P 0xab 1000 5000".to_owned(),
        "write -P 0xcd 4097 1".to_owned(),
        "write -P 0x5a 8191 2".to_owned(),
        "read -P 0x11 0 1000".to_owned(),
        "read -P 0xab 1000 3097".to_owned(),
        "read -P 0xcd 4097 1".to_owned(),
        "read -P 0xab 4098 1902".to_owned(),
        "read -P 0x11 6000 2191".to_owned(),
        "read -P 0x5a 8191 2".to_owned(),
        format!("read -P 0x11 8193 {}", 65536 - 8193),
        // unaligned writes into never-written space: the rest reads as zeros
        format!("write -P 0x77 {} 3", m + 1000),
        format!("read -P 0 {m} 1000"),
        format!("read -P 0x77 {} 3", m + 1000),
        format!("read -P 0 {} 4093", m + 1003),
        // straddling a unit boundary in never-written space, then one in a second region
        format!("write -P 0x3c {} 8192", 2 * m + u - 4096),
        format!("read -P 0 {} {}", 2 * m, u - 4096),
        format!("read -P 0x3c {} 8192", 2 * m + u - 4096),
        format!("read -P 0 {} {}", 2 * m + u + 4096, u - 4096),
        format!("write -P 0x3d {} 1001", 3 * m + u - 500),
        format!("read -P 0x3d {} 1001", 3 * m + u - 500),
        format!("read -P 0 {} 500", 3 * m + u - 1000),
        format!("read -P 0 {} 500", 3 * m + u + 501),
        // large: 8 MiB aligned, and 8 MiB + 3 at an odd offset
        format!("write -P 0xa5 {} {}", 8 * m, 8 * m),
        format!("read -P 0xa5 {} {}", 8 * m, 8 * m),
        format!("write -P 0x96 {} {}", 17 * m + 511, 8 * m + 3),
        format!("read -P 0x96 {} {}", 17 * m + 511, 8 * m + 3),
        format!("read -P 0 {} 511", 17 * m),
        format!("read -P 0 {} {}", 25 * m + 514, m - 514),
        // the earlier writes are untouched
        format!("read -P 0xa5 {} 4096", 16 * m - 4096),
        format!("read -P 0x3c {} 8192", 2 * m + u - 4096),
    ]
}

#[test]
fn qemu_io_patterns_read_back() {
    // qemu-io patterns at aligned, unaligned, unit-straddling and large offsets read back exactly, for every unit size.
    for unit in [16 * KIB, 64 * KIB, 128 * KIB] {
        let td = TestDir::new();
        let unit_arg = format!("{}KiB", unit / KIB);
        let s = Server::start_with(&td.data(), "2GiB", &["--unit-size", &unit_arg]);
        assert_eq!(s.pool_status()["unit_size_bytes"].as_u64(), Some(unit), "unit size of the new pool");
        s.create_volume("pat", "64MiB");
        let cmds = pattern_cmds(unit);
        let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
        qemu_io_ok(&s.uri("pat"), &cmds);
        // and again from a fresh connection: nothing was only in a per-connection cache
        // (all reads but the first, which precedes the unaligned overwrites)
        let reads: Vec<&str> = cmds.iter().copied().filter(|c| c.starts_with("read")).skip(1).collect();
        qemu_io_ok(&s.uri("pat"), &reads);
    }
}

#[test]
fn qemu_io_wrong_pattern_is_detected() {
    // A qemu-io read verified against the wrong pattern is reported as a failure (the check can fail).
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("v", "16MiB");
    qemu_io_ok(&s.uri("v"), &["write -P 0x42 4096 65536"]);
    let o = qemu_io(&s.uri("v"), &["read -P 0x43 4096 65536"]);
    assert!(!qemu_io_succeeded(&o), "a read with the wrong pattern passed:\n{}", text(&o));
    assert!(text(&o).contains("Pattern verification failed"), "no pattern failure reported:\n{}", text(&o));
    // one wrong byte in the middle is found too
    qemu_io_ok(&s.uri("v"), &["write -P 0x44 40000 1"]);
    let o = qemu_io(&s.uri("v"), &["read -P 0x42 4096 65536"]);
    assert!(!qemu_io_succeeded(&o), "a single changed byte went unnoticed:\n{}", text(&o));
    // reading unwritten space as non-zero fails as well
    let o = qemu_io(&s.uri("v"), &["read -P 0x01 1M 4096"]);
    assert!(!qemu_io_succeeded(&o), "zeros verified as 0x01:\n{}", text(&o));
}

#[test]
fn nbdinfo_lists_volumes() {
    // nbdinfo --list shows exactly the created volumes, with their sizes and descriptions.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    let vols = [("alpha", "1GiB", GIB), ("beta.2", "4MiB", 4 * MIB), ("Gamma_3-x", "1048576KiB", GIB)];
    for (n, sz, _) in vols {
        s.create_volume(n, sz);
    }
    let o = output(peer("nbdinfo").args(["--list", "--json", &s.base_uri()]));
    assert!(o.status.success(), "nbdinfo --list failed: {}", text(&o));
    let j = json(&String::from_utf8_lossy(&o.stdout));
    let exports = j["exports"].as_array().expect("exports array");
    let mut names: Vec<String> = exports.iter().map(|e| e["export-name"].as_str().unwrap().to_owned()).collect();
    names.sort();
    let mut want: Vec<String> = vols.iter().map(|v| v.0.to_owned()).collect();
    want.sort();
    assert_eq!(names, want, "exports listed by nbdinfo");
    // The server's crash generation, as it wrote it before serving.
    let generation = std::fs::read_to_string(td.data().join("crash-generation")).unwrap();
    let generation = generation.split_whitespace().next().unwrap().to_owned();
    for (n, _, size) in vols {
        let e = exports.iter().find(|e| e["export-name"] == n).unwrap();
        assert_eq!(e["export-size"].as_u64(), Some(size), "size of export {n}");
        // The same description in the list (NBD_OPT_LIST) and for one export (NBD_OPT_INFO).
        let want = format!(
            "ferrovol thin volume {n}, {size} bytes, 64 KiB data units, never written; crash-generation {generation}"
        );
        assert_eq!(e["description"].as_str(), Some(want.as_str()), "listed description of {n}");
        let one = json(&text(&output(peer("nbdinfo").args(["--json", &s.uri(n)]))));
        assert_eq!(one["exports"][0]["description"].as_str(), Some(want.as_str()), "INFO description of {n}");
    }
    // a deleted volume disappears from the list
    s.cli_ok(&["volume", "delete", "beta.2"]);
    let o = output(peer("nbdinfo").args(["--list", "--json", &s.base_uri()]));
    let j = json(&String::from_utf8_lossy(&o.stdout));
    let names: Vec<&str> =
        j["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap()).collect();
    assert!(!names.contains(&"beta.2") && names.len() == 2, "after delete: {names:?}");
}

#[test]
fn nbdinfo_reports_flags_and_size() {
    // nbdinfo --json reports a writable export with flush/FUA/trim/zero/multi-conn/base:allocation and the volume's size.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("flags", "1GiB");
    s.create_volume("odd", "12288");
    for (uri, size) in [(s.uri("flags"), GIB), (s.unix_uri("flags"), GIB), (s.uri("odd"), 12288)] {
        let o = output(peer("nbdinfo").args(["--json", &uri]));
        assert!(o.status.success(), "nbdinfo {uri}: {}", text(&o));
        let j = json(&String::from_utf8_lossy(&o.stdout));
        let e = &j["exports"][0];
        for f in ["can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn"] {
            assert_eq!(e[f], serde_json::Value::Bool(true), "{f} on {uri}: {e}");
        }
        assert_eq!(e["is_read_only"], serde_json::Value::Bool(false), "is_read_only on {uri}");
        let ctx: Vec<&str> = e["contexts"].as_array().expect("contexts").iter().map(|c| c.as_str().unwrap()).collect();
        assert!(ctx.contains(&"base:allocation"), "contexts on {uri}: {ctx:?}");
        assert_eq!(e["export-size"].as_u64(), Some(size), "export-size on {uri}");
    }
    // the size follows a resize
    s.cli_ok(&["volume", "resize", "flags", "--size", "3GiB"]);
    let o = output(peer("nbdinfo").args(["--size", &s.uri("flags")]));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), (3 * GIB).to_string(), "size after resize: {}", text(&o));
}

/// Extents of nbdinfo --map --json: (offset, length, type).
fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, u64)> {
    let o = output(peer("nbdinfo").args(["--map", "--json", uri]));
    assert!(o.status.success(), "nbdinfo --map {uri}: {}", text(&o));
    let j = json(&String::from_utf8_lossy(&o.stdout));
    j.as_array()
        .expect("extent array")
        .iter()
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["type"].as_u64().unwrap()))
        .collect()
}

/// Extents of qemu-img map --output=json: (start, length, data, zero).
fn qemu_img_map(uri: &str) -> Vec<(u64, u64, bool, bool)> {
    let o = output(peer("qemu-img").args(["map", "--output=json", "-f", "raw", uri]));
    assert!(o.status.success(), "qemu-img map {uri}: {}", text(&o));
    let j = json(&String::from_utf8_lossy(&o.stdout));
    j.as_array()
        .expect("extent array")
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
                e["zero"].as_bool().unwrap(),
            )
        })
        .collect()
}

/// The single value `f` takes over all extents overlapping [lo, hi), or None if mixed.
fn uniform<T: Copy + PartialEq, E>(
    ext: &[E],
    span: impl Fn(&E) -> (u64, u64),
    f: impl Fn(&E) -> T,
    lo: u64,
    hi: u64,
) -> Option<T> {
    let vals: Vec<T> = ext
        .iter()
        .filter(|e| {
            let (o, l) = span(e);
            o < hi && o + l > lo
        })
        .map(f)
        .collect();
    let first = *vals.first()?;
    vals.iter().all(|v| *v == first).then_some(first)
}

/// Extents cover [0, size) with no gap or overlap.
fn assert_contiguous(spans: &[(u64, u64)], size: u64, what: &str) {
    let mut pos = 0;
    for &(o, l) in spans {
        assert_eq!(o, pos, "{what}: gap or overlap at {pos}: {spans:?}");
        pos += l;
    }
    assert_eq!(pos, size, "{what}: extents cover {pos} of {size} bytes: {spans:?}");
}

#[test]
fn block_status_maps_holes_and_data() {
    // nbdinfo --map and qemu-img map show written ranges as data and unwritten ranges as zero holes.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    let size = 64 * MIB;
    s.create_volume("map", "64MiB");
    let uri = s.uri("map");
    // a fresh volume is one hole
    let ext = nbdinfo_map(&uri);
    assert_contiguous(&ext.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(), size, "nbdinfo fresh");
    assert!(ext.iter().all(|e| e.2 & 1 == 1), "fresh volume has data extents: {ext:?}");

    qemu_io_ok(&uri, &["write -P 0x61 0 1M", "write -P 0x62 3M 1M"]);
    let m = MIB;

    let ext = nbdinfo_map(&uri);
    assert_contiguous(&ext.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(), size, "nbdinfo --map");
    let hole = |lo, hi| uniform(&ext, |e| (e.0, e.1), |e| e.2 & 1 == 1, lo, hi);
    let zero = |lo, hi| uniform(&ext, |e| (e.0, e.1), |e| e.2 & 2 == 2, lo, hi);
    assert_eq!(hole(0, m), Some(false), "[0,1M) must be data: {ext:?}");
    assert_eq!(hole(m, 3 * m), Some(true), "[1M,3M) must be a hole: {ext:?}");
    assert_eq!(zero(m, 3 * m), Some(true), "[1M,3M) must read as zero: {ext:?}");
    assert_eq!(hole(3 * m, 4 * m), Some(false), "[3M,4M) must be data: {ext:?}");
    assert_eq!(hole(4 * m, size), Some(true), "the unwritten tail must be a hole: {ext:?}");

    let q = qemu_img_map(&uri);
    assert_contiguous(&q.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>(), size, "qemu-img map");
    let data = |lo, hi| uniform(&q, |e| (e.0, e.1), |e| e.2, lo, hi);
    let qzero = |lo, hi| uniform(&q, |e| (e.0, e.1), |e| e.3, lo, hi);
    assert_eq!(data(0, m), Some(true), "qemu-img: [0,1M) data: {q:?}");
    assert_eq!(data(m, 3 * m), Some(false), "qemu-img: [1M,3M) no data: {q:?}");
    assert_eq!(qzero(m, 3 * m), Some(true), "qemu-img: [1M,3M) zero: {q:?}");
    assert_eq!(data(3 * m, 4 * m), Some(true), "qemu-img: [3M,4M) data: {q:?}");
    assert_eq!(data(4 * m, size), Some(false), "qemu-img: tail no data: {q:?}");
    assert_eq!(qzero(4 * m, size), Some(true), "qemu-img: tail zero: {q:?}");

    // the holes really read as zeros, the data as written
    qemu_io_ok(&uri, &["read -P 0x61 0 1M", "read -P 0 1M 2M", "read -P 0x62 3M 1M", "read -P 0 4M 60M"]);

    // discarding [3M,4M) makes it a hole again
    qemu_io_ok(&uri, &["discard 3M 1M", "read -P 0 3M 1M"]);
    let ext = nbdinfo_map(&uri);
    let hole = |lo, hi| uniform(&ext, |e| (e.0, e.1), |e| e.2 & 1 == 1, lo, hi);
    assert_eq!(hole(0, m), Some(false), "after discard, [0,1M) still data: {ext:?}");
    assert_eq!(hole(m, size), Some(true), "after discard, [1M,end) a hole: {ext:?}");
}

#[test]
fn nbdcopy_roundtrip_64mib() {
    // nbdcopy copies 64 MiB of random data to a volume and back unchanged (sha256 equal).
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("copy", "64MiB");
    let src = td.path().join("src.bin");
    let dst = td.path().join("dst.bin");
    std::fs::write(&src, random_bytes(64 * MIB as usize)).unwrap();
    let o = output(peer("nbdcopy").arg(&src).arg(s.uri("copy")));
    assert!(o.status.success(), "nbdcopy file -> nbd: {}", text(&o));
    let o = output(peer("nbdcopy").arg(s.uri("copy")).arg(&dst));
    assert!(o.status.success(), "nbdcopy nbd -> file: {}", text(&o));
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), 64 * MIB, "copied size");
    assert_eq!(sha256(&src), sha256(&dst), "sha256 of the data copied through the volume");
    // and through the unix socket, with several connections and requests in flight
    let dst2 = td.path().join("dst2.bin");
    let o = output(peer("nbdcopy").args(["--connections=4", "--requests=16"]).arg(s.unix_uri("copy")).arg(&dst2));
    assert!(o.status.success(), "nbdcopy unix -> file: {}", text(&o));
    assert_eq!(sha256(&src), sha256(&dst2), "sha256 over the unix socket");
}

#[test]
fn fio_randwrite_verify() {
    // fio's nbd engine writes 32 MiB of random 4K blocks at queue depth 16 and verifies them by crc32c.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("fio", "64MiB");
    let uri = format!("--uri={}", s.uri("fio"));
    let o = output(peer("fio").current_dir(td.path()).args([
        "--name=v",
        "--ioengine=nbd",
        &uri,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=32m",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
    ]));
    let t = text(&o);
    assert!(o.status.success(), "fio failed ({}):\n{t}", o.status);
    assert!(t.contains("err= 0"), "fio reported errors:\n{t}");
    let lower = t.to_lowercase();
    assert!(
        !lower.contains("verify failed") && !lower.contains("bad magic") && !lower.contains("crc32c: verify"),
        "fio verify errors:\n{t}"
    );
    // fio really wrote: the volume has 32 MiB allocated
    let info = json(&s.cli_ok(&["volume", "info", "fio", "--json"]));
    assert!(info["allocated_bytes"].as_u64().unwrap() >= 32 * MIB, "allocated after fio: {info}");
}

#[test]
fn unix_socket_uri_works() {
    // The unix-socket URI (nbd+unix:///NAME?socket=PATH) serves the same data as TCP.
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("u", "32MiB");
    assert!(s.nbd_socket().exists(), "no NBD unix socket at {}", s.nbd_socket().display());
    qemu_io_ok(&s.unix_uri("u"), &["write -P 0x3e 1000 100000", "read -P 0x3e 1000 100000", "flush"]);
    qemu_io_ok(&s.uri("u"), &["read -P 0x3e 1000 100000", "read -P 0 0 1000", "write -P 0x3f 2M 4096"]);
    qemu_io_ok(&s.unix_uri("u"), &["read -P 0x3f 2M 4096"]);
    // a custom --nbd-socket path works too
    let td2 = TestDir::new();
    let sock = td2.path().join("custom.sock");
    let s2 = Server::start_with(&td2.data(), "1GiB", &["--nbd-socket", sock.to_str().unwrap()]);
    s2.create_volume("w", "8MiB");
    qemu_io_ok(&format!("nbd+unix:///w?socket={}", sock.display()), &["write -P 0x12 0 8M", "read -P 0x12 0 8M"]);
}
