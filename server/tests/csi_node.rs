//! The CSI node plugin on the stock Debian kernel of ../shared/tools/nbd-vm: the storage
//! host and the CSI controller run here, the node plugin (`ferrovol csi node`) and the
//! reconnect watcher in the guest, where volumes really attach as /dev/nbdN, get a file
//! system and are mounted. Guest scripts: tests/kernel/guest-csi-*.sh. With the `ublk`
//! feature, one more run puts the storage host in the guest beside the node plugin,
//! whose volumes are then staged as the host's local ublk devices.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovol");

fn nbd_vm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/nbd-vm/run.sh")
}

fn csi_sanity() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/csi-sanity/csi-sanity")
}

fn guest(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kernel").join(name)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_tcp(port: u16, what: &str) {
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(30), "{what} did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A storage host (NBD for the guest at 10.0.2.2, keys required) and a CSI controller
/// over it on TCP; both killed on drop.
struct HostSide {
    dir: PathBuf,
    port: u16,
    controller_port: u16,
    server: Option<Child>,
    controller: Child,
    _tmp: tempfile::TempDir,
}

impl HostSide {
    fn start() -> HostSide {
        assert!(nbd_vm().exists(), "{} is missing", nbd_vm().display());
        assert!(csi_sanity().exists(), "{} is missing", csi_sanity().display());
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        let port = free_port();
        let server = spawn_server(&dir, port);
        let config = tmp.path().join("csi.toml");
        let api = format!("unix://{}", dir.join("ferrovol.sock").display());
        std::fs::write(&config, format!("[[host]]\nname = \"host-a\"\napi = \"{api}\"\n")).unwrap();
        let controller_port = free_port();
        let controller = Command::new(BIN)
            .args(["csi", "controller", "--endpoint", &format!("tcp://127.0.0.1:{controller_port}")])
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        wait_tcp(controller_port, "the CSI controller");
        HostSide { dir, port, controller_port, server: Some(server), controller, _tmp: tmp }
    }

    /// Stops the storage host: SIGTERM (a clean stop) or SIGKILL.
    fn stop_server(&mut self, clean: bool) {
        if let Some(mut s) = self.server.take() {
            if clean {
                Command::new("kill").arg("-TERM").arg(s.id().to_string()).status().unwrap();
                assert!(s.wait().unwrap().success(), "clean shutdown");
            } else {
                s.kill().unwrap();
                s.wait().unwrap();
            }
        }
    }

    /// Starts the storage host again on its data dir and port.
    fn start_server(&mut self) {
        assert!(self.server.is_none());
        self.server = Some(spawn_server(&self.dir, self.port));
    }

    /// The ferrovol binary without its debug info, for the guest's RAM.
    fn stripped_bin(&self) -> PathBuf {
        stripped(Path::new(BIN), &self.dir.with_file_name("ferrovol"))
    }
}

/// `from` copied to `to` without its debug info (the guest's RAM holds what it runs);
/// returns `to`.
fn stripped(from: &Path, to: &Path) -> PathBuf {
    let st = Command::new("objcopy").arg("--strip-debug").arg(from).arg(to).status().unwrap();
    assert!(st.success(), "objcopy --strip-debug {}", from.display());
    to.to_path_buf()
}

/// `ferrovol serve` on `dir`: NBD on `port`, advertised to the guest as 10.0.2.2, keys
/// required; returns once it serves.
fn spawn_server(dir: &Path, port: u16) -> Child {
    let _ = std::fs::remove_file(dir.join("ferrovol.sock"));
    let server = Command::new(BIN)
        .arg("--data-dir")
        .arg(dir)
        .args(["serve", "--pool-size", "8GiB", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--advertise", &format!("10.0.2.2:{port}"), "--nbd-access", "attached"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_tcp(port, "the storage host");
    let t = Instant::now();
    while !dir.join("ferrovol.sock").exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "no management socket");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

impl Drop for HostSide {
    fn drop(&mut self) {
        let _ = self.controller.kill();
        let _ = self.controller.wait();
        if let Some(s) = self.server.as_mut() {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

/// csi-sanity (kubernetes-csi/csi-test) in the guest against the node plugin there and
/// the controller here, with mount volumes and then with block volumes: no case fails,
/// and nothing is left attached.
#[test]
fn csi_sanity_passes_the_node_cases_in_the_kernel_vm() {
    let host = HostSide::start();
    let bin = host.stripped_bin();
    let out = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "1500"])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .args(["-f", &format!("{}:/usr/bin/csi-sanity", csi_sanity().display())])
        .args(["-e", &format!("CONTROLLER_PORT={}", host.controller_port)])
        .arg(guest("guest-csi-sanity.sh"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "guest-csi-sanity.sh failed with {} (see above)", out.status);
    assert_eq!(stdout.matches("SUCCESS!").count(), 2, "both runs report SUCCESS");
    // Each run's counts: every case but the skipped ones passed, and most ran.
    for access in ["mount", "block"] {
        let line = stdout.lines().find(|l| l.starts_with(&format!("csi-sanity {access}:"))).expect("counts");
        let count = |k: &str| -> u32 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=\"")))
                .and_then(|v| v.trim_end_matches('"').parse().ok())
                .unwrap_or_else(|| panic!("no {k} in {line:?}"))
        };
        assert_eq!(count("failures") + count("errors"), 0, "{line}");
        let ran = count("tests") - count("skipped");
        assert!(ran >= 60, "only {ran} cases ran: {line}");
    }
}

/// The kubelet's and the sidecars' order of calls, run in the guest by this test binary
/// itself (guest-csi-flow.sh starts it with `--ignored --exact guest_side_flow`), against
/// the node plugin there and the controller here: a volume created, published, staged
/// (formatted once), published into a "pod", written, unpublished and unstaged, staged
/// again and read back; grown online with the file system mounted; a snapshot restored
/// and a clone, both staged with their data and never formatted; a read-only publish
/// (readable, writes refused); a block volume written
/// through its target file; a written volume whose file system signature is gone refused,
/// never formatted; a volume published to another node refused; a stale publish_context
/// (after ControllerUnpublish) refused. The host
/// side checks the pool after.
#[test]
fn csi_node_flow_in_the_kernel_vm() {
    let host = HostSide::start();
    let bin = host.stripped_bin();
    let me = stripped(&std::env::current_exe().unwrap(), &host.dir.with_file_name("csi-flow"));
    let out = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "1200"])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .args(["-f", &format!("{}:/usr/bin/csi-flow", me.display())])
        .args(["-e", &format!("CONTROLLER_PORT={}", host.controller_port)])
        .arg(guest("guest-csi-flow.sh"))
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "guest-csi-flow.sh failed with {} (see above)", out.status);
}

