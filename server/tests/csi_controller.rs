//! The CSI controller (`ferrovol csi controller`) against real storage hosts: two
//! `ferrovol serve` processes in two zones, the controller as its own process, and a
//! tonic client over its unix socket. Each test names the spec.md section it checks
//! (container-storage-interface/spec v1.12.0). Data is read back over NBD with qemu-io.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use csi::pb;
use csi::pb::controller_client::ControllerClient;
use csi::pb::identity_client::IdentityClient;
use csi::pb::volume_capability::access_mode::Mode;
use tonic::transport::Channel;
use tonic::Code;

const GIB: i64 = 1 << 30;
const MIB: i64 = 1 << 20;

/// Two storage hosts (`host-a` in zone-a, `host-b` in zone-b) and a controller over them.
struct Cluster {
    _dir: TestDir,
    a: Server,
    b: Server,
    config: PathBuf,
    socket: PathBuf,
    controller: Option<Child>,
    log: PathBuf,
}

impl Cluster {
    /// Hosts with pools of `size_a` and `size_b`, each started with `extra`, both
    /// reached over their management sockets.
    fn start(size_a: &str, size_b: &str, extra: &[&str]) -> Cluster {
        let dir = TestDir::new();
        let a = Server::start_with(&dir.path().join("a"), size_a, extra);
        let b = Server::start_with(&dir.path().join("b"), size_b, extra);
        let config = format!(
            "[[host]]\nname = \"host-a\"\napi = \"unix://{}\"\nzone = \"zone-a\"\n\n[[host]]\nname = \"host-b\"\napi = \
             \"unix://{}\"\nzone = \"zone-b\"\n",
            a.dir.join("ferrovol.sock").display(),
            b.dir.join("ferrovol.sock").display()
        );
        Cluster::with_config(dir, a, b, &config)
    }

    /// A controller with configuration `config` over hosts `a` and `b`.
    fn with_config(dir: TestDir, a: Server, b: Server, config: &str) -> Cluster {
        let path = dir.path().join("csi.toml");
        std::fs::write(&path, config).unwrap();
        let socket = dir.path().join("csi.sock");
        let log = dir.path().join("controller.log");
        let mut c = Cluster { _dir: dir, a, b, config: path, socket, controller: None, log };
        c.start_controller();
        c
    }

    fn start_controller(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(BIN)
            .args(["csi", "controller", "--endpoint"])
            .arg(format!("unix://{}", self.socket.display()))
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn ferrovol csi controller");
        wait_listening(&self.socket, || format!("controller not serving:\n{}", self.log_text()));
        self.controller = Some(child);
    }

