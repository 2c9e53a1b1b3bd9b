//! `ferrovol nbd attach|detach|list`: an NBD export as a local `/dev/nbdN`, through the
//! kernel's netlink interface (`nbd::kernel`) with sockets handshaken by `nbd::client`;
//! no state file: `list` asks the kernel. Not here yet: the reconnect watcher.

use std::time::Duration;

use nbd::client::{self, Target};
use nbd::kernel::{self, Attach};

/// How long a connect and each handshake step may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);

/// Parses `nbd://HOST[:PORT]/EXPORT` (port 10809 by default) or
/// `nbd+unix:///EXPORT?socket=PATH`. The export name is the rest of the path, `/`
/// included (ferrovol's `VOLUME/KEY`); no percent-decoding.
pub(crate) fn parse_uri(uri: &str) -> anyhow::Result<(Target, String)> {
    if let Some(rest) = uri.strip_prefix("nbd+unix:///") {
        let (export, query) = rest.split_once('?').unwrap_or((rest, ""));
        let socket = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("socket="))
            .ok_or_else(|| anyhow::anyhow!("{uri}: an nbd+unix URI needs ?socket=PATH"))?;
        return Ok((Target::Unix(socket.into()), export.to_string()));
    }
    let rest = uri
        .strip_prefix("nbd://")
        .ok_or_else(|| anyhow::anyhow!("{uri}: not nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"))?;
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
    if authority.is_empty() || authority.contains('@') {
        anyhow::bail!("{uri}: not nbd://HOST[:PORT]/EXPORT");
    }
    let addr = match authority.rsplit_once(':') {
        Some((host, port)) if !authority.ends_with(']') => {
            if host.is_empty() || !port.parse::<u16>().is_ok_and(|p| p != 0) {
                anyhow::bail!("{uri}: {port:?} is not a port");
            }
            authority.to_string()
        }
        _ => format!("{authority}:10809"),
    };
    Ok((Target::Tcp(addr), export.to_string()))
}

/// Parses `/dev/nbdN`, `nbdN` or `N`.
pub(crate) fn parse_device(d: &str) -> anyhow::Result<u32> {
    let n = d.strip_prefix("/dev/").unwrap_or(d);
    let n = n.strip_prefix("nbd").unwrap_or(n);
    n.parse().map_err(|_| anyhow::anyhow!("{d:?} is not an NBD device (/dev/nbdN)"))
}

/// Attaches export `uri` with `connections` connections; prints the device.
pub(crate) fn attach(
    uri: &str,
    device: Option<&str>,
    connections: u32,
    dead_timeout: u64,
    backend: Option<String>,
) -> anyhow::Result<()> {
    let (target, export) = parse_uri(uri)?;
    let index = device.map(parse_device).transpose()?;
    if connections == 0 || connections > 16 {
        anyhow::bail!("--connections {connections}: 1 to 16");
    }
    let mut streams = Vec::new();
    let mut info: Option<client::ExportInfo> = None;
    for _ in 0..connections {
        let (s, i) = client::connect(&target, &export, HANDSHAKE_TIMEOUT)?;
        if connections > 1 && !i.multi_conn() {
            anyhow::bail!("{uri} does not allow several connections (no NBD_FLAG_CAN_MULTI_CONN): use --connections 1");
        }
        if info.as_ref().is_some_and(|first| *first != i) {
            anyhow::bail!("{uri} answered two connections differently (size, flags or block sizes)");
        }
        streams.push(s);
        info = Some(i);
    }
    let info = info.expect("one connection at least");
    let block_size = kernel_block_size(&info)?;
    // The backend identifier names the export without any key after its first '/'.
    let volume = export.split('/').next().unwrap_or_default();
    let backend = backend.unwrap_or_else(|| format!("{target}/{volume}"));
    let sockets = streams.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
    let n = kernel::connect(&Attach {
        index,
        size: info.size,
        block_size,
        server_flags: info.flags,
        sockets,
        dead_conn_timeout: (dead_timeout > 0)
            .then(|| Duration::from_secs(dead_timeout).min(kernel::MAX_DEAD_CONN_TIMEOUT)),
        backend,
    })?;
    // The kernel holds its own references to the sockets.
    drop(streams);
    out!("/dev/nbd{n}");
    Ok(())
}

/// The kernel device's logical block size for an export (proto.md "Block size
/// constraints": the client MUST honour the minimum): its preferred size, at least its
/// minimum and 512, at most 4096.
///
/// Errors: an export whose minimum is above 4096 (the kernel's largest logical block
/// size), or whose size is not a multiple of the block size.
fn kernel_block_size(info: &client::ExportInfo) -> anyhow::Result<u64> {
    let (min, pref, max) = match info.block_size {
        Some(b) => (u64::from(b.minimum), u64::from(b.preferred), u64::from(b.maximum)),
        None => (1, 4096, u64::from(u32::MAX)),
    };
    if min > 4096 {
        anyhow::bail!("export {:?} takes blocks of {min} bytes at least; the kernel's are 4096 at most", info.name);
    }
    let bs = pref.clamp(min.max(512), 4096);
    if !info.size.is_multiple_of(bs) {
        anyhow::bail!("export {:?} is {} bytes, not a multiple of its block size {bs}", info.name, info.size);
    }
    // The kernel sends requests of up to 32 MiB.
    if max < 32 << 20 {
        eprintln!(
            "ferrovol: warning: export {:?} takes requests of {max} bytes at most; the kernel may send larger ones",
            info.name
        );
    }
    Ok(bs)
}

/// Detaches `device`.
pub(crate) fn detach(device: &str) -> anyhow::Result<()> {
    kernel::disconnect(parse_device(device)?)?;
    Ok(())
}

/// Lists the NBD devices: attached or free, with their backend identifiers.
pub(crate) fn list(all: bool) -> anyhow::Result<()> {
    for d in kernel::status(None)? {
        if d.connected || all {
            out!(
                "/dev/nbd{}\t{}\t{}",
                d.index,
                if d.connected { "attached" } else { "free" },
                d.backend.as_deref().unwrap_or("-")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_and_devices_parse() {
        let (t, e) = parse_uri("nbd://10.0.2.2:10809/vol/abc123").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("10.0.2.2:10809".into()), "vol/abc123"));
        let (t, e) = parse_uri("nbd://host/vol").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("host:10809".into()), "vol"));
        let (t, e) = parse_uri("nbd+unix:///vol?socket=/run/nbd.sock").unwrap();
        assert_eq!((t, e.as_str()), (Target::Unix("/run/nbd.sock".into()), "vol"));
        let (t, e) = parse_uri("nbd://[::1]:7000/vol?tls=off").unwrap();
        assert_eq!((t, e.as_str()), (Target::Tcp("[::1]:7000".into()), "vol"));
        for bad in ["http://x/y", "nbd:///vol", "nbd+unix:///vol", "nbd://host:/v", "nbd://host:0/v", "nbd://u@h/v"] {
            assert!(parse_uri(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_device("/dev/nbd3").unwrap(), 3);
        assert_eq!(parse_device("nbd0").unwrap(), 0);
        assert_eq!(parse_device("7").unwrap(), 7);
        assert!(parse_device("/dev/sda").is_err());
    }
}
