//! Snapshots and clones through the CLI and real NBD clients: a snapshot is exported
//! read-only as VOLUME@SNAPSHOT with the data of its point in time, refuses writes,
//! lists with its space accounting, diffs against the volume, survives deleting its
//! volume and a kill -9; clones are writable and independent.

mod common;
use common::*;

/// qemu-io opened read-only (a snapshot export refuses a read-write open).
fn qemu_io_ro_ok(uri: &str, cmds: &[&str]) {
    let mut c = peer("qemu-io");
    c.args(["-r", "-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let o = output(c.arg(uri));
    assert!(qemu_io_succeeded(&o), "qemu-io -r {cmds:?} on {uri} failed ({}):\n{}", o.status, text(&o));
}

#[test]
fn snapshot_export_is_read_only_point_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start(dir.path());
    s.create_volume("v", "256MiB");
    qemu_io_ok(&s.uri("v"), &["write -P 0x11 0 4M", "write -P 0x22 8M 1M"]);
    s.cli_ok(&["snapshot", "create", "v", "before"]);
    qemu_io_ok(&s.uri("v"), &["write -P 0x33 1M 64k", "write -P 0x44 100M 4k"]);

    // The snapshot export: read-only flag, old data, holes where nothing was written.
    let info = json(&text(&output(peer("nbdinfo").args(["--json", &s.uri("v@before")]))));
    let e = &info["exports"][0];
    assert_eq!(e["is_read_only"], true, "{info}");
    assert_eq!(e["export-size"], 256 * MIB);
    qemu_io_ro_ok(&s.uri("v@before"), &["read -P 0x11 0 4M", "read -P 0x22 8M 1M", "read -P 0 100M 4k"]);
    qemu_io_ok(
        &s.uri("v"),
        &["read -P 0x11 0 1M", "read -P 0x33 1M 64k", "read -P 0x11 1088k 2M", "read -P 0x44 100M 4k"],
    );
    // Sent to the server (libnbd's strict mode off): the server itself answers EPERM.
    let code =
        "h.set_strict_mode(0)\ntry:\n    h.pwrite(b'x' * 4096, 0)\nexcept nbd.Error as e:\n    print('errno', e.errno)";
    let o = output(peer("nbdsh").args(["-u", &s.uri("v@before"), "-c", code]));
    assert!(text(&o).contains("errno EPERM"), "write to a snapshot: {}", text(&o));
    let list = json(&text(&output(peer("nbdinfo").args(["--list", "--json", &s.base_uri()]))));
    let names: Vec<_> =
        list["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap().to_owned()).collect();
    assert!(names.contains(&"v@before".to_string()), "{names:?}");

    // Accounting: 5 MiB written before; the snapshot shares all but the overwritten unit.
    let snaps = json(&s.cli_ok(&["snapshot", "list", "v", "--json"]));
    let sn = &snaps[0];
    assert_eq!(sn["name"], "v@before");
    assert_eq!(sn["allocated_bytes"], 5 * MIB);
    assert_eq!(sn["exclusive_bytes"], 64 * KIB, "only the overwritten unit is the snapshot's alone");
    // Diff: exactly the overwritten 64 KiB and the new 4 KiB (from metadata; a copied unit counts whole).
    let diff = json(&s.cli_ok(&["snapshot", "diff", "v@before", "v", "--json"]));
    let ranges: Vec<(u64, u64)> = diff
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["offset"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(ranges, vec![(MIB, 64 * KIB), (100 * MIB, 4 * KIB)]);

    // A clone of the snapshot is writable and independent of both.
    s.cli_ok(&["volume", "clone", "--from", "v@before", "c"]);
    qemu_io_ok(&s.uri("c"), &["read -P 0x11 0 4M", "write -P 0x55 0 64k", "read -P 0x55 0 64k"]);
    qemu_io_ro_ok(&s.uri("v@before"), &["read -P 0x11 0 64k"]);
    // Deleting the volume leaves its snapshot and the clone readable, across kill -9.
    s.cli_ok(&["volume", "delete", "v"]);
    qemu_io_ro_ok(&s.uri("v@before"), &["read -P 0x11 0 4M"]);
    let listed = json(&s.cli_ok(&["snapshot", "list", "v", "--json"]));
    assert_eq!(listed[0]["name"], "v@before", "a deleted volume's snapshot is still listed: {listed}");
    s.kill9();
    check_clean(dir.path());
    s.restart();
    qemu_io_ro_ok(&s.uri("v@before"), &["read -P 0x11 0 4M", "read -P 0x22 8M 1M"]);
    qemu_io_ok(&s.uri("c"), &["read -P 0x55 0 64k", "read -P 0x11 64k 3M"]);
    s.cli_ok(&["snapshot", "delete", "v", "before"]);
    let err = s.cli_err(&["snapshot", "delete", "v", "before"]);
    assert!(err.to_lowercase().contains("no such"), "{err}");
    let err = s.cli_err(&["snapshot", "list", "v"]);
    assert!(err.contains("no volume and no snapshots named 'v'"), "{err}");
    let err = s.cli_err(&["snapshot", "create", "c", "bad@name"]);
    assert!(err.contains("invalid"), "{err}");
    s.stop();
    check_clean(dir.path());
}

#[test]
fn volume_and_snapshot_tables_fit_long_names() {
    // The NAME column grows with the longest name, so every row of `volume list` and
    // `snapshot list` keeps its columns under the header's.
    let dir = tempfile::tempdir().unwrap();
    let s = Server::start(dir.path());
    let long = "a-volume-name-much-longer-than-the-forty-characters-of-old-".repeat(2);
    s.create_volume(&long, "64MiB");
    s.create_volume("v", "64MiB");
    s.cli_ok(&["snapshot", "create", &long, "nightly"]);
    for args in [&["volume", "list"][..], &["snapshot", "list"]] {
        let out = s.cli_ok(args);
        let widths: Vec<usize> = out.lines().map(|l| l.chars().count()).collect();
        assert!(widths.len() >= 2, "{args:?} printed no rows:\n{out}");
        assert!(widths.iter().all(|&w| w == widths[0]), "{args:?} columns do not line up:\n{out}");
        assert!(out.contains(&long), "{args:?} lost the long name:\n{out}");
    }
}

/// A group snapshot through the CLI and the API: qemu-io writes two volumes, `snapshot
/// create-group` takes both, each member reads back its volume's data over NBD and the
/// later writes are not in it; a second identical call is ALREADY_EXISTS from the CLI
/// and the same members from the API with exist_ok; a partial group (one member made
/// alone with the group's labels and the server's size label, as a crash can leave it,
/// made here through the engine with the server stopped since a client may not set that
/// label) is taken again whole, while an ordinary snapshot of that name is never touched.
#[test]
fn group_snapshots_through_the_cli_and_the_api() {
    let td = TestDir::new();
    let mut s = Server::start(&td.data());
    s.create_volume("data", "64MiB");
    s.create_volume("log", "64MiB");
    qemu_io_ok(&s.uri("data"), &["write -P 0x11 0 1M"]);
    qemu_io_ok(&s.uri("log"), &["write -P 0x22 0 1M"]);
    let out = s.cli_ok(&["snapshot", "create-group", "g1", "log", "data"]);
    assert!(out.contains("created snapshot data@g1") && out.contains("created snapshot log@g1"), "{out}");
    qemu_io_ok(&s.uri("data"), &["write -P 0x33 0 1M"]);
    qemu_io_ro_ok(&s.uri("data@g1"), &["read -P 0x11 0 1M"]);
    qemu_io_ro_ok(&s.uri("log@g1"), &["read -P 0x22 0 1M"]);
    assert!(s.cli_err(&["snapshot", "create-group", "g1", "data", "log"]).contains("exists"));
    assert!(s.cli_err(&["snapshot", "create-group", "g2", "data", "nope"]).contains("nope"));

    // A runtime per phase: dropping it closes the management connection, so the
    // server's stop does not wait for it.
    let rt = || tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let labels: std::collections::HashMap<String, String> = [("group".to_owned(), "g2".to_owned())].into();
    let req = |snapshot: &str| mgmt_api::pb::CreateGroupSnapshotRequest {
        volumes: vec!["log".into(), "data".into()],
        snapshot: snapshot.into(),
        labels: labels.clone(),
        exist_ok: true,
    };
    rt().block_on(async {
        use mgmt_api::ErrorKind;
        let c = mgmt_api::Client::connect_unix(&s.dir.join("ferrovol.sock")).await.unwrap();
        let a = c.create_group_snapshot(req("g2")).await.unwrap();
        let b = c.create_group_snapshot(req("g2")).await.unwrap();
        assert_eq!(a.iter().map(|v| v.id).collect::<Vec<_>>(), b.iter().map(|v| v.id).collect::<Vec<_>>());
        assert_eq!(a.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["data@g2", "log@g2"]);
        // Other labels: ALREADY_EXISTS.
        let mut other = req("g2");
        other.labels.clear();
        assert_eq!(c.create_group_snapshot(other).await.unwrap_err().kind(), ErrorKind::AlreadyExists);
        assert_eq!(a[0].labels["ferrovol/group-size"], "2", "the server's group size label");
        // A client may not set the server's size label.
        let mut reserved = req("g5");
        reserved.labels.insert("ferrovol/group-size".into(), "9".into());
        assert_eq!(c.create_group_snapshot(reserved).await.unwrap_err().kind(), ErrorKind::InvalidArgument);
    });

    // A partial group (what a crash can leave): only data@g3, with the group's labels
    // and the server's size label, made through the engine with the server stopped.
    s.stop();
    let pool = storage_engine::Pool::open(&s.dir.join("pool.img")).unwrap();
    let mut member_labels: storage_engine::Labels = labels.clone().into_iter().collect();
    member_labels.insert("ferrovol/group-size".into(), "2".into());
    let partial_id = rt().block_on(pool.create_snapshot_with("data", "g3", &member_labels)).unwrap().id;
    pool.close().unwrap();
    s.restart();
    rt().block_on(async {
        use mgmt_api::{pb, ErrorKind};
        let c = mgmt_api::Client::connect_unix(&s.dir.join("ferrovol.sock")).await.unwrap();
        assert_eq!(c.volume("data@g3").await.unwrap().id, partial_id);
        let whole = c.create_group_snapshot(req("g3")).await.unwrap();
        assert_eq!(whole.len(), 2);
        assert_ne!(whole[0].id, partial_id, "the partial member was taken again");
        // An ordinary snapshot of that name, even with the group's own labels, is never
        // taken for a member: ALREADY_EXISTS, and it stays.
        let ordinary = c
            .create_snapshot_with(pb::CreateSnapshotRequest {
                volume: "data".into(),
                snapshot: "g4".into(),
                labels: labels.clone(),
                exist_ok: false,
            })
            .await
            .unwrap();
        assert_eq!(c.create_group_snapshot(req("g4")).await.unwrap_err().kind(), ErrorKind::AlreadyExists);
        assert_eq!(c.volume("data@g4").await.unwrap().id, ordinary.id, "the ordinary snapshot is untouched");
    });
    qemu_io_ro_ok(&s.uri("data@g3"), &["read -P 0x33 0 1M"]);
}