    /// SIGTERM: the controller drains its connections (the clients of this runtime,
    /// which keeps running meanwhile, answer the server's GOAWAY), exits cleanly and
    /// removes its socket. Fails rather than hangs if it does not exit within a minute.
    async fn stop_controller(&mut self) {
        if let Some(mut c) = self.controller.take() {
            let ok = Command::new("kill").args(["-TERM", &c.id().to_string()]).status().unwrap();
            assert!(ok.success(), "kill -TERM failed");
            let st = tokio::task::spawn_blocking(move || {
                let t = Instant::now();
                loop {
                    if let Some(st) = c.try_wait().unwrap() {
                        return Some(st);
                    }
                    if t.elapsed() > Duration::from_secs(60) {
                        let _ = c.kill();
                        let _ = c.wait();
                        return None;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
            .await
            .unwrap();
            let st = st.unwrap_or_else(|| panic!("the controller did not stop on SIGTERM:\n{}", self.log_text()));
            assert!(st.success(), "the controller did not exit cleanly on SIGTERM ({st}):\n{}", self.log_text());
            assert!(!self.socket.exists(), "the controller left its socket {} behind", self.socket.display());
            assert!(
                !self.log_text().contains("end of the drain"),
                "a client that answers was cut off at the drain limit:\n{}",
                self.log_text()
            );
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn channel(&self) -> Channel {
        unix_channel(&self.socket).await
    }

    async fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel().await)
    }

    /// The server of the host a volume's context names.
    fn host(&self, v: &pb::Volume) -> &Server {
        match v.volume_context.get("ferrovol.io/host").map(String::as_str) {
            Some("host-a") => &self.a,
            Some("host-b") => &self.b,
            other => panic!("volume context names no host: {other:?}"),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(mut c) = self.controller.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits (up to 20 s) until something accepts connections on the unix socket `path`;
/// panics with `why()` otherwise.
fn wait_listening(path: &Path, why: impl Fn() -> String) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "{}", why());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A gRPC channel over the unix socket at `path`.
async fn unix_channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::try_from("http://csi.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .unwrap()
}

/// Waits until the plugin at `path` answers GetPluginInfo over gRPC (not only accepts
/// connections), for at most a minute.
fn wait_answering(path: &Path) {
    rt().block_on(async {
        let t = Instant::now();
        loop {
            let call = async {
                IdentityClient::new(unix_channel(path).await).get_plugin_info(pb::GetPluginInfoRequest {}).await
            };
            match tokio::time::timeout(Duration::from_secs(5), call).await {
                Ok(Ok(_)) => return,
                other => assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "{} does not answer GetPluginInfo: {other:?}",
                    path.display()
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn mount_cap(mode: Mode) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_mode: Some(pb::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(pb::volume_capability::AccessType::Mount(pb::volume_capability::MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

fn block_cap(mode: Mode) -> pb::VolumeCapability {
    pb::VolumeCapability {
        access_mode: Some(pb::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(pb::volume_capability::AccessType::Block(pb::volume_capability::BlockVolume {})),
    }
}

fn zone(z: &str) -> pb::Topology {
    pb::Topology { segments: [("topology.ferrovol.io/zone".to_string(), z.to_string())].into_iter().collect() }
}

fn create_req(name: &str, bytes: i64) -> pb::CreateVolumeRequest {
    pb::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(pb::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
        volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
        ..Default::default()
    }
}

async fn create(c: &mut ControllerClient<Channel>, r: pb::CreateVolumeRequest) -> Result<pb::Volume, tonic::Status> {
    c.create_volume(r).await.map(|r| r.into_inner().volume.expect("a volume"))
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(s) => s.code(),
    }
}

/// spec.md CreateVolume: idempotent by name; capacity rounded up to 4 KiB; requisite
/// then preferred topology choose the host, with room; the errors of its table.
#[test]
fn create_volume_places_by_topology_and_is_idempotent() {
    let cl = Cluster::start("2GiB", "2GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut r = create_req("pvc-in-b", 10 * MIB + 1);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![zone("zone-b")], preferred: vec![] });
        let v = create(&mut c, r.clone()).await.unwrap();
        assert_eq!(v.capacity_bytes, 10 * MIB + 4096, "rounded up to 4 KiB");
        assert_eq!(v.volume_context["ferrovol.io/host"], "host-b");
        assert_eq!(v.accessible_topology, vec![zone("zone-b")]);
        // Idempotent: the same answer, and one volume.
        assert_eq!(create(&mut c, r.clone()).await.unwrap(), v);
        assert_eq!(cl.b.volumes().as_array().unwrap().len(), 1);
        assert!(cl.a.volumes().as_array().unwrap().is_empty());
        // The same name with another size: ALREADY_EXISTS.
        assert_eq!(code(create(&mut c, create_req("pvc-in-b", 20 * MIB)).await), Code::AlreadyExists);
        // Preferred topology wins when nothing is required.
        let mut r = create_req("pvc-pref-a", MIB);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![], preferred: vec![zone("zone-a"), zone("zone-b")] });
        assert_eq!(create(&mut c, r).await.unwrap().volume_context["ferrovol.io/host"], "host-a");
        // No allowed host has room, or none is allowed: RESOURCE_EXHAUSTED.
        assert_eq!(code(create(&mut c, create_req("pvc-huge", 100 * GIB)).await), Code::ResourceExhausted);
        let mut r = create_req("pvc-nowhere", MIB);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![zone("zone-x")], preferred: vec![] });
        assert_eq!(code(create(&mut c, r).await), Code::ResourceExhausted);
        // Bad arguments change nothing.
        let mut r = create_req("pvc-bad", MIB);
        r.parameters.insert("replicas".into(), "3".into());
        let e = c.create_volume(r).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("\"replicas\""), "{}", e.message());
        let mut r = create_req("pvc-bad", MIB);
        r.volume_capabilities = vec![mount_cap(Mode::MultiNodeMultiWriter)];
        assert_eq!(code(create(&mut c, r).await), Code::InvalidArgument);
        let mut r = create_req("pvc-bad", MIB);
        r.volume_capabilities.clear();
        assert_eq!(code(create(&mut c, r).await), Code::InvalidArgument);
        assert_eq!(code(create(&mut c, create_req("", MIB)).await), Code::InvalidArgument);
        let mut r = create_req("pvc-bad", 10 * MIB);
        r.capacity_range.as_mut().unwrap().limit_bytes = MIB;
        assert_eq!(code(create(&mut c, r).await), Code::OutOfRange);
        let names: BTreeSet<String> = [cl.a.volumes(), cl.b.volumes()]
            .iter()
            .flat_map(|l| {
                l.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_string()).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(names, ["pvc-in-b", "pvc-pref-a"].into_iter().map(String::from).collect());
        assert_eq!(code(create(&mut c, create_req("pvc-too-big", 2 << 50)).await), Code::OutOfRange);
        // Without preferences volumes spread: each goes to the host with the most room
        // not yet promised to volumes (sizes minus what they hold).
        let v1 = create(&mut c, create_req("pvc-s1", 512 * MIB)).await.unwrap();
        let v2 = create(&mut c, create_req("pvc-s2", 512 * MIB)).await.unwrap();
        assert_ne!(v1.volume_context["ferrovol.io/host"], v2.volume_context["ferrovol.io/host"]);
        // Promises count: a 2 GiB host takes one 1.2 GiB volume, not two.
        let in_a = |name: &str, bytes: i64| {
            let mut r = create_req(name, bytes);
            r.accessibility_requirements =
                Some(pb::TopologyRequirement { requisite: vec![zone("zone-a")], preferred: vec![] });
            r
        };
        create(&mut c, in_a("pvc-big-1", 1200 * MIB)).await.unwrap();
        assert_eq!(code(create(&mut c, in_a("pvc-big-2", 1200 * MIB)).await), Code::ResourceExhausted);
        // A name the engine would not take as is (long, odd characters) still works,
        // and its IDs stay within 128 bytes (spec.md "Size Limits").
        let long = format!("pvc-{}", "x".repeat(124));
        let lv = create(&mut c, create_req(&long, MIB)).await.unwrap();
        assert!(lv.volume_id.len() <= 128, "{}", lv.volume_id);
        assert_eq!(create(&mut c, create_req(&long, MIB)).await.unwrap(), lv, "idempotent");
        let ls = c
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: lv.volume_id.clone(),
                name: "s p a c e s".repeat(12),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert!(ls.snapshot_id.len() <= 128, "{}", ls.snapshot_id);
        // DeleteVolume: gone, and again OK; an ID no controller made is OK too.
        c.delete_volume(pb::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest { volume_id: "some-fake-id".into(), ..Default::default() })
            .await
            .unwrap();
        assert_eq!(
            code(c.delete_volume(pb::DeleteVolumeRequest { volume_id: String::new(), ..Default::default() }).await),
            Code::InvalidArgument
        );
        assert!(cl.b.volumes().as_array().unwrap().iter().all(|x| x["name"] != "pvc-in-b"));
    });
}

/// spec.md CreateVolume with `volume_content_source`, CreateSnapshot, DeleteSnapshot:
/// a restore holds the snapshot's point in time, a clone the volume's; a larger
/// request grows the copy, a smaller one is OUT_OF_RANGE; snapshots are idempotent
/// by name and the same name of another source is ALREADY_EXISTS.
#[test]
fn snapshots_restores_and_clones_read_back_over_nbd() {
    let cl = Cluster::start("2GiB", "2GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let v = create(&mut c, create_req("pvc-src", 64 * MIB)).await.unwrap();
        let host = cl.host(&v);
        qemu_io_ok(&host.uri("pvc-src"), &["write -P 0x11 0 1M", "write -P 0x22 63M 1M"]);
        let snap_req = pb::CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "snap-1".into(),
            ..Default::default()
        };
        let s = c.create_snapshot(snap_req.clone()).await.unwrap().into_inner().snapshot.unwrap();
        assert!(s.ready_to_use);
        assert_eq!(s.source_volume_id, v.volume_id);
        assert_eq!(s.size_bytes, 64 * MIB);
        assert!(s.creation_time.as_ref().is_some_and(|t| t.seconds > 1_700_000_000));
        assert_eq!(c.create_snapshot(snap_req).await.unwrap().into_inner().snapshot.unwrap(), s, "idempotent");
        let other = create(&mut c, create_req("pvc-other", MIB)).await.unwrap();
        assert_eq!(
            code(
                c.create_snapshot(pb::CreateSnapshotRequest {
                    source_volume_id: other.volume_id.clone(),
                    name: "snap-1".into(),
                    ..Default::default()
                })
                .await
            ),
            Code::AlreadyExists
        );
        // After the snapshot, the volume changes.
        qemu_io_ok(&host.uri("pvc-src"), &["write -P 0x33 0 1M"]);
        let source = |snapshot: Option<&str>, volume: Option<&str>| {
            use pb::volume_content_source::{SnapshotSource, Type, VolumeSource};
            Some(pb::VolumeContentSource {
                r#type: Some(match (snapshot, volume) {
                    (Some(id), _) => Type::Snapshot(SnapshotSource { snapshot_id: id.into() }),
                    (_, Some(id)) => Type::Volume(VolumeSource { volume_id: id.into() }),
                    _ => unreachable!(),
                }),
            })
        };
        // Restore, grown to 128 MiB: the snapshot's data, zeros past its end.
        let mut r = create_req("pvc-restore", 128 * MIB);
        r.volume_content_source = source(Some(&s.snapshot_id), None);
        let restored = create(&mut c, r.clone()).await.unwrap();
        assert_eq!(restored.capacity_bytes, 128 * MIB);
        assert_eq!(restored.content_source, r.volume_content_source);
        assert_eq!(create(&mut c, r).await.unwrap(), restored, "idempotent");
        qemu_io_ok(&host.uri("pvc-restore"), &["read -P 0x11 0 1M", "read -P 0x22 63M 1M", "read -P 0 64M 64M"]);
        // Clone of the volume: its data now.
        let mut r = create_req("pvc-clone", 0);
        r.capacity_range = None;
        r.volume_content_source = source(None, Some(&v.volume_id));
        let clone = create(&mut c, r).await.unwrap();
        assert_eq!(clone.capacity_bytes, 64 * MIB, "a clone takes its source's size when none is asked");
        qemu_io_ok(&host.uri("pvc-clone"), &["read -P 0x33 0 1M", "read -P 0x22 63M 1M"]);
        // Smaller than the source, a source that is not there.
        let mut r = create_req("pvc-small", 32 * MIB);
        r.volume_content_source = source(Some(&s.snapshot_id), None);
        assert_eq!(code(create(&mut c, r).await), Code::OutOfRange);
        let mut r = create_req("pvc-nosrc", 64 * MIB);
        r.volume_content_source = source(Some(&format!("{}x", s.snapshot_id)), None);
        assert_eq!(code(create(&mut c, r).await), Code::NotFound);
        let mut r = create_req("pvc-nosrc", 64 * MIB);
        r.volume_content_source = source(Some("not-an-id"), None);
        assert_eq!(code(create(&mut c, r).await), Code::NotFound);
        // DeleteSnapshot: gone; again OK; the restore keeps its data.
        for _ in 0..2 {
            c.delete_snapshot(pb::DeleteSnapshotRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() })
                .await
                .unwrap();
        }
        let listed = c
            .list_snapshots(pb::ListSnapshotsRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert!(listed.entries.is_empty());
        qemu_io_ok(&host.uri("pvc-restore"), &["read -P 0x11 0 1M"]);
    });
}

/// spec.md ControllerPublishVolume / ControllerUnpublishVolume: the publish_context
/// opens the volume over NBD on a host that serves only attached nodes; another node
/// of a single-node volume is FAILED_PRECONDITION; a node no ferrovol node plugin
/// names is NOT_FOUND; unpublish cuts the node off and is idempotent; DeleteVolume of
/// a published volume is FAILED_PRECONDITION.
#[test]
fn publish_opens_the_volume_over_nbd_and_unpublish_cuts_the_node_off() {
    require("qemu-io");
    let cl = Cluster::start("1GiB", "1GiB", &["--nbd-access", "attached"]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let v = create(&mut c, create_req("pvc-pub", 16 * MIB)).await.unwrap();
        let host = cl.host(&v);
        let publish = |node: &str, mode: Mode, readonly: bool| pb::ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node.into(),
            volume_capability: Some(mount_cap(mode)),
            readonly,
            ..Default::default()
        };
        let ctx = c
            .controller_publish_volume(publish("ferrovol:node-1", Mode::SingleNodeWriter, false))
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        assert_eq!(ctx["readOnly"], "false");
        assert_eq!(ctx["nodeId"], "ferrovol:node-1");
        assert_eq!(ctx["nbdAddresses"], format!("127.0.0.1:{}", host.port));
        assert_eq!(ctx["nbdTls"], "off", "the host serves NBD without TLS");
        let export = ctx["exportName"].clone();
        assert!(export.starts_with("pvc-pub/"), "{export}");
        let uri = format!("nbd://{}/{}", ctx["nbdAddresses"], export);
        qemu_io_ok(&uri, &["write -P 0x5a 0 64k", "read -P 0x5a 0 64k"]);
        // The plain name is refused on this host.
        assert!(!qemu_io_succeeded(&qemu_io(&host.uri("pvc-pub"), &["read 0 4k"])));
        // Idempotent; incompatible; another node; a stranger.
        let again =
            c.controller_publish_volume(publish("ferrovol:node-1", Mode::SingleNodeWriter, false)).await.unwrap();
        assert_eq!(again.into_inner().publish_context["exportName"], export);
        assert_eq!(
            code(c.controller_publish_volume(publish("ferrovol:node-1", Mode::SingleNodeWriter, true)).await),
            Code::AlreadyExists
        );
        assert_eq!(
            code(c.controller_publish_volume(publish("ferrovol:node-2", Mode::SingleNodeWriter, false)).await),
            Code::FailedPrecondition
        );
        assert_eq!(
            code(c.controller_publish_volume(publish("node-1", Mode::SingleNodeWriter, false)).await),
            Code::NotFound
        );
        let mut missing = publish("ferrovol:node-1", Mode::SingleNodeWriter, false);
        missing.volume_id = format!("{}x", v.volume_id);
        assert_eq!(code(c.controller_publish_volume(missing).await), Code::NotFound);
        let got = c
            .controller_get_volume(pb::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
            .await
            .unwrap()
            .into_inner();
        let status = got.status.unwrap();
        assert_eq!(status.published_node_ids, vec!["ferrovol:node-1".to_string()]);
        assert!(!status.volume_condition.unwrap().abnormal);
        assert_eq!(
            code(
                c.delete_volume(pb::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await
            ),
            Code::FailedPrecondition
        );
        // Unpublish: the key no longer opens the volume; again is OK.
        for _ in 0..2 {
            c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
                volume_id: v.volume_id.clone(),
                node_id: "ferrovol:node-1".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        }
        assert!(!qemu_io_succeeded(&qemu_io(&uri, &["read 0 4k"])), "the old export name still opens the volume");
        // Read-only publish to another node: reads work, writes do not.
        let ctx = c
            .controller_publish_volume(publish("ferrovol:node-2", Mode::SingleNodeReaderOnly, false))
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        assert_eq!(ctx["readOnly"], "true");
        let uri = format!("nbd://{}/{}", ctx["nbdAddresses"], ctx["exportName"]);
        let o = output(peer("qemu-io").args(["-r", "-f", "raw", "-c", "read -P 0x5a 0 64k", &uri]));
        assert!(qemu_io_succeeded(&o), "{}", text(&o));
        assert!(!qemu_io_succeeded(&qemu_io(&uri, &["write -P 1 0 4k"])), "a read-only node could write");
        // Unpublish from every node (no node_id), then delete.
        c.controller_unpublish_volume(pb::ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        c.delete_volume(pb::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
    });
}

/// spec.md ListVolumes and ListSnapshots paging: every entry once, across hosts, in a
/// stable order; a token this controller did not give is ABORTED.
#[test]
fn listing_pages_through_both_hosts() {
    let cl = Cluster::start("1GiB", "1GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut made = BTreeSet::new();
        for (i, z) in ["zone-a", "zone-b", "zone-a", "zone-b", "zone-b"].iter().enumerate() {
            let mut r = create_req(&format!("pvc-{i}"), MIB);
            r.accessibility_requirements =
                Some(pb::TopologyRequirement { requisite: vec![zone(z)], preferred: vec![] });
            let v = create(&mut c, r).await.unwrap();
            c.create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: v.volume_id.clone(),
                name: format!("snap-{i}"),
                ..Default::default()
            })
            .await
            .unwrap();
            made.insert(v.volume_id);
        }
        let mut seen = Vec::new();
        let mut token = String::new();
        loop {
            let page = c
                .list_volumes(pb::ListVolumesRequest { max_entries: 2, starting_token: token.clone() })
                .await
                .unwrap()
                .into_inner();
            assert!(page.entries.len() <= 2);
            seen.extend(page.entries.iter().map(|e| e.volume.as_ref().unwrap().volume_id.clone()));
            if page.next_token.is_empty() {
                break;
            }
            token = page.next_token;
        }
        assert_eq!(seen.len(), 5, "{seen:?}");
        assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), made);
        assert_eq!(
            code(c.list_volumes(pb::ListVolumesRequest { max_entries: 1, starting_token: "bogus".into() }).await),
            Code::Aborted
        );
        let snaps = c
            .list_snapshots(pb::ListSnapshotsRequest { max_entries: 3, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(snaps.entries.len(), 3);
        let rest = c
            .list_snapshots(pb::ListSnapshotsRequest { starting_token: snaps.next_token, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(rest.entries.len(), 2);
        assert!(rest.next_token.is_empty());
        let one = made.iter().next().unwrap().clone();
        let by_source = c
            .list_snapshots(pb::ListSnapshotsRequest { source_volume_id: one.clone(), ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(by_source.entries.len(), 1);
        assert_eq!(by_source.entries[0].snapshot.as_ref().unwrap().source_volume_id, one);
    });
}

/// spec.md ControllerExpandVolume: the new size is seen over NBD; node expansion is
/// asked for mount volumes only. spec.md GetCapacity: per zone, the host's room.
#[test]
fn expansion_is_seen_over_nbd_and_capacity_is_per_zone() {
    let cl = Cluster::start("1GiB", "2GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let v = create(&mut c, create_req("pvc-grow", 16 * MIB)).await.unwrap();
        let host = cl.host(&v);
        let expand = |bytes: i64, cap: pb::VolumeCapability| pb::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(pb::CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
            volume_capability: Some(cap),
            ..Default::default()
        };
        let r =
            c.controller_expand_volume(expand(48 * MIB, mount_cap(Mode::SingleNodeWriter))).await.unwrap().into_inner();
        assert_eq!((r.capacity_bytes, r.node_expansion_required), (48 * MIB, true));
        let r =
            c.controller_expand_volume(expand(48 * MIB, block_cap(Mode::SingleNodeWriter))).await.unwrap().into_inner();
        assert_eq!((r.capacity_bytes, r.node_expansion_required), (48 * MIB, false));
        qemu_io_ok(&host.uri("pvc-grow"), &["write -P 7 47M 1M", "read -P 7 47M 1M"]);
        assert_eq!(
            code(c.controller_expand_volume(expand(0, mount_cap(Mode::SingleNodeWriter))).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(c.controller_expand_volume(expand(3 * GIB, mount_cap(Mode::SingleNodeWriter))).await),
            Code::ResourceExhausted
        );
        let mut missing = expand(64 * MIB, mount_cap(Mode::SingleNodeWriter));
        missing.volume_id = "0123456789ab/nothing".into();
        assert_eq!(code(c.controller_expand_volume(missing).await), Code::NotFound);
        let cap = |z: Option<&str>| pb::GetCapacityRequest {
            accessible_topology: z.map(zone),
            volume_capabilities: vec![mount_cap(Mode::SingleNodeWriter)],
            ..Default::default()
        };
        let a = c.get_capacity(cap(Some("zone-a"))).await.unwrap().into_inner();
        let b = c.get_capacity(cap(Some("zone-b"))).await.unwrap().into_inner();
        let all = c.get_capacity(cap(None)).await.unwrap().into_inner();
        // Room: free minus reserved bytes, minus what volumes may still write.
        let room = |s: &Server| {
            let st = s.pool_status();
            let promised: u64 = s
                .volumes()
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v["size_bytes"].as_u64().unwrap() - v["allocated_bytes"].as_u64().unwrap())
                .sum();
            (st["free_bytes"].as_u64().unwrap() - st["reserved_bytes"].as_u64().unwrap() - promised) as i64 / 4096
                * 4096
        };
        assert_eq!(a.available_capacity, room(&cl.a));
        assert_eq!(b.available_capacity, room(&cl.b));
        assert!(b.available_capacity > a.available_capacity);
        assert_eq!(all.available_capacity, a.available_capacity + b.available_capacity);
        assert_eq!(all.maximum_volume_size, Some(b.available_capacity));
        let none = c.get_capacity(cap(Some("zone-x"))).await.unwrap().into_inner();
        assert_eq!(none.available_capacity, 0);
    });
}

/// spec.md CreateVolume `mutable_parameters` and ControllerModifyVolume: QoS limits
/// from the storage class and the VolumeAttributesClass reach the volume's host; a
/// modify changes only the keys it names, online; bad keys and values are
/// INVALID_ARGUMENT naming them and change nothing.
#[test]
fn qos_parameters_set_and_modify_the_volumes_limits() {
    let cl = Cluster::start("1GiB", "1GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let caps = c
            .controller_get_capabilities(pb::ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        let modify_cap = pb::controller_service_capability::rpc::Type::ModifyVolume as i32;
        assert!(
            caps.iter().any(
                |c| matches!(&c.r#type, Some(pb::controller_service_capability::Type::Rpc(r)) if r.r#type == modify_cap)
            ),
            "MODIFY_VOLUME not offered: {caps:?}"
        );
        let params = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut r = create_req("pvc-qos", 16 * MIB);
        r.parameters = params(&[("writeIOPS", "500"), ("readIOPS", "100")]);
        r.mutable_parameters = params(&[("readIOPS", "2000"), ("readBytesPerSecond", "100Mi")]);
        let v = create(&mut c, r.clone()).await.unwrap();
        let host = cl.host(&v);
        let qos = |h: &Server| json(&h.cli_ok(&["volume", "info", "pvc-qos", "--json"]))["qos"].clone();
        let want = serde_json::json!({"read_iops": 2000, "write_iops": 500, "read_bytes_per_second": 100u64 << 20,
            "write_bytes_per_second": 0, "burst_ms": 0});
        assert_eq!(qos(host), want, "mutable_parameters over parameters");
        assert_eq!(create(&mut c, r).await.unwrap().volume_id, v.volume_id, "idempotent with its limits");

        let modify = |kv: &[(&str, &str)]| pb::ControllerModifyVolumeRequest {
            volume_id: v.volume_id.clone(),
            mutable_parameters: params(kv),
            ..Default::default()
        };
        c.controller_modify_volume(modify(&[("writeIOPS", "0"), ("burstMilliseconds", "250")])).await.unwrap();
        let want = serde_json::json!({"read_iops": 2000, "write_iops": 0, "read_bytes_per_second": 100u64 << 20,
            "write_bytes_per_second": 0, "burst_ms": 250});
        assert_eq!(qos(host), want, "only the keys named change");
        for bad in [&[("iops", "5"), ("colour", "red")][..], &[("readIOPS", "fast")], &[("burstMilliseconds", "70000")]]
        {
            let e = c.controller_modify_volume(modify(bad)).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e:?}");
            for (k, _) in bad {
                assert!(e.message().contains(k), "{bad:?}: {}", e.message());
            }
        }
        assert_eq!(qos(host), want, "refused modifies change nothing");
        c.controller_modify_volume(modify(&[])).await.unwrap();
        assert_eq!(qos(host), want, "a modify naming no key changes nothing");
        let mut gone = modify(&[("readIOPS", "1")]);
        gone.volume_id = "0123456789ab/nothing".into();
        assert_eq!(code(c.controller_modify_volume(gone).await), Code::NotFound);
        let mut r = create_req("pvc-bad", 16 * MIB);
        r.parameters = params(&[("readIOPS", "1"), ("tier", "gold")]);
        let e = create(&mut c, r).await.unwrap_err();
        assert!(e.code() == Code::InvalidArgument && e.message().contains("tier"), "{e:?}");

        // A clone (a restore) gets its own limits, not its source's.
        let snap = c
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: v.volume_id.clone(),
                name: "snap-qos".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        let mut r = create_req("pvc-restored", 16 * MIB);
        r.mutable_parameters = params(&[("writeBytesPerSecond", "10M")]);
        r.volume_content_source = Some(pb::VolumeContentSource {
            r#type: Some(pb::volume_content_source::Type::Snapshot(pb::volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id,
            })),
        });
        create(&mut c, r).await.unwrap();
        let restored = json(&host.cli_ok(&["volume", "info", "pvc-restored", "--json"]))["qos"].clone();
        assert_eq!(restored["write_bytes_per_second"], 10_000_000, "{restored}");
        assert_eq!(restored["read_iops"], 0, "{restored}");
    });
}

/// spec.md "Concurrency": ten CreateVolume calls with one name at once, then ten
/// CreateSnapshot calls: each answers OK or ABORTED, and exactly one volume and one
/// snapshot exist, on one host.
#[test]
fn concurrent_creates_of_one_name_make_one_volume_and_one_snapshot() {
    let cl = Cluster::start("1GiB", "1GiB", &[]);
    rt().block_on(async {
        let c = cl.controller().await;
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move { create(&mut c, create_req("pvc-race", 8 * MIB)).await }));
        }
        let mut ids = BTreeSet::new();
        let mut aborted = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(v) => {
                    ids.insert(v.volume_id);
                }
                Err(s) if s.code() == Code::Aborted => aborted += 1,
                Err(s) => panic!("unexpected {s:?}"),
            }
        }
        assert!(ids.len() <= 1, "{ids:?}");
        let mut c2 = c.clone();
        let v = create(&mut c2, create_req("pvc-race", 8 * MIB)).await.unwrap();
        eprintln!("{aborted} of 10 calls were ABORTED");
        let count = |s: &Server| s.volumes().as_array().unwrap().iter().filter(|x| x["name"] == "pvc-race").count();
        assert_eq!(count(&cl.a) + count(&cl.b), 1);
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let mut c = c.clone();
            let id = v.volume_id.clone();
            tasks.push(tokio::spawn(async move {
                c.create_snapshot(pb::CreateSnapshotRequest {
                    source_volume_id: id,
                    name: "snap-race".into(),
                    ..Default::default()
                })
                .await
            }));
        }
        let mut snaps = BTreeSet::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(s) => {
                    snaps.insert(s.into_inner().snapshot.unwrap().snapshot_id);
                }
                Err(s) => assert_eq!(s.code(), Code::Aborted, "{s:?}"),
            }
        }
        assert!(snaps.len() <= 1);
        let listed = c2.list_snapshots(pb::ListSnapshotsRequest::default()).await.unwrap().into_inner().entries;
        assert_eq!(listed.len(), 1, "{listed:?}");
    });
}

