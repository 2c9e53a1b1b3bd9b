//! What the administrative commands print: `volume ...`, `snapshot ...`, `pool status`
//! (clients of the management API) and `check` (on a stopped pool). Not here: parsing
//! (args.rs), the server (the `ferrovol` library).

use std::path::PathBuf;
use std::process::ExitCode;

use mgmt_api::{Client, Volume};

use crate::args::{SnapshotCmd, Target, VolumeCmd};

/// A client of the management API at `target`.
async fn connect(target: &Target) -> anyhow::Result<Client> {
    Ok(match target {
        Target::Unix(socket) => Client::connect_unix(socket).await?,
        Target::Tls(addr, tls) => Client::connect_tls(addr, tls).await?,
    })
}

fn human(bytes: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// QoS limits as `volume info` shows them: `read 1000 IOPS, write 50.0 MiB/s, burst 200 ms`.
fn qos_text(q: Option<&mgmt_api::Qos>) -> String {
    let Some(q) = q else { return "unlimited".to_owned() };
    let mut parts = Vec::new();
    for (what, iops, bps) in
        [("read", q.read_iops, q.read_bytes_per_second), ("write", q.write_iops, q.write_bytes_per_second)]
    {
        if iops > 0 {
            parts.push(format!("{what} {iops} IOPS"));
        }
        if bps > 0 {
            parts.push(format!("{what} {}/s", human(bps)));
        }
    }
    if q.burst_ms > 0 {
        parts.push(format!("burst {} ms", q.burst_ms));
    }
    if parts.is_empty() {
        "unlimited".to_owned()
    } else {
        parts.join(", ")
    }
}

fn volume_json(v: &Volume) -> serde_json::Value {
    let qos = v.qos.as_ref().map(|q| {
        serde_json::json!({
            "read_iops": q.read_iops, "write_iops": q.write_iops, "read_bytes_per_second": q.read_bytes_per_second,
            "write_bytes_per_second": q.write_bytes_per_second, "burst_ms": q.burst_ms,
        })
    });
    serde_json::json!({
        "qos": qos,
        "name": v.name, "id": v.id, "size_bytes": v.size_bytes,
        "allocated_bytes": v.allocated_bytes, "created_unix": v.created_unix, "export_name": v.export_name,
        "snapshot": v.snapshot, "exclusive_bytes": v.exclusive_bytes, "shared_bytes": v.shared_bytes,
        "pristine": v.pristine, "labels": v.labels, "local_device": v.local_device,
        "attachments": v.attachments.iter().map(|a| serde_json::json!({
            "node_id": a.node_id, "read_only": a.read_only, "exclusive": a.exclusive, "created_unix": a.created_unix,
        })).collect::<Vec<_>>(),
    })
}

/// One row per volume; the NAME column is as wide as the longest name (at least 24).
fn print_table(vs: &[Volume]) {
    let w = vs.iter().map(|v| v.name.chars().count()).max().unwrap_or(0).max(24);
    let d = vs.iter().map(|v| v.local_device.chars().count()).max().unwrap_or(0).max(12);
    out!(
        "{:<w$} {:>12} {:>12} {:>12} {:>12}  {:<d$}",
        "NAME",
        "SIZE",
        "ALLOCATED",
        "EXCLUSIVE",
        "SHARED",
        "LOCAL DEVICE"
    );
    for v in vs {
        out!(
            "{:<w$} {:>12} {:>12} {:>12} {:>12}  {:<d$}",
            v.name,
            human(v.size_bytes),
            human(v.allocated_bytes),
            human(v.exclusive_bytes),
            human(v.shared_bytes),
            if v.local_device.is_empty() { "-" } else { &v.local_device }
        );
    }
}

/// `ferrovol snapshot ...` against the server at `target`.
pub(crate) async fn snapshot_cmd(target: &Target, cmd: SnapshotCmd) -> anyhow::Result<()> {
    let c = connect(target).await?;
    match cmd {
        SnapshotCmd::Create { volume, snapshot } => {
            let v = c.create_snapshot(&volume, &snapshot).await?;
            out!("created snapshot {}", v.name);
        }
        SnapshotCmd::CreateGroup { snapshot, volumes } => {
            let req = mgmt_api::pb::CreateGroupSnapshotRequest { volumes, snapshot, ..Default::default() };
            for v in c.create_group_snapshot(req).await? {
                out!("created snapshot {}", v.name);
            }
        }
        SnapshotCmd::List { volume, json } => {
            let vs = c.list_snapshots(volume.as_deref()).await?;
            if json {
                out!("{}", serde_json::Value::Array(vs.iter().map(volume_json).collect()));
            } else {
                print_table(&vs);
            }
        }
        SnapshotCmd::Delete { volume, snapshot } => {
            c.delete_snapshot(&volume, &snapshot).await?;
            out!("deleted snapshot {volume}@{snapshot}");
        }
        SnapshotCmd::Diff { from, to, json } => {
            let ranges = c.diff(&from, &to).await?;
            if json {
                let r: Vec<_> =
                    ranges.iter().map(|r| serde_json::json!({"offset": r.offset, "length": r.length})).collect();
                out!("{}", serde_json::Value::Array(r));
            } else {
                for r in &ranges {
                    out!("{} {}", r.offset, r.length);
                }
                let total: u64 = ranges.iter().map(|r| r.length).sum();
                say!("{} ranges, {} bytes differ", ranges.len(), total);
            }
        }
    }
    Ok(())
}

/// `ferrovol volume ...` against the server at `target`.
pub(crate) async fn volume_cmd(target: &Target, cmd: VolumeCmd) -> anyhow::Result<()> {
    let c = connect(target).await?;
    match cmd {
        VolumeCmd::Create { name, size, labels, exist_ok, qos } => {
            let qos = qos.over(mgmt_api::Qos::default());
            let req = mgmt_api::pb::CreateVolumeRequest {
                name,
                size_bytes: size,
                labels: labels.into_iter().collect(),
                exist_ok,
                qos: (qos != mgmt_api::Qos::default()).then_some(qos),
            };
            let v = c.create_volume_with(req).await?;
            // With --exist-ok the answer does not tell a new volume from a matching one.
            let what = if exist_ok { "volume (created, or there already)" } else { "created volume" };
            out!("{what} {} ({} bytes, {})", v.name, v.size_bytes, human(v.size_bytes));
        }
        VolumeCmd::SetQos { name, clear, qos } => {
            let base = if clear { mgmt_api::Qos::default() } else { c.volume(&name).await?.qos.unwrap_or_default() };
            let req = mgmt_api::pb::SetVolumeQosRequest { name, qos: Some(qos.over(base)) };
            let v = c.set_volume_qos(req).await?;
            out!("volume {}: QoS {}", v.name, qos_text(v.qos.as_ref()));
        }
        VolumeCmd::AttachLocal { name } => {
            let d = c.attach_local(&name).await?;
            out!("{}", d.path);
        }
        VolumeCmd::DetachLocal { name } => {
            let d = c.detach_local(&name).await?;
            out!("detached {} from {}", d.name, d.path);
        }
        VolumeCmd::List { json } => {
            let vs = c.list_volumes().await?;
            if json {
                out!("{}", serde_json::Value::Array(vs.iter().map(volume_json).collect()));
            } else {
                print_table(&vs);
            }
        }
        VolumeCmd::Info { name, json } => {
            let v = c.volume(&name).await?;
            if json {
                out!("{}", volume_json(&v));
            } else {
                out!(
                    "name: {}\ntype: {}\nid: {}\nsize: {} ({})\nallocated: {} ({})\nexport: {}",
                    v.name,
                    if v.snapshot { "snapshot (read-only)" } else { "volume" },
                    v.id,
                    v.size_bytes,
                    human(v.size_bytes),
                    v.allocated_bytes,
                    human(v.allocated_bytes),
                    v.export_name
                );
                out!("written: {}", if v.pristine { "never (reads as zeros)" } else { "yes" });
                if !v.local_device.is_empty() {
                    out!("local device: {}", v.local_device);
                }
                if !v.snapshot {
                    out!("qos: {}", qos_text(v.qos.as_ref()));
                }
                let mut labels: Vec<_> = v.labels.iter().collect();
                labels.sort();
                for (k, val) in labels {
                    out!("label: {k}={val}");
                }
                for a in &v.attachments {
                    out!(
                        "published to: {} ({}{})",
                        a.node_id,
                        if a.read_only { "read-only" } else { "read-write" },
                        if a.exclusive { ", exclusive" } else { "" }
                    );
                }
            }
        }
        VolumeCmd::Publish { name, node, read_only, exclusive, json } => {
            let req = mgmt_api::pb::PublishVolumeRequest { volume: name, node_id: node, read_only, exclusive };
            let a = c.publish(req).await?;
            if json {
                out!(
                    "{}",
                    serde_json::json!({
                        "volume": a.volume, "node_id": a.node_id, "read_only": a.read_only, "exclusive": a.exclusive,
                        "export_name": a.export_name, "nbd_addresses": a.nbd_addresses, "size_bytes": a.size_bytes,
                        "created_unix": a.created_unix,
                    })
                );
            } else {
                out!("published {} to node {}{}", a.volume, a.node_id, if a.read_only { " (read-only)" } else { "" });
                out!("export name: {}", a.export_name);
                for addr in &a.nbd_addresses {
                    out!("nbd://{addr}/{}", a.export_name);
                }
            }
        }
        VolumeCmd::Unpublish { name, node } => {
            if c.unpublish(&name, &node).await? {
                out!("unpublished {name} from node {node}; its connections are closed");
            } else {
                out!("{name} was not published to node {node}");
            }
        }
        VolumeCmd::Delete { name } => {
            c.delete_volume(&name).await?;
            out!("deleted volume {name}");
        }
        VolumeCmd::Clone { from, name } => {
            let v = c.clone_volume(&from, &name).await?;
            out!("created volume {} from {from}", v.name);
        }
        VolumeCmd::Resize { name, size } => {
            let v = c.resize_volume(&name, size).await?;
            out!("resized volume {} to {} bytes ({})", v.name, v.size_bytes, human(v.size_bytes));
        }
    }
    Ok(())
}

/// `ferrovol host info` against the server at `target`.
pub(crate) async fn host_info(target: &Target, json: bool) -> anyhow::Result<()> {
    let c = connect(target).await?;
    let h = c.host_info().await?;
    if json {
        out!(
            "{}",
            serde_json::json!({
                "host_id": h.host_id, "nbd_addresses": h.nbd_addresses, "nbd_access": h.nbd_access,
                "capacity_bytes": h.capacity_bytes, "free_bytes": h.free_bytes, "reserved_bytes": h.reserved_bytes,
                "unit_size_bytes": h.unit_size_bytes, "format_version": h.format_version,
                "software_version": h.software_version, "nbd_tls": h.nbd_tls,
            })
        );
    } else {
        out!("host {}", h.host_id);
        out!("nbd: {} (access: {}, tls: {})", h.nbd_addresses.join(", "), h.nbd_access, h.nbd_tls);
        out!(
            "capacity {}  free {} (of which {} reserved for metadata)  unit size {}",
            human(h.capacity_bytes),
            human(h.free_bytes),
            human(h.reserved_bytes),
            human(u64::from(h.unit_size_bytes))
        );
        out!("pool format version {}  ferrovol {}", h.format_version, h.software_version);
    }
    Ok(())
}

/// `ferrovol pool status` against the server at `target`.
pub(crate) async fn pool_status(target: &Target, json: bool) -> anyhow::Result<()> {
    let c = connect(target).await?;
    print_pool_status(c.pool_status().await?, json);
    Ok(())
}

/// `ferrovol pool grow [--size SIZE]`: grows the pool and prints its status after.
pub(crate) async fn pool_grow(target: &Target, size: Option<u64>, json: bool) -> anyhow::Result<()> {
    if size == Some(0) {
        anyhow::bail!("--size 0 is not a pool size (leave --size out to take the file's or device's size)");
    }
    let c = connect(target).await?;
    let before = c.pool_status().await?.size_bytes;
    let s = c.grow_pool(size.unwrap_or(0)).await?;
    if !json {
        match s.size_bytes > before {
            true => out!("pool grown from {} to {}", human(before), human(s.size_bytes)),
            false => out!("pool already {}: nothing to grow", human(s.size_bytes)),
        }
    }
    print_pool_status(s, json);
    Ok(())
}

fn print_pool_status(s: mgmt_api::pb::PoolStatus, json: bool) {
    if json {
        out!(
            "{}",
            serde_json::json!({
                "uuid": s.uuid, "path": s.path, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes,
                "metadata_bytes": s.metadata_bytes, "free_bytes": s.free_bytes, "reserved_bytes": s.reserved_bytes,
                "unit_size_bytes": s.unit_size_bytes, "size_bytes": s.size_bytes,
                "volume_count": s.volume_count, "direct_io": s.direct_io, "failed": s.failed, "nbd_endpoints": s.nbd_endpoints,
            })
        );
    } else {
        out!("pool {} at {} ({})", s.uuid, s.path, human(s.size_bytes));
        out!(
            "capacity {}  used {}  metadata {}  free {} (of which {} reserved for metadata)",
            human(s.capacity_bytes),
            human(s.used_bytes),
            human(s.metadata_bytes),
            human(s.free_bytes),
            human(s.reserved_bytes)
        );
        out!(
            "unit size {}  volumes and snapshots {}  O_DIRECT {}  failed {}",
            human(u64::from(s.unit_size_bytes)),
            s.volume_count,
            s.direct_io,
            s.failed
        );
        for e in s.nbd_endpoints {
            out!("nbd: {e}");
        }
    }
}

/// `ferrovol check [--repair]` on the stopped pool at `path`: exit 0 clean (or
/// repaired), 1 with the problems (or a refused repair), 2 when the pool cannot be
/// checked (in use, missing, unreadable).
pub(crate) async fn check(path: PathBuf, repair: bool) -> anyhow::Result<ExitCode> {
    match repair {
        true => {
            let report = match tokio::task::spawn_blocking(move || storage_engine::repair(&path)).await? {
                Ok(r) => r,
                Err(e) if e.kind() == storage_engine::ErrorKind::Corrupt => {
                    out!("PROBLEM: {e}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(e) => {
                    say!("ferrovol: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            for (unit, found, now) in &report.changed {
                out!("repaired: data unit {unit} had refcount {found}; {now} mapping pages map it");
            }
            for w in &report.rewritten_copies {
                out!("rewritten: {w}");
            }
            if report.changed.is_empty() && report.rewritten_copies.is_empty() {
                out!("nothing to repair");
            } else if report.changed.is_empty() {
                out!("damaged copies written again; a fresh checkpoint was written");
            } else {
                out!(
                    "{} refcounts repaired ({} leaked units free again); a fresh checkpoint was written",
                    report.changed.len(),
                    report.freed
                );
            }
            out!("{}", report.summary);
            out!("clean");
            Ok(ExitCode::SUCCESS)
        }
        false => {
            let report = match tokio::task::spawn_blocking(move || storage_engine::check(&path)).await? {
                Ok(r) => r,
                Err(e) if e.kind() == storage_engine::ErrorKind::Corrupt => {
                    // Not even loadable: an inconsistency too.
                    out!("PROBLEM: {e}");
                    return Ok(ExitCode::FAILURE);
                }
                Err(e) => {
                    say!("ferrovol: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            out!("{}", report.summary);
            for w in &report.warnings {
                out!("warning: {w}");
            }
            if report.problems.is_empty() {
                out!("clean");
                Ok(ExitCode::SUCCESS)
            } else {
                for p in &report.problems {
                    out!("PROBLEM: {p}");
                }
                out!("{} problems", report.problems.len());
                Ok(ExitCode::FAILURE)
            }
        }
    }
}
