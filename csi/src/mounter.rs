//! What the node plugin does to a node's devices and mounts, through the tools the
//! kubelet's own mount code uses (`mount`, `umount`, `blkid`, `mkfs.ext4`, `mkfs.xfs`,
//! `resize2fs`, `xfs_growfs`) and `/proc/self/mountinfo`. Blocking.
//!
//! Not here: CSI semantics ([`crate::node`]) and NBD ([`nbd::attach`]).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The file systems a mount volume may have.
pub const FS_TYPES: &[&str] = &["ext4", "xfs"];

/// One line of `/proc/self/mountinfo` (proc(5)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The path within the mounted file system that is mounted (`/` for a whole one;
    /// `/nbd0` for a device node bind-mounted from devtmpfs).
    pub root: String,
    /// Where it is mounted.
    pub target: PathBuf,
    /// Per-mount options (`ro`, `rw`, ...).
    pub options: Vec<String>,
    /// The file system type.
    pub fs_type: String,
    /// The source (a device path, or the file system's name).
    pub source: String,
}

impl Mount {
    /// Mounted read-only.
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }

    /// The block device this mount shows: its source for a file system on a device, or
    /// the device node bind-mounted (from devtmpfs) for a raw block volume.
    pub fn device(&self) -> Option<PathBuf> {
        if self.fs_type == "devtmpfs" && self.root != "/" {
            return Some(Path::new("/dev").join(self.root.trim_start_matches('/')));
        }
        self.source.starts_with("/dev/").then(|| PathBuf::from(&self.source))
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 4 <= b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u16, |v, c| v * 8 + u16::from(c - b'0')))
            .and_then(|v| u8::try_from(v).ok());
        if let Some(byte) = octal {
            out.push(byte);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        // id parent major:minor root target options [optional...] - fstype source super
        let Some(dash) = f.iter().position(|x| *x == "-") else { continue };
        if f.len() < dash + 3 || dash < 6 {
            continue;
        }
        out.push(Mount {
            root: unescape(f[3]),
            target: PathBuf::from(unescape(f[4])),
            options: f[5].split(',').map(str::to_string).collect(),
            fs_type: f[dash + 1].to_string(),
            source: unescape(f[dash + 2]),
        });
    }
    out
}

/// The mounts of this process's namespace.
///
/// Errors: mountinfo unreadable.
pub fn mounts() -> Result<Vec<Mount>, String> {
    std::fs::read_to_string("/proc/self/mountinfo").map(|t| parse_mountinfo(&t)).map_err(|e| format!("mountinfo: {e}"))
}

/// The topmost mount at `path`, if any. `path` is resolved first when it exists
/// (mountinfo shows real paths, and a kubelet root may sit behind a symlink).
pub fn mount_at(all: &[Mount], path: &Path) -> Option<Mount> {
    let path = resolve(path);
    all.iter().rev().find(|m| m.target == path).cloned()
}

/// `path` with its symlinks resolved if it exists, else only [`normalize`]d.
pub fn resolve(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| normalize(path))
}

/// `path` without a trailing `/` or `.` parts (no symlinks resolved).
pub fn normalize(path: &Path) -> PathBuf {
    path.components().collect()
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let msg = if err.trim().is_empty() { String::from_utf8_lossy(&out.stdout).into_owned() } else { err.into_owned() };
    Err(format!("{cmd} {}: {} ({})", args.join(" "), msg.trim(), out.status))
}

/// What a device holds, as `blkid -p` (low-level probing, no cache) sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No signature at all.
    Empty,
    /// A file system of this type.
    FileSystem(String),
    /// Something else: a partition table, a RAID or LUKS member... (its description).
    Other(String),
}