/// spec.md "Error Scheme" (UNAVAILABLE) and Probe: a storage host that is down makes
/// calls on its volumes UNAVAILABLE (never NOT_FOUND, never OK for a delete), is
/// skipped for placement, and is found again when it returns; a restarted controller
/// loses nothing (it keeps no state).
#[test]
fn a_host_down_is_unavailable_for_its_volumes_and_skipped_for_placement() {
    let mut cl = Cluster::start("1GiB", "1GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut r = create_req("pvc-on-b", 8 * MIB);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![zone("zone-b")], preferred: vec![] });
        let on_b = create(&mut c, r).await.unwrap();
        cl.b.kill9();
        let get = pb::ControllerGetVolumeRequest { volume_id: on_b.volume_id.clone() };
        assert_eq!(code(c.controller_get_volume(get.clone()).await), Code::Unavailable);
        assert_eq!(
            code(
                c.delete_volume(pb::DeleteVolumeRequest { volume_id: on_b.volume_id.clone(), ..Default::default() })
                    .await
            ),
            Code::Unavailable
        );
        assert_eq!(code(c.list_volumes(pb::ListVolumesRequest::default()).await), Code::Unavailable);
        // A retry of the create whose volume is on the host that is down must not make a
        // second copy elsewhere (its first answer may have been lost).
        let mut r = create_req("pvc-on-b", 8 * MIB);
        r.accessibility_requirements = None;
        assert_eq!(code(create(&mut c, r).await), Code::Unavailable);
        // Placement goes to the host that answers.
        let v = create(&mut c, create_req("pvc-while-b-down", 8 * MIB)).await.unwrap();
        assert_eq!(v.volume_context["ferrovol.io/host"], "host-a");
        let mut id = IdentityClient::new(cl.channel().await);
        assert_eq!(id.probe(pb::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
        // The host returns: its volume is there again, through a restarted controller.
        cl.b.restart();
        cl.stop_controller().await;
        cl.start_controller();
        let mut c = cl.controller().await;
        let got = c.controller_get_volume(get).await.unwrap().into_inner();
        assert_eq!(got.volume.unwrap().volume_id, on_b.volume_id);
        assert_eq!(c.list_volumes(pb::ListVolumesRequest::default()).await.unwrap().into_inner().entries.len(), 2);
        // Both hosts down: creates are UNAVAILABLE; Probe stays ready (a liveness probe
        // must not restart a controller that only waits for its hosts).
        cl.a.kill9();
        cl.b.kill9();
        let mut id = IdentityClient::new(cl.channel().await);
        assert_eq!(id.probe(pb::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));
        assert_eq!(code(create(&mut c, create_req("pvc-nowhere", MIB)).await), Code::Unavailable);
    });
    assert!(cl.log_text().contains("CreateVolume"), "every call is logged:\n{}", cl.log_text());
}

/// A storage host reached over TCP with mutual TLS (`[tls]` in the config) is managed
/// like one on a socket; a controller whose certificate the host's CA did not sign
/// finds it UNAVAILABLE (and places volumes elsewhere), never a wrong answer.
#[test]
fn a_host_over_mutual_tls_is_managed_and_a_stranger_controller_is_refused() {
    use common::certs::{ca, leaf, write};
    let dir = TestDir::new();
    let p = dir.path().to_owned();
    let (ours, other) = (ca("ferrovol test CA"), ca("another CA"));
    let (scert, skey) = leaf(&ours, "storage-b", &["127.0.0.1"], false);
    let (ccert, ckey) = leaf(&ours, "csi-controller", &[], true);
    let (xcert, xkey) = leaf(&other, "csi-controller", &[], true);
    let f = |name: &str, text: &str| write(&p, name, text).display().to_string();
    let (sc, sk, ca_pem) = (f("server.pem", &scert), f("server-key.pem", &skey), f("ca.pem", &ours.pem));
    let (cc, ck, xc, xk) = (f("ctl.pem", &ccert), f("ctl-key.pem", &ckey), f("x.pem", &xcert), f("x-key.pem", &xkey));
    let addr = format!("127.0.0.1:{}", free_port());
    let a = Server::start_with(&p.join("a"), "1GiB", &[]);
    let b = Server::start_with(
        &p.join("b"),
        "1GiB",
        &["--api-listen", &addr, "--tls-cert", &sc, "--tls-key", &sk, "--tls-client-ca", &ca_pem],
    );
    let a_sock = a.dir.join("ferrovol.sock");
    let config = |cert: &str, key: &str| {
        format!(
            "[tls]\nca = \"{ca_pem}\"\ncert = \"{cert}\"\nkey = \"{key}\"\n\n[[host]]\nname = \"host-a\"\napi = \
             \"unix://{}\"\nzone = \"zone-a\"\n\n[[host]]\nname = \"host-b\"\napi = \"{addr}\"\nzone = \"zone-b\"\n",
            a_sock.display()
        )
    };
    let stranger_config = config(&xc, &xk);
    let mut cl = Cluster::with_config(dir, a, b, &config(&cc, &ck));
    let in_b = |name: &str| {
        let mut r = create_req(name, 8 * MIB);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![zone("zone-b")], preferred: vec![] });
        r
    };
    rt().block_on(async {
        let mut c = cl.controller().await;
        let v = create(&mut c, in_b("pvc-tls")).await.unwrap();
        assert_eq!(v.volume_context["ferrovol.io/host"], "host-b");
        assert!(cl.b.volumes().as_array().unwrap().iter().any(|x| x["name"] == "pvc-tls"));
        let s = c
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: v.volume_id.clone(),
                name: "snap-tls".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(s.into_inner().snapshot.unwrap().ready_to_use);
    });
    rt().block_on(cl.stop_controller());
    std::fs::write(&cl.config, stranger_config).unwrap();
    cl.start_controller();
    rt().block_on(async {
        let mut c = cl.controller().await;
        assert_eq!(code(create(&mut c, in_b("pvc-stranger")).await), Code::Unavailable);
        let v = create(&mut c, create_req("pvc-stranger", 8 * MIB)).await.unwrap();
        assert_eq!(v.volume_context["ferrovol.io/host"], "host-a");
    });
    assert!(cl.b.volumes().as_array().unwrap().iter().all(|x| x["name"] != "pvc-stranger"));
}