/// The node plugin and the storage host restarting under a mounted, written volume, in
/// the guest (`guest_side::guest_side_restarts`, asking the host for server restarts
/// through the shared folder): the node plugin killed with SIGKILL and started again
/// while a writer fsyncs files (no I/O error; the new plugin finds the volume from the
/// kernel and mountinfo); a clean restart of the storage host (no I/O error: the watcher
/// reconnects); the storage host down for longer than the dead timeout (the writer gets
/// EIO, the volume condition is abnormal, unpublish and unstage still work, and a new
/// stage finds every fsynced file); and a SIGKILL of the storage host (the device is
/// fenced, the condition says why, and a new stage finds every fsynced file).
#[test]
fn csi_node_keeps_volumes_through_restarts_in_the_kernel_vm() {
    let mut host = HostSide::start();
    let share = host.dir.with_file_name("share");
    std::fs::create_dir_all(&share).unwrap();
    let bin = host.stripped_bin();
    let me = stripped(&std::env::current_exe().unwrap(), &host.dir.with_file_name("csi-flow"));
    let mut vm = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "1200", "-s", share.to_str().unwrap()])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .args(["-f", &format!("{}:/usr/bin/csi-flow", me.display())])
        .args(["-e", &format!("CONTROLLER_PORT={}", host.controller_port)])
        .args(["-e", "DEAD_TIMEOUT=5", "-e", "FLOW=guest_side::guest_side_restarts"])
        .arg(guest("guest-csi-flow.sh"))
        .spawn()
        .unwrap();
    // The guest's requests: req-N-ACTION, answered with ack-N once done.
    let mut n = 1;
    let status = loop {
        if let Some(st) = vm.try_wait().unwrap() {
            break st;
        }
        for action in ["restart", "stop", "start", "kill"] {
            if share.join(format!("req-{n}-{action}")).exists() {
                match action {
                    "restart" => {
                        host.stop_server(true);
                        host.start_server();
                    }
                    "stop" => host.stop_server(true),
                    "start" => host.start_server(),
                    _ => {
                        host.stop_server(false);
                        host.start_server();
                    }
                }
                std::fs::write(share.join(format!("ack-{n}")), b"").unwrap();
                n += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "guest-csi-flow.sh (restarts) failed with {status} (see above)");
    assert_eq!(n, 5, "the guest asked for {} server actions, not 4", n - 1);
}

/// The node plugin on a storage host (guest-csi-local.sh: host, controller and node all
/// in the guest, the node given the host's management socket): the host's volumes are
/// staged as its local ublk devices, and everything else works as over NBD
/// (`guest_side::guest_side_local`).
#[cfg(feature = "ublk")]
#[test]
fn csi_node_attaches_local_volumes_as_ublk_devices_in_the_kernel_vm() {
    assert!(nbd_vm().exists(), "{} is missing", nbd_vm().display());
    let tmp = tempfile::tempdir().unwrap();
    let bin = stripped(Path::new(BIN), &tmp.path().join("ferrovol"));
    let me = stripped(&std::env::current_exe().unwrap(), &tmp.path().join("csi-flow"));
    let out = Command::new("bash")
        .arg(nbd_vm())
        .args(["-t", "900"])
        .args(["-f", &format!("{}:/usr/bin/ferrovol", bin.display())])
        .args(["-f", &format!("{}:/usr/bin/csi-flow", me.display())])
        .arg(guest("guest-csi-local.sh"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "guest-csi-local.sh failed with {} (see above)", out.status);
    assert!(stdout.contains("CSI LOCAL OK"), "guest-csi-local.sh did not finish");
}

mod guest_side {
    use std::collections::HashMap;
    use std::io::{Read, Seek, Write};
    use std::path::Path;

    use csi::pb;
    use csi::pb::controller_client::ControllerClient;
    use csi::pb::node_client::NodeClient;
    use csi::pb::volume_capability::access_mode::Mode;
    use tonic::transport::Channel;
    use tonic::Code;

    const MIB: i64 = 1 << 20;

    fn mount_cap(fs: &str) -> pb::VolumeCapability {
        pb::VolumeCapability {
            access_mode: Some(pb::volume_capability::AccessMode { mode: Mode::SingleNodeWriter as i32 }),
            access_type: Some(pb::volume_capability::AccessType::Mount(pb::volume_capability::MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            })),
        }
    }

    fn block_cap() -> pb::VolumeCapability {
        pb::VolumeCapability {
            access_mode: Some(pb::volume_capability::AccessMode { mode: Mode::SingleNodeWriter as i32 }),
            access_type: Some(pb::volume_capability::AccessType::Block(pb::volume_capability::BlockVolume {})),
        }
    }

    struct Co {
        ctl: ControllerClient<Channel>,
        node: NodeClient<Channel>,
        node_id: String,
    }

    /// One volume as the CO sees it.
    struct Vol {
        id: String,
        ctx: HashMap<String, String>,
        cap: pb::VolumeCapability,
        staging: String,
        target: String,
    }

    impl Co {
        async fn connect() -> Co {
            let port = std::env::var("CONTROLLER_PORT").unwrap();
            let host = std::env::var("NBDVM_HOST").unwrap();
            let ctl = ControllerClient::connect(format!("http://{host}:{port}")).await.unwrap();
            let path = "/tmp/csi/node.sock";
            let ch = tonic::transport::Endpoint::try_from("http://csi.invalid")
                .unwrap()
                .connect_with_connector(tower::service_fn(move |_| async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
                }))
                .await
                .unwrap();
            let mut node = NodeClient::new(ch);
            let node_id = node.node_get_info(pb::NodeGetInfoRequest {}).await.unwrap().into_inner().node_id;
            Co { ctl, node, node_id }
        }

        async fn create(
            &mut self,
            name: &str,
            size: i64,
            cap: pb::VolumeCapability,
            source: Option<pb::VolumeContentSource>,
        ) -> Vol {
            let v = self
                .ctl
                .create_volume(pb::CreateVolumeRequest {
                    name: name.into(),
                    capacity_range: Some(pb::CapacityRange { required_bytes: size, limit_bytes: 0 }),
                    volume_capabilities: vec![cap.clone()],
                    volume_content_source: source,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap();
            Vol {
                id: v.volume_id,
                ctx: HashMap::new(),
                cap,
                staging: format!("/tmp/csi/staging/{name}"),
                target: format!("/tmp/csi/pods/{name}/volume"),
            }
        }

        async fn attach(&mut self, v: &mut Vol) {
            self.attach_as(v, false).await;
        }

        /// ControllerPublish, read-only when asked.
        async fn attach_as(&mut self, v: &mut Vol, readonly: bool) {
            v.ctx = self
                .ctl
                .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                    volume_id: v.id.clone(),
                    node_id: self.node_id.clone(),
                    volume_capability: Some(v.cap.clone()),
                    readonly,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .publish_context;
        }

        async fn detach(&mut self, v: &Vol) {
            self.ctl
                .controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                    volume_id: v.id.clone(),
                    node_id: self.node_id.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }

        async fn stage(&mut self, v: &Vol) -> Result<(), tonic::Status> {
            std::fs::create_dir_all(&v.staging).unwrap();
            self.node
                .node_stage_volume(pb::NodeStageVolumeRequest {
                    volume_id: v.id.clone(),
                    publish_context: v.ctx.clone(),
                    staging_target_path: v.staging.clone(),
                    volume_capability: Some(v.cap.clone()),
                    ..Default::default()
                })
                .await
                .map(|_| ())
        }

        async fn unstage(&mut self, v: &Vol) {
            self.node
                .node_unstage_volume(pb::NodeUnstageVolumeRequest {
                    volume_id: v.id.clone(),
                    staging_target_path: v.staging.clone(),
                })
                .await
                .unwrap();
        }

        async fn publish(&mut self, v: &Vol) {
            self.node
                .node_publish_volume(pb::NodePublishVolumeRequest {
                    volume_id: v.id.clone(),
                    publish_context: v.ctx.clone(),
                    staging_target_path: v.staging.clone(),
                    target_path: v.target.clone(),
                    volume_capability: Some(v.cap.clone()),
                    ..Default::default()
                })
                .await
                .unwrap();
        }

        async fn unpublish(&mut self, v: &Vol) {
            self.node
                .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                    volume_id: v.id.clone(),
                    target_path: v.target.clone(),
                })
                .await
                .unwrap();
        }

        /// ControllerPublish, NodeStage, NodePublish.
        async fn up(&mut self, v: &mut Vol) {
            self.attach(v).await;
            self.stage(v).await.unwrap();
            self.publish(v).await;
        }

        /// NodeUnpublish, NodeUnstage, ControllerUnpublish.
        async fn down(&mut self, v: &Vol) {
            self.unpublish(v).await;
            self.unstage(v).await;
            self.detach(v).await;
        }
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        let mut x = u64::from(seed) | 0x9e37_79b9_7f4a_7c15;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Writes `data` at byte `at` of the file or device `path`, and syncs it.
    fn write_at(path: &str, at: u64, data: &[u8]) {
        let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.seek(std::io::SeekFrom::Start(at)).unwrap();
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
    }

    /// `len` bytes at byte `at` of the file or device `path`.
    fn read_at(path: &str, at: u64, len: usize) -> Vec<u8> {
        let mut back = vec![0u8; len];
        let mut f = std::fs::File::open(path).unwrap();
        f.seek(std::io::SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut back).unwrap();
        back
    }

    fn write_file(path: &str, data: &[u8]) {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    #[ignore = "runs inside the kernel VM, started by csi_node_flow_in_the_kernel_vm"]
    async fn guest_side_flow() {
        let mut co = Co::connect().await;
        let data = pattern(1, 8 << 20);

        eprintln!("== a mount volume: stage formats it, data survives an unstage and a stage");
        let mut a = co.create("flow-a", 256 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut a).await;
        write_file(&format!("{}/f", a.target), &data);
        // The calls are idempotent.
        co.stage(&a).await.unwrap();
        co.publish(&a).await;
        co.down(&a).await;
        assert!(!Path::new(&a.target).exists(), "the target path stays after unpublish");
        co.up(&mut a).await;
        assert_eq!(std::fs::read(format!("{}/f", a.target)).unwrap(), data, "data after a second stage");

        eprintln!("== online expansion with the file system mounted");
        let cap = expand(&mut co, &a, 512 * MIB).await.unwrap();
        assert_eq!(cap, 512 * MIB);
        let st = stats(&mut co, &a).await;
        let bytes = st.usage.iter().find(|u| u.unit == pb::volume_usage::Unit::Bytes as i32).unwrap();
        assert!(bytes.total > 400 * MIB, "the file system did not grow: {bytes:?}");
        assert!(bytes.used >= 8 * MIB, "{bytes:?}");
        assert!(!st.volume_condition.unwrap().abnormal);
        write_file(&format!("{}/g", a.target), &pattern(2, 1 << 20));

        eprintln!("== a restored snapshot and a clone keep their data and are never formatted");
        let snap = co
            .ctl
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: a.id.clone(),
                name: "flow-snap".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        let from_snap = pb::VolumeContentSource {
            r#type: Some(pb::volume_content_source::Type::Snapshot(pb::volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            })),
        };
        let mut r = co.create("flow-restored", 512 * MIB, mount_cap("ext4"), Some(from_snap)).await;
        let from_vol = pb::VolumeContentSource {
            r#type: Some(pb::volume_content_source::Type::Volume(pb::volume_content_source::VolumeSource {
                volume_id: a.id.clone(),
            })),
        };
        let mut c = co.create("flow-clone", 512 * MIB, mount_cap("ext4"), Some(from_vol)).await;
        for v in [&mut r, &mut c] {
            co.up(v).await;
            assert_eq!(std::fs::read(format!("{}/f", v.target)).unwrap(), data, "data of {}", v.id);
            co.down(v).await;
        }

        eprintln!("== a read-only publish: data readable, writes refused");
        let mut ro = co.create("flow-ro", 64 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut ro).await;
        write_file(&format!("{}/f", ro.target), &data[..1 << 20]);
        co.down(&ro).await;
        co.attach_as(&mut ro, true).await;
        co.stage(&ro).await.unwrap();
        co.node
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: ro.id.clone(),
                publish_context: ro.ctx.clone(),
                staging_target_path: ro.staging.clone(),
                target_path: ro.target.clone(),
                volume_capability: Some(ro.cap.clone()),
                readonly: true,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(std::fs::read(format!("{}/f", ro.target)).unwrap(), &data[..1 << 20]);
        let e = std::fs::File::create(format!("{}/g", ro.target)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ReadOnlyFilesystem, "{e}");
        co.down(&ro).await;

        eprintln!("== xfs, and a block volume written through its target file");
        let mut x = co.create("flow-xfs", 512 * MIB, mount_cap("xfs"), None).await;
        co.up(&mut x).await;
        write_file(&format!("{}/f", x.target), &data[..1 << 20]);
        co.down(&x).await;
        co.up(&mut x).await;
        assert_eq!(std::fs::read(format!("{}/f", x.target)).unwrap(), &data[..1 << 20]);
        co.down(&x).await;
        let mut b = co.create("flow-block", 64 * MIB, block_cap(), None).await;
        co.up(&mut b).await;
        write_at(&b.target, 1 << 20, &data[..1 << 20]);
        co.down(&b).await;
        co.up(&mut b).await;
        assert_eq!(read_at(&b.target, 1 << 20, 1 << 20), &data[..1 << 20], "block volume data");

        co.down(&b).await;

        eprintln!("== a written volume whose superblock is damaged is never formatted");
        // The xfs volume's superblock (its first sector) overwritten through the device.
        let mut raw = Vol { cap: block_cap(), target: "/tmp/csi/pods/flow-xfs-raw/dev".into(), ..x };
        co.up(&mut raw).await;
        {
            let mut f = std::fs::OpenOptions::new().write(true).open(&raw.target).unwrap();
            f.write_all(&[0u8; 4096]).unwrap();
            f.sync_all().unwrap();
        }
        co.down(&raw).await;
        let mut d = Vol { cap: mount_cap("xfs"), ..raw };
        co.attach(&mut d).await;
        let e = co.stage(&d).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("never formatted"), "{e:?}");
        let dev = devices_of(&d.id);
        assert!(dev.is_empty(), "a failed stage left {dev:?} attached");
        co.detach(&d).await;

        eprintln!("== a volume published to another node is refused");
        let mut o = co.create("flow-other", 64 * MIB, mount_cap("ext4"), None).await;
        o.ctx = co
            .ctl
            .controller_publish_volume(pb::ControllerPublishVolumeRequest {
                volume_id: o.id.clone(),
                node_id: "ferrovol:other-node".into(),
                volume_capability: Some(o.cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        let e = co.stage(&o).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(devices_of(&o.id).is_empty());

        eprintln!("== a stale publish_context (unpublished) is refused");
        let stale = a.ctx.clone();
        co.down(&a).await;
        let mut s = Vol { ctx: stale, ..a };
        s.staging = "/tmp/csi/staging/flow-stale".into();
        let e = co.stage(&s).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(devices_of(&s.id).is_empty());
        eprintln!("flow ok");
    }

    /// Asks the host to act on the storage host (`restart`: SIGTERM and start, `stop`:
    /// SIGTERM, `start`, `kill`: SIGKILL and start) and waits until it has.
    fn host_do(n: u32, action: &str) {
        eprintln!("   (host: {action})");
        std::fs::write(format!("/mnt/host/req-{n}-{action}"), b"").unwrap();
        let t = std::time::Instant::now();
        while !Path::new(&format!("/mnt/host/ack-{n}")).exists() {
            assert!(t.elapsed() < std::time::Duration::from_secs(120), "the host never did {action}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Writes and fsyncs 256 KiB files `w{i}` in `dir` until stopped or until one fails;
    /// the checksum list of those fsynced, and the first error.
    /// The files fsynced (name and content), and the first error.
    type Written = (Vec<(String, Vec<u8>)>, Option<String>);

    struct Writer {
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
        done: std::sync::Arc<std::sync::Mutex<Written>>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Writer {
        fn start(dir: &str, from: usize) -> Writer {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let done: std::sync::Arc<std::sync::Mutex<Written>> = Default::default();
            let (s, d, dir) = (stop.clone(), done.clone(), dir.to_string());
            let thread = std::thread::spawn(move || {
                let mut i = from;
                while !s.load(std::sync::atomic::Ordering::SeqCst) {
                    let name = format!("w{i}");
                    let data = pattern(i as u8, 256 << 10);
                    let r = std::fs::File::create(format!("{dir}/{name}"))
                        .and_then(|mut f| f.write_all(&data).and_then(|()| f.sync_all()));
                    let mut g = d.lock().unwrap();
                    match r {
                        Ok(()) => g.0.push((name, data)),
                        Err(e) => {
                            g.1 = Some(format!("{name}: {e}"));
                            return;
                        }
                    }
                    drop(g);
                    i += 1;
                }
            });
            Writer { stop, done, thread: Some(thread) }
        }

        fn count(&self) -> usize {
            self.done.lock().unwrap().0.len()
        }

        fn error(&self) -> Option<String> {
            self.done.lock().unwrap().1.clone()
        }

        /// Waits for `more` files more, failing on an error.
        fn wait_more(&self, more: usize) {
            let want = self.count() + more;
            let t = std::time::Instant::now();
            while self.count() < want {
                assert_eq!(self.error(), None, "the writer failed");
                assert!(t.elapsed() < std::time::Duration::from_secs(180), "the writer made no progress");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }

        fn finish(mut self) -> Written {
            self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let _ = self.thread.take().unwrap().join();
            self.done.lock().unwrap().clone()
        }
    }

    /// Kills the node plugin with SIGKILL and starts it again (as its DaemonSet would).
    async fn restart_node_plugin(co: &mut Co) {
        let pid = std::fs::read_to_string("/tmp/node.pid").unwrap();
        let st = std::process::Command::new("kill").args(["-9", pid.trim()]).status().unwrap();
        assert!(st.success());
        let _ = std::fs::remove_file("/tmp/csi/node.sock");
        let st = std::process::Command::new("sh")
            .args(["-c", "ferrovol csi node --endpoint unix:///tmp/csi/node.sock --node-name vm-node --dead-timeout \"${DEAD_TIMEOUT:-120}\" >>/tmp/node.log 2>&1 & echo $! > /tmp/node.pid"])
            .status()
            .unwrap();
        assert!(st.success());
        let t = std::time::Instant::now();
        while !Path::new("/tmp/csi/node.sock").exists() {
            assert!(t.elapsed() < std::time::Duration::from_secs(30), "the node plugin did not come back");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        *co = Co::connect().await;
    }

    async fn condition(co: &mut Co, v: &Vol) -> pb::VolumeCondition {
        stats(co, v).await.volume_condition.unwrap()
    }

    fn verify(v: &Vol, files: &[(String, Vec<u8>)]) {
        for (name, data) in files {
            let got = std::fs::read(format!("{}/{name}", v.target)).unwrap_or_default();
            assert!(got == *data, "{name} differs after the restart");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    #[ignore = "runs inside the kernel VM, started by csi_node_keeps_volumes_through_restarts_in_the_kernel_vm"]
    async fn guest_side_restarts() {
        let mut co = Co::connect().await;
        let mut v = co.create("restarts", 256 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut v).await;

        eprintln!("== the node plugin killed and started again under a writer");
        let w = Writer::start(&v.target, 0);
        w.wait_more(3);
        restart_node_plugin(&mut co).await;
        w.wait_more(3);
        assert!(!condition(&mut co, &v).await.abnormal);
        // The restarted plugin knows the volume: its calls are idempotent.
        co.stage(&v).await.unwrap();
        co.publish(&v).await;

        eprintln!("== a clean restart of the storage host under the writer");
        host_do(1, "restart");
        w.wait_more(3);
        let (mut synced, err) = w.finish();
        assert_eq!(err, None);
        assert!(!condition(&mut co, &v).await.abnormal);

        eprintln!("== the storage host down for longer than the dead timeout");
        host_do(2, "stop");
        let w = Writer::start(&v.target, 1000);
        let t = std::time::Instant::now();
        while w.error().is_none() {
            assert!(t.elapsed() < std::time::Duration::from_secs(120), "no I/O error with the storage host down");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let (more, err) = w.finish();
        eprintln!("   writer: {}", err.unwrap());
        synced.extend(more);
        let c = condition(&mut co, &v).await;
        assert!(c.abnormal && c.message.contains("dead"), "{c:?}");
        host_do(3, "start");
        co.down(&v).await;
        co.up(&mut v).await;
        verify(&v, &synced);
        assert!(!condition(&mut co, &v).await.abnormal);

        eprintln!("== SIGKILL of the storage host: fenced, then staged again");
        let w = Writer::start(&v.target, 2000);
        w.wait_more(2);
        host_do(4, "kill");
        let t = std::time::Instant::now();
        loop {
            let c = condition(&mut co, &v).await;
            if c.abnormal && c.message.contains("crash") {
                break;
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(120), "not fenced: {c:?}");
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let (more, _) = w.finish();
        synced.extend(more);
        co.down(&v).await;
        co.up(&mut v).await;
        verify(&v, &synced);
        co.down(&v).await;
        eprintln!("restarts ok");
    }

    /// The device mounted at `path` (/proc/mounts), if any.
    fn mounted_device(path: &str) -> Option<String> {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        mounts.lines().map(|l| l.split(' ').collect::<Vec<_>>()).find(|f| f[1] == path).map(|f| f[0].to_string())
    }

    /// The ublk block devices there are (`ublkbN`).
    fn ublk_devices() -> Vec<String> {
        let mut d: Vec<String> = std::fs::read_dir("/dev")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("ublkb"))
            .collect();
        d.sort();
        d
    }

    /// ControllerExpandVolume (which must ask for the node's part), then
    /// NodeExpandVolume on the publish target; the size the node reports.
    async fn expand(co: &mut Co, v: &Vol, size: i64) -> Result<i64, tonic::Status> {
        let got = co
            .ctl
            .controller_expand_volume(pb::ControllerExpandVolumeRequest {
                volume_id: v.id.clone(),
                capacity_range: Some(pb::CapacityRange { required_bytes: size, limit_bytes: 0 }),
                volume_capability: Some(v.cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(got.node_expansion_required);
        co.node
            .node_expand_volume(pb::NodeExpandVolumeRequest {
                volume_id: v.id.clone(),
                volume_path: v.target.clone(),
                capacity_range: Some(pb::CapacityRange { required_bytes: size, limit_bytes: 0 }),
                staging_target_path: v.staging.clone(),
                volume_capability: Some(v.cap.clone()),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }

    async fn stats(co: &mut Co, v: &Vol) -> pb::NodeGetVolumeStatsResponse {
        co.node
            .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
                volume_id: v.id.clone(),
                volume_path: v.target.clone(),
                staging_target_path: v.staging.clone(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// Everything on one machine: the node plugin knows the storage host there
    /// (guest-csi-local.sh). Its volumes are staged as the host's local ublk devices:
    /// formatted once, written, unstaged (the device removed) and staged again with
    /// their data; stats name the local device; online expansion grows the file system
    /// where the kernel resizes ublk devices (6.16), and on older kernels is refused
    /// clearly until the volume is staged again, after which it grows; a block volume is
    /// written and read back through its target file; a read-only publish goes over NBD.
    #[tokio::test(flavor = "current_thread")]
    #[ignore = "runs inside the kernel VM, started by csi_node_attaches_local_volumes_as_ublk_devices_in_the_kernel_vm"]
    async fn guest_side_local() {
        let mut co = Co::connect().await;
        let data = pattern(3, 8 << 20);
        let resizes = csi::local::kernel_resizes_ublk();

        eprintln!("== a mount volume of the host on this machine is staged as its ublk device");
        let mut a = co.create("local-a", 256 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut a).await;
        let dev = mounted_device(&a.staging).expect("staged");
        assert!(dev.starts_with("/dev/ublkb"), "staged on {dev}, not on a local ublk device");
        assert_eq!(ublk_devices().len(), 1, "{:?}", ublk_devices());
        write_file(&format!("{}/f", a.target), &data);
        let st = stats(&mut co, &a).await;
        let cond = st.volume_condition.unwrap();
        assert!(!cond.abnormal && cond.message.contains(&dev), "{cond:?}");
        // The calls are idempotent.
        co.stage(&a).await.unwrap();
        co.publish(&a).await;
        co.down(&a).await;
        assert!(ublk_devices().is_empty(), "unstage left {:?}", ublk_devices());
        co.up(&mut a).await;
        assert_eq!(std::fs::read(format!("{}/f", a.target)).unwrap(), data, "data after a second stage");

        eprintln!("== online expansion (this kernel resizes ublk devices online: {resizes})");
        match expand(&mut co, &a, 512 * MIB).await {
            Ok(cap) => {
                assert!(resizes, "NodeExpandVolume succeeded on a kernel that cannot resize the device");
                assert_eq!(cap, 512 * MIB);
            }
            Err(e) => {
                assert!(!resizes, "{e:?}");
                assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
                assert!(e.message().contains("staged again"), "{e:?}");
                co.down(&a).await;
                co.up(&mut a).await;
                let cap = expand(&mut co, &a, 512 * MIB).await.unwrap();
                assert_eq!(cap, 512 * MIB);
            }
        }
        let st = stats(&mut co, &a).await;
        let bytes = st.usage.iter().find(|u| u.unit == pb::volume_usage::Unit::Bytes as i32).unwrap();
        assert!(bytes.total > 400 * MIB, "the file system did not grow: {bytes:?}");
        assert_eq!(std::fs::read(format!("{}/f", a.target)).unwrap(), data, "data after the expansion");
        co.down(&a).await;

        eprintln!("== a block volume written and read through its target file");
        let mut b = co.create("local-block", 64 * MIB, block_cap(), None).await;
        co.up(&mut b).await;
        assert_eq!(ublk_devices().len(), 1, "{:?}", ublk_devices());
        write_at(&b.target, 1 << 20, &data[..1 << 20]);
        let st = stats(&mut co, &b).await;
        assert_eq!(st.usage[0].total, 64 * MIB, "{st:?}");
        co.down(&b).await;
        co.up(&mut b).await;
        assert_eq!(read_at(&b.target, 1 << 20, 1 << 20), &data[..1 << 20], "block volume data");
        co.down(&b).await;

        eprintln!("== a read-only publish goes over NBD");
        let mut ro = co.create("local-ro", 64 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut ro).await;
        write_file(&format!("{}/f", ro.target), &data[..1 << 20]);
        co.down(&ro).await;
        co.attach_as(&mut ro, true).await;
        co.stage(&ro).await.unwrap();
        let dev = mounted_device(&ro.staging).expect("staged");
        assert!(dev.starts_with("/dev/nbd"), "read-only, staged on {dev}");
        assert_eq!(devices_of(&ro.id).len(), 1);
        assert_eq!(std::fs::read(format!("{}/f", ro.staging)).unwrap(), &data[..1 << 20]);
        co.unstage(&ro).await;
        co.detach(&ro).await;
        assert!(devices_of(&ro.id).is_empty() && ublk_devices().is_empty());

        eprintln!("== ControllerUnpublish removes the node's local device (fencing)");
        let mut f = co.create("local-fenced", 64 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut f).await;
        let dev = mounted_device(&f.staging).expect("staged");
        assert!(dev.starts_with("/dev/ublkb"), "staged on {dev}");
        write_file(&format!("{}/f", f.target), &data[..1 << 20]);
        co.detach(&f).await;
        assert!(ublk_devices().is_empty(), "the device outlived the unpublish: {:?}", ublk_devices());
        let write = std::fs::File::create(format!("{}/g", f.target)).and_then(|mut w| {
            w.write_all(&data[..1 << 20])?;
            w.sync_all()
        });
        assert!(write.is_err(), "a write after the unpublish reached the volume");
        let cond = stats(&mut co, &f).await.volume_condition.unwrap();
        assert!(cond.abnormal && cond.message.contains("gone"), "{cond:?}");
        // The kubelet's clean-up still works: unpublish, then unstage of the stale mount.
        co.unpublish(&f).await;
        co.unstage(&f).await;
        assert!(mounted_device(&f.staging).is_none(), "the stale mount stayed");
        // Published again, the volume holds what was flushed before.
        co.up(&mut f).await;
        assert_eq!(std::fs::read(format!("{}/f", f.target)).unwrap(), &data[..1 << 20]);
        co.down(&f).await;
        eprintln!("local ok");
    }

    /// The node plugin with `--local-ublk auto` on a kernel that does not resize ublk
    /// devices online (6.12): the host's volumes go over NBD (guest-csi-local.sh, after
    /// guest_side_local).
    #[tokio::test(flavor = "current_thread")]
    #[ignore = "runs inside the kernel VM, started by csi_node_attaches_local_volumes_as_ublk_devices_in_the_kernel_vm"]
    async fn guest_side_local_auto() {
        let mut co = Co::connect().await;
        let mut v = co.create("local-auto", 64 * MIB, mount_cap("ext4"), None).await;
        co.up(&mut v).await;
        let dev = mounted_device(&v.staging).expect("staged");
        let want = if csi::local::kernel_resizes_ublk() { "/dev/ublkb" } else { "/dev/nbd" };
        assert!(dev.starts_with(want), "auto staged on {dev}, not {want}N");
        co.down(&v).await;
        eprintln!("auto ok");
    }

    /// NBD devices attached for CSI volume `id`.
    fn devices_of(id: &str) -> Vec<String> {
        let out = std::process::Command::new("ferrovol").args(["nbd", "list"]).output().unwrap();
        let backend = format!("\tcsi:{id}\t");
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains(&backend)).map(str::to_string).collect()
    }
}