/// Probes `dev` for signatures.
///
/// Errors: blkid missing or failing (other than "nothing found", its exit status 2).
pub fn probe(dev: &Path) -> Result<Probe, String> {
    let d = dev.to_string_lossy();
    let out = Command::new("blkid").args(["-p", "-o", "export", &d]).output().map_err(|e| format!("blkid: {e}"))?;
    match out.status.code() {
        Some(2) => return Ok(Probe::Empty),
        Some(0) => {}
        _ => return Err(format!("blkid -p {d}: {} ({})", String::from_utf8_lossy(&out.stderr).trim(), out.status)),
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |k: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{k}=")).map(str::to_string));
    match (get("TYPE"), get("USAGE"), get("PTTYPE")) {
        (Some(t), Some(u), _) if u == "filesystem" => Ok(Probe::FileSystem(t)),
        (Some(t), _, _) => Ok(Probe::Other(format!("a {t} signature"))),
        (None, _, Some(pt)) => Ok(Probe::Other(format!("a {pt} partition table"))),
        _ => Ok(Probe::Other(text.lines().collect::<Vec<_>>().join(" "))),
    }
}

/// Makes a file system of `fs` (one of [`FS_TYPES`]) on `dev`, without discarding (the
/// volume is thin and unwritten: there is nothing to discard).
///
/// Errors: the tool's message.
pub fn mkfs(dev: &Path, fs: &str) -> Result<(), String> {
    let d = dev.to_string_lossy();
    match fs {
        "ext4" => run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1", &d]),
        "xfs" => run("mkfs.xfs", &["-q", "-K", &d]),
        other => Err(format!("no mkfs for {other}")),
    }
    .map(|_| ())
}

/// Mounts `dev` (a file system of type `fs`) on `target` with `options`.
///
/// Errors: the tool's message.
pub fn mount(dev: &Path, target: &Path, fs: &str, options: &[String]) -> Result<(), String> {
    let mut args = vec!["-t".to_string(), fs.to_string()];
    if !options.is_empty() {
        args.push("-o".into());
        args.push(options.join(","));
    }
    args.push(dev.to_string_lossy().into_owned());
    args.push(target.to_string_lossy().into_owned());
    run("mount", &args.iter().map(String::as_str).collect::<Vec<_>>()).map(|_| ())
}

/// Bind-mounts `source` (a directory or a device node) on `target`, read-only if asked.
///
/// Errors: the tool's message (the bind is undone if the read-only remount fails).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), String> {
    let (s, t) = (source.to_string_lossy(), target.to_string_lossy());
    run("mount", &["--bind", &s, &t])?;
    if read_only {
        if let Err(e) = run("mount", &["-o", "remount,bind,ro", &t]) {
            let _ = umount(target);
            return Err(e);
        }
    }
    Ok(())
}

/// Unmounts `target`.
///
/// Errors: the tool's message (for a busy mount: "target is busy").
pub fn umount(target: &Path) -> Result<(), String> {
    run("umount", &[&target.to_string_lossy()]).map(|_| ())
}

/// Grows the file system of type `fs` on `dev`, mounted at `mounted`, to the device's
/// size.
///
/// Errors: the tool's message; a type that cannot grow online.
pub fn grow(dev: &Path, mounted: &Path, fs: &str) -> Result<(), String> {
    match fs {
        "ext4" | "ext3" | "ext2" => run("resize2fs", &[&dev.to_string_lossy()]).map(|_| ()),
        "xfs" => run("xfs_growfs", &[&mounted.to_string_lossy()]).map(|_| ()),
        other => Err(format!("cannot grow a {other} file system")),
    }
}

/// Bytes and inodes of the file system at `path`: (total, available, used) bytes and
/// (total, free, used) inodes.
///
/// Errors: statvfs failed.
pub fn usage(path: &Path) -> Result<([u64; 3], [u64; 3]), String> {
    let s = rustix::fs::statvfs(path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    let b = s.f_frsize;
    let bytes = [s.f_blocks * b, s.f_bavail * b, (s.f_blocks - s.f_bfree) * b];
    let inodes = [s.f_files, s.f_ffree, s.f_files.saturating_sub(s.f_ffree)];
    Ok((bytes, inodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse() {
        let text = "36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    40 22 0:5 /nbd0 /var/lib/kubelet/pods/x/dev/pvc ro,relatime shared:2 - devtmpfs udev rw\n\
                    41 22 43:0 / /staging rw - xfs /dev/nbd0 rw\n\
                    bad line\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].target, PathBuf::from("/mnt/parent dir"));
        assert_eq!((m[0].fs_type.as_str(), m[0].source.as_str(), m[0].root.as_str()), ("ext3", "/dev/root", "/mnt1"));
        assert!(!m[0].read_only());
        assert_eq!(m[1].device(), Some(PathBuf::from("/dev/nbd0")));
        assert!(m[1].read_only());
        assert_eq!(m[2].device(), Some(PathBuf::from("/dev/nbd0")));
        assert_eq!(mount_at(&m, Path::new("/staging/")).map(|m| m.fs_type), Some("xfs".to_string()));
        assert_eq!(mount_at(&m, Path::new("/nothing")), None);
        // Not octal, or past a byte: kept as written; a trailing backslash too.
        assert_eq!(unescape("a\\777b\\09x\\"), "a\\777b\\09x\\");
        assert_eq!(unescape("\\134\\011"), "\\\t");
    }
}
