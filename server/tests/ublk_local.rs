//! Volumes as local block devices through Linux's ublk driver (`volume attach-local`).
//!
//! Here, where the kernel has no ublk: an attach is refused with a clear error, changes
//! nothing, and NBD keeps serving the volume. In the kernel VM of ../shared/tools/nbd-vm
//! (feature `ublk`; its 6.12 kernel has ublk_drv), with `ferrovol serve` in the guest:
//! tests/kernel/guest-ublk.sh (a file system on the device, the same bytes over NBD,
//! discards freeing units, a read-only snapshot device, refusals, detach and attach
//! again, the server's stop removing its devices, and a kill -9 under writes: the
//! writer gets errors instead of hanging, flushed data is kept, and the next start
//! deletes what the killed server left).

mod common;

use std::path::Path;
#[cfg(feature = "ublk")]
use std::process::Command;

use common::*;

#[test]
fn an_attach_without_ublk_is_refused_clearly_and_nbd_keeps_serving() {
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("this kernel has ublk: the refusal is not reachable here");
        return;
    }
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("v", "64MiB");
    qemu_io_ok(&s.uri("v"), &["write -P 0x5a 0 1M"]);
    let err = s.cli_err(&["volume", "attach-local", "v"]);
    if cfg!(feature = "ublk") {
        assert!(err.contains("no ublk driver") && err.contains("modprobe ublk_drv"), "{err}");
    } else {
        assert!(err.contains("built without ublk"), "{err}");
    }
    let info = s.cli_ok(&["volume", "info", "v"]);
    assert!(!info.contains("local device"), "{info}");
    let err = s.cli_err(&["volume", "detach-local", "v"]);
    assert!(err.contains("not attached locally"), "{err}");
    let err = s.cli_err(&["volume", "attach-local", "nope"]);
    assert!(err.contains("nope"), "{err}");
    qemu_io_ok(&s.uri("v"), &["read -P 0x5a 0 1M"]);
    s.cli_ok(&["volume", "delete", "v"]);
}

/// A local device made for a node (AttachLocal with node_id, as the CSI node plugin on
/// a storage host asks) needs the volume published to that node writable: refused
/// before it, and with a read-only attachment, before any device is tried; once
/// published writable, the attach gets as far as the driver (which this kernel lacks).
#[test]
fn a_nodes_local_device_needs_the_volume_published_to_it_writable() {
    let td = TestDir::new();
    let s = Server::start(&td.data());
    s.create_volume("v", "64MiB");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let c = rt.block_on(mgmt_api::Client::connect_unix(&td.data().join("ferrovol.sock"))).unwrap();
    let refused = |c: &mgmt_api::Client| rt.block_on(c.attach_local_for("v", "node-a")).unwrap_err();
    let e = refused(&c);
    assert_eq!(e.kind(), mgmt_api::ErrorKind::FailedPrecondition, "{e}");
    assert!(e.message().contains("not published to node 'node-a' writable"), "{e}");
    let publish = |read_only: bool| mgmt_api::pb::PublishVolumeRequest {
        volume: "v".into(),
        node_id: "node-a".into(),
        read_only,
        exclusive: false,
    };
    rt.block_on(c.publish(publish(true))).unwrap();
    let e = refused(&c);
    assert!(e.message().contains("not published to node 'node-a' writable"), "read-only attachment: {e}");
    rt.block_on(c.unpublish("v", "node-a")).unwrap();
    rt.block_on(c.publish(publish(false))).unwrap();
    let e = rt.block_on(c.attach_local_for("v", "node-b")).unwrap_err();
    assert!(e.message().contains("not published to node 'node-b'"), "another node: {e}");
    if Path::new("/dev/ublk-control").exists() {
        return;
    }
    let e = refused(&c);
    assert_eq!(e.kind(), mgmt_api::ErrorKind::FailedPrecondition, "{e}");
    assert!(e.message().contains("ublk"), "published writable, the driver is tried: {e}");
    let info = s.cli_ok(&["volume", "info", "v"]);
    assert!(!info.contains("local device"), "{info}");
}

/// guest-ublk.sh in the kernel VM: see the module docs.
#[cfg(feature = "ublk")]
#[test]
fn a_volume_attached_locally_in_the_kernel_vm_serves_a_file_system_and_nbd_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("ferrovol");
    let st = Command::new("objcopy").args(["--strip-debug", BIN, bin.to_str().unwrap()]).status().unwrap();
    assert!(st.success(), "objcopy --strip-debug");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("../../shared/tools/nbd-vm/run.sh"))
        .args(["-t", "900"])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .arg(root.join("../tests/kernel/guest-ublk.sh"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "guest-ublk.sh failed with {} (see above)", out.status);
    assert!(stdout.contains("UBLK OK"), "guest-ublk.sh did not finish");
}