/// A volume ID names its host's pool, not its address: when another pool answers at
/// the address (a host rebuilt), the old ID finds nothing there, and a delete of it
/// leaves the new pool's volume of the same name alone.
#[test]
fn an_id_never_reaches_another_pool_at_the_same_address() {
    let mut cl = Cluster::start("1GiB", "1GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut r = create_req("pvc-same", 8 * MIB);
        r.accessibility_requirements =
            Some(pb::TopologyRequirement { requisite: vec![zone("zone-a")], preferred: vec![] });
        let v = create(&mut c, r).await.unwrap();
        let get = pb::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() };
        c.controller_get_volume(get.clone()).await.unwrap();
        cl.a.kill9();
        let dir = cl.a.dir.clone();
        std::fs::rename(&dir, dir.with_extension("old")).unwrap();
        cl.a = Server::start_with(&dir, "1GiB", &[]);
        cl.a.create_volume("pvc-same", "8MiB");
        assert_eq!(code(c.controller_get_volume(get).await), Code::NotFound);
        c.delete_volume(pb::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
        assert!(
            cl.a.volumes().as_array().unwrap().iter().any(|x| x["name"] == "pvc-same"),
            "the new pool's volume was deleted"
        );
    });
}

/// The controller refuses a bad configuration at start, naming the line and why.
#[test]
fn a_bad_config_is_refused_with_its_line() {
    let dir = TestDir::new();
    let config = dir.path().join("csi.toml");
    std::fs::write(&config, "[[host]]\nname = \"a\"\napi = \"10.0.0.1:7401\"\n").unwrap();
    let o = Command::new(BIN)
        .args(["csi", "controller", "--endpoint", "tcp://127.0.0.1:1", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("line 1: host \"a\"") && e.contains("mutual TLS"), "{e}");
}

/// The standard conformance suite, csi-sanity (kubernetes-csi/csi-test), against the
/// controller over two storage hosts: every Identity and Controller case passes. The
/// Node cases are skipped here (this kernel has no NBD driver): they run in the kernel
/// VM (csi_node.rs).
#[test]
fn csi_sanity_passes_the_controller_cases() {
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/tools/csi-sanity/run.sh");
    assert!(run.exists(), "{} is missing", run.display());
    let cl = Cluster::start("4GiB", "4GiB", &[]);
    let node_sock = cl.socket.with_file_name("node.sock");
    let mut node = Command::new(BIN)
        .args(["csi", "node", "--node-name", "sanity-node", "--zone", "zone-a", "--endpoint"])
        .arg(format!("unix://{}", node_sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(&node_sock, || "node not serving".into());
    // Both plugins answer over gRPC before the suite's first spec connects.
    wait_answering(&node_sock);
    wait_answering(&cl.socket);
    // ModifyVolume's cases create a volume with these and modify it.
    let mutable = cl.socket.with_file_name("mutable.yaml");
    std::fs::write(&mutable, "readIOPS: \"1000\"\nwriteBytesPerSecond: \"50Mi\"\n").unwrap();
    let o = Command::new("bash")
        .arg(&run)
        .arg(format!("unix://{}", node_sock.display()))
        .arg("--controller-endpoint")
        .arg(format!("unix://{}", cl.socket.display()))
        .args(["-ginkgo.skip", "Node Service"])
        .arg("-csi.testvolumemutableparameters")
        .arg(&mutable)
        .env("CSI_SANITY_VOLUME_SIZE", (64 * MIB).to_string())
        .output()
        .unwrap();
    let _ = node.kill();
    let _ = node.wait();
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().rev().find(|l| l.starts_with("csi-sanity:")).unwrap_or("").to_string();
    eprintln!("{last}");
    assert!(o.status.success() && last.contains(" 0 failed"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let passed: usize = last.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(passed >= 50, "only {passed} cases ran: {last}");
}

/// spec.md "GroupController Service RPC": a group snapshot of two volumes of one host is
/// one instant of both (each member reads back its volume's data of that moment, not
/// what was written after; the engine's test proves the instant under concurrent
/// writes), idempotent by name, ALREADY_EXISTS for the name with other sources,
/// FAILED_PRECONDITION across hosts, INVALID_ARGUMENT without sources, NOT_FOUND for a
/// volume that is not there; Get finds it (and checks the member IDs it is given), a
/// member restores into a new volume, Delete checks the member IDs, removes every
/// member and is idempotent; the plugin and the service say they have it.
#[test]
fn group_snapshots_are_one_instant_of_one_host() {
    use csi::pb::group_controller_client::GroupControllerClient;
    let cl = Cluster::start("2GiB", "2GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut g = GroupControllerClient::new(cl.channel().await);
        let in_zone = |name: &str, z: &str| {
            let mut r = create_req(name, 64 * MIB);
            r.accessibility_requirements =
                Some(pb::TopologyRequirement { requisite: vec![zone(z)], preferred: vec![zone(z)] });
            r
        };
        let data = create(&mut c, in_zone("pvc-data", "zone-a")).await.unwrap();
        let log = create(&mut c, in_zone("pvc-log", "zone-a")).await.unwrap();
        let far = create(&mut c, in_zone("pvc-far", "zone-b")).await.unwrap();
        let host = cl.host(&data);
        qemu_io_ok(&host.uri("pvc-data"), &["write -P 0x11 0 1M"]);
        qemu_io_ok(&host.uri("pvc-log"), &["write -P 0x22 0 1M"]);

        let caps = g.group_controller_get_capabilities(pb::GroupControllerGetCapabilitiesRequest {}).await.unwrap();
        assert_eq!(caps.into_inner().capabilities.len(), 1);
        let plugin = IdentityClient::new(cl.channel().await)
            .get_plugin_capabilities(pb::GetPluginCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner();
        let group_service = pb::plugin_capability::service::Type::GroupControllerService as i32;
        assert!(
            plugin.capabilities.iter().any(|c| matches!(
                &c.r#type,
                Some(pb::plugin_capability::Type::Service(s)) if s.r#type == group_service
            )),
            "the plugin does not offer the GroupController service: {plugin:?}"
        );

        let req = |name: &str, ids: &[&str]| pb::CreateVolumeGroupSnapshotRequest {
            name: name.into(),
            source_volume_ids: ids.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let group = g
            .create_volume_group_snapshot(req("gs-1", &[&log.volume_id, &data.volume_id]))
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        assert!(group.ready_to_use);
        assert_eq!(group.snapshots.len(), 2);
        assert!(group.snapshots.iter().all(|s| s.group_snapshot_id == group.group_snapshot_id));
        let sources: BTreeSet<&str> = group.snapshots.iter().map(|s| s.source_volume_id.as_str()).collect();
        assert_eq!(sources, [data.volume_id.as_str(), log.volume_id.as_str()].into_iter().collect());
        qemu_io_ok(&host.uri("pvc-data"), &["write -P 0x33 0 1M"]);
        let again = g.create_volume_group_snapshot(req("gs-1", &[&data.volume_id, &log.volume_id])).await.unwrap();
        assert_eq!(again.into_inner().group_snapshot.unwrap(), group, "idempotent");
        assert_eq!(code(g.create_volume_group_snapshot(req("gs-1", &[&data.volume_id])).await), Code::AlreadyExists);
        assert_eq!(
            code(g.create_volume_group_snapshot(req("gs-2", &[&data.volume_id, &far.volume_id])).await),
            Code::FailedPrecondition,
            "a group across hosts"
        );
        assert_eq!(code(g.create_volume_group_snapshot(req("gs-2", &[])).await), Code::InvalidArgument);
        let missing = format!("{}x", data.volume_id);
        assert_eq!(code(g.create_volume_group_snapshot(req("gs-2", &[&missing])).await), Code::NotFound);

        let get = |ids: Vec<String>| pb::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: ids,
            ..Default::default()
        };
        let ids: Vec<String> = group.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
        let got = g.get_volume_group_snapshot(get(ids.clone())).await.unwrap().into_inner().group_snapshot.unwrap();
        assert_eq!(got, group);
        assert_eq!(code(g.get_volume_group_snapshot(get(vec![ids[0].clone()])).await), Code::InvalidArgument);

        // Each member holds its volume as it was at the group's instant.
        for (name, pattern) in [("pvc-data", "0x11"), ("pvc-log", "0x22")] {
            let member = group.snapshots.iter().find(|s| s.source_volume_id.ends_with(name)).unwrap();
            let mut r = create_req(&format!("{name}-restored"), 64 * MIB);
            r.volume_content_source = Some(pb::VolumeContentSource {
                r#type: Some(pb::volume_content_source::Type::Snapshot(pb::volume_content_source::SnapshotSource {
                    snapshot_id: member.snapshot_id.clone(),
                })),
            });
            let restored = create(&mut c, r).await.unwrap();
            qemu_io_ok(&cl.host(&restored).uri(&format!("{name}-restored")), &[&format!("read -P {pattern} 0 1M")]);
        }

        let wrong = g
            .delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: group.group_snapshot_id.clone(),
                snapshot_ids: vec![ids[0].clone()],
                ..Default::default()
            })
            .await;
        assert_eq!(code(wrong), Code::InvalidArgument, "Delete with member IDs that are not the group's");
        for _ in 0..2 {
            g.delete_volume_group_snapshot(pb::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: group.group_snapshot_id.clone(),
                snapshot_ids: ids.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        }
        assert_eq!(code(g.get_volume_group_snapshot(get(Vec::new())).await), Code::NotFound);
        let listed = c.list_snapshots(pb::ListSnapshotsRequest::default()).await.unwrap().into_inner();
        assert!(listed.entries.is_empty(), "members left: {:?}", listed.entries);
    });
}

/// spec.md "SnapshotMetadata Service RPC" against a model: random writes and trims by
/// qemu-io between four snapshots of a volume. For each snapshot, GetMetadataAllocated
/// lists exactly the 4 KiB blocks the model holds written; for each pair of successive
/// snapshots, GetMetadataDelta covers every block whose content differs between them
/// and nothing outside the data units (64 KiB) the step touched. Streams are ascending
/// and disjoint, honour max_results and starting_offset; bad arguments get their codes.
#[test]
fn snapshot_metadata_matches_a_model_of_writes_and_trims() {
    use csi::pb::snapshot_metadata_client::SnapshotMetadataClient;
    use std::collections::BTreeMap;
    const BLOCK: u64 = 4096;
    const UNIT: u64 = 65536;
    const SIZE: u64 = 16 * MIB as u64;
    let cl = Cluster::start("2GiB", "2GiB", &[]);
    rt().block_on(async {
        let mut c = cl.controller().await;
        let mut m = SnapshotMetadataClient::new(cl.channel().await);
        let v = create(&mut c, create_req("pvc-cbt", SIZE as i64)).await.unwrap();
        let other = create(&mut c, create_req("pvc-other", MIB)).await.unwrap();
        let uri = cl.host(&v).uri("pvc-cbt");
        // The model: block -> the version written there (absent: never written or trimmed).
        let mut model: BTreeMap<u64, u64> = BTreeMap::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut snaps: Vec<(String, BTreeMap<u64, u64>, std::collections::BTreeSet<u64>)> = Vec::new();
        let mut version = 0u64;
        for step in 0..4 {
            let mut cmds = Vec::new();
            let mut touched_units = std::collections::BTreeSet::new();
            for _ in 0..24 {
                let block = next(SIZE / BLOCK - 16);
                let blocks = 1 + next(16);
                for b in block..block + blocks {
                    touched_units.insert(b * BLOCK / UNIT);
                }
                if next(4) == 0 {
                    cmds.push(format!("discard {} {}", block * BLOCK, blocks * BLOCK));
                    for b in block..block + blocks {
                        model.remove(&b);
                    }
                } else {
                    version += 1;
                    let pattern = 1 + version % 250;
                    cmds.push(format!("write -P {pattern} {} {}", block * BLOCK, blocks * BLOCK));
                    for b in block..block + blocks {
                        model.insert(b, version);
                    }
                }
            }
            let refs: Vec<&str> = cmds.iter().map(String::as_str).collect();
            qemu_io_ok(&uri, &refs);
            let s = c
                .create_snapshot(pb::CreateSnapshotRequest {
                    source_volume_id: v.volume_id.clone(),
                    name: format!("cbt-{step}"),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .snapshot
                .unwrap();
            snaps.push((s.snapshot_id, model.clone(), touched_units));
        }

        // Collects a stream's ranges, checking each message's shape.
        async fn collect<T>(
            mut s: tonic::Streaming<T>,
            max: usize,
            parts: impl Fn(&T) -> (i32, i64, Vec<(i64, i64)>),
        ) -> Vec<(u64, u64)> {
            let mut out: Vec<(u64, u64)> = Vec::new();
            while let Some(msg) = s.message().await.unwrap() {
                let (kind, size, ranges) = parts(&msg);
                assert_eq!(kind, pb::BlockMetadataType::VariableLength as i32);
                assert_eq!(size, 16 * MIB);
                assert!(!ranges.is_empty() && ranges.len() <= max, "{} ranges in a message", ranges.len());
                for (off, len) in ranges {
                    assert!(len > 0 && off % 4096 == 0 && len % 4096 == 0, "({off}, {len})");
                    if let Some(&(po, pl)) = out.last() {
                        assert!(po + pl <= off as u64, "ranges overlap or go back: ({po},{pl}) then ({off},{len})");
                    }
                    out.push((off as u64, len as u64));
                }
            }
            out
        }
        let blocks_of = |ranges: &[(u64, u64)]| -> std::collections::BTreeSet<u64> {
            ranges.iter().flat_map(|(o, l)| (o / BLOCK)..((o + l) / BLOCK)).collect()
        };
        let allocated_req = |id: &str, start: i64, max: i32| pb::GetMetadataAllocatedRequest {
            snapshot_id: id.into(),
            starting_offset: start,
            max_results: max,
            ..Default::default()
        };
        let alloc_parts = |r: &pb::GetMetadataAllocatedResponse| {
            (
                r.block_metadata_type,
                r.volume_capacity_bytes,
                r.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)).collect(),
            )
        };
        for (id, held, _) in &snaps {
            let s = m.get_metadata_allocated(allocated_req(id, 0, 0)).await.unwrap().into_inner();
            let got = blocks_of(&collect(s, 256, alloc_parts).await);
            let want: std::collections::BTreeSet<u64> = held.keys().copied().collect();
            assert_eq!(got, want, "allocated blocks of {id}");
        }
        // Paging: 3 ranges a message, from inside a written range (the range holding
        // the offset starts there).
        let (id, held, _) = &snaps[3];
        let inside = held
            .keys()
            .copied()
            .find(|b| *b >= 4 * MIB as u64 / BLOCK && held.contains_key(&(b + 1)))
            .expect("two written blocks in a row");
        let start = ((inside + 1) * BLOCK) as i64;
        let s = m.get_metadata_allocated(allocated_req(id, start, 3)).await.unwrap().into_inner();
        let got = blocks_of(&collect(s, 3, alloc_parts).await);
        let want: std::collections::BTreeSet<u64> =
            held.keys().copied().filter(|b| *b >= start as u64 / BLOCK).collect();
        assert_eq!(got, want, "allocated blocks from {start}");

        for pair in snaps.windows(2) {
            let ((base, before, _), (target, after, units)) = (&pair[0], &pair[1]);
            let req = pb::GetMetadataDeltaRequest {
                base_snapshot_id: base.clone(),
                target_snapshot_id: target.clone(),
                ..Default::default()
            };
            let s = m.get_metadata_delta(req).await.unwrap().into_inner();
            let got = blocks_of(
                &collect(s, 256, |r: &pb::GetMetadataDeltaResponse| {
                    (
                        r.block_metadata_type,
                        r.volume_capacity_bytes,
                        r.block_metadata.iter().map(|b| (b.byte_offset, b.size_bytes)).collect(),
                    )
                })
                .await,
            );
            let changed: std::collections::BTreeSet<u64> =
                before.keys().chain(after.keys()).copied().filter(|b| before.get(b) != after.get(b)).collect();
            assert!(
                changed.is_subset(&got),
                "the delta {base} -> {target} misses {:?}",
                changed.difference(&got).next()
            );
            let outside: Vec<&u64> = got.iter().filter(|b| !units.contains(&(*b * BLOCK / UNIT))).collect();
            assert!(outside.is_empty(), "the delta lists blocks of units the step never touched: {:?}", &outside[..1]);
        }

        // Bad arguments.
        let code_of = |r: Result<
            tonic::Response<tonic::Streaming<pb::GetMetadataAllocatedResponse>>,
            tonic::Status,
        >| { r.map(|_| ()).unwrap_err().code() };
        let missing = format!("{}x", snaps[0].0);
        assert_eq!(code_of(m.get_metadata_allocated(allocated_req(&missing, 0, 0)).await), Code::NotFound);
        assert_eq!(code_of(m.get_metadata_allocated(allocated_req(&snaps[0].0, -1, 0)).await), Code::InvalidArgument);
        assert_eq!(code_of(m.get_metadata_allocated(allocated_req(&snaps[0].0, 16 * MIB, 0)).await), Code::OutOfRange);
        assert_eq!(code_of(m.get_metadata_allocated(allocated_req(&snaps[0].0, 0, -5)).await), Code::InvalidArgument);
        let other_snap = c
            .create_snapshot(pb::CreateSnapshotRequest {
                source_volume_id: other.volume_id.clone(),
                name: "cbt-other".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        let r = m
            .get_metadata_delta(pb::GetMetadataDeltaRequest {
                base_snapshot_id: other_snap.snapshot_id,
                target_snapshot_id: snaps[1].0.clone(),
                ..Default::default()
            })
            .await;
        assert_eq!(r.map(|_| ()).unwrap_err().code(), Code::InvalidArgument, "snapshots of two volumes");
    });
}
