//! Checking and repairing a stopped pool: [`check`] (read only) and [`repair`] (the
//! refcounts and free set rebuilt from the mappings, by opening it). Not here: loading
//! and the checks open shares with this (`journal`, its verify.rs), opening (`pool`).

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::{self, IoOptions};
use crate::journal::{self, read_at_file, volume_problems, RefcountRepair};
use crate::pool::lock;
use crate::Pool;

/// Result of [`check`].
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// Problems found; empty means the pool is consistent.
    pub problems: Vec<String>,
    /// What the pool opens despite: damage with no loss (a damaged older superblock
    /// slot, which the next checkpoint rewrites), and, in a pool of format version 1 or
    /// 2 only, valid log batches behind the end of the replayed log, which a crash
    /// during a commit leaves but a damaged batch of an earlier commit also does (then
    /// the commits after it were lost). From version 3 on the second case is an error.
    pub warnings: Vec<String>,
    /// Volumes, units mapped, units free, units of metadata, log batches replayed.
    pub summary: String,
    /// A copy of a checkpoint chunk or a superblock slot is damaged (named in
    /// `warnings`): [`repair`] writes it again.
    pub damaged_copies: bool,
}

/// Verifies a stopped pool without writing to it: superblock, checkpoint and log
/// checksums, mappings against refcounts, and free-space accounting.
///
/// Errors: the file cannot be opened or read, or is not a pool at all
/// ([`ErrorKind::Corrupt`]); inconsistencies that do not stop loading are listed in
/// the report instead.
pub fn check(path: &Path) -> Result<CheckReport> {
    let file = File::open(path).map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    lock(&file, false, path)?;
    let size = io::device_size(&file).map_err(|e| Error::io("size of pool", e))?;
    let mut read = read_at_file(&file);
    let accept = journal::Accept { both_copies: true, ..Default::default() };
    let loaded = journal::load(&mut read, size, accept)?;
    let mut problems = Vec::new();
    let mut warnings: Vec<String> =
        loaded.superblock_warning.iter().chain(loaded.log_warning.iter()).cloned().collect();
    // Read around, so no loss; a repair (or the next open, when it reads the copy)
    // writes the chunk again.
    warnings.extend(loaded.copy_warnings.iter().map(|w| format!("{w} (`ferrovol check --repair` does so now)")));
    let damaged_copies = !loaded.copy_warnings.is_empty() || loaded.superblock_warning.is_some();
    let unknown = journal::unknown_ro_compat(&loaded.sb);
    if unknown != 0 {
        warnings.push(format!(
            "pool uses read-only-compatible features {unknown:#x} this build does not know: checked what this build \
             reads; it will not open the pool"
        ));
    }
    for (u, stored, derived) in &loaded.refcount_mismatches {
        problems
            .push(format!("checkpoint refcount of data unit {u} is {stored} but {derived} mapping pages reference it"));
    }
    let st = &loaded.state;
    problems.extend(volume_problems(st, loaded.geo.blocks_per_unit()));
    let derived = journal::derive_refcounts(st.volumes.values().map(|v| &v.map), loaded.geo.unit_count as usize);
    let a = &st.alloc;
    let (mut used, mut meta, mut free) = (0u64, 0u64, 0u64);
    for u in 0..a.unit_count() as u32 {
        let (r, should) = (a.refcount(u), derived.refcount(u));
        match r {
            crate::meta::META => meta += 1,
            0 => free += 1,
            _ => used += 1,
        }
        if r != crate::meta::META && r != should {
            problems.push(format!("data unit {u} has refcount {r} but {should} mapping pages reference it"));
        }
    }
    if meta != loaded.checkpoint_units.len() as u64 {
        problems.push(format!(
            "{} units marked as metadata but the checkpoint has {}",
            meta,
            loaded.checkpoint_units.len()
        ));
    }
    if used + meta + free != loaded.geo.unit_count || a.free_count() != free {
        problems.push(format!(
            "free-space accounting: {used} used + {meta} metadata + {free} free != {} units (allocator free {})",
            loaded.geo.unit_count,
            a.free_count()
        ));
    }
    let summary = format!(
        "pool {}: {} volumes, {} units of {} KiB: {used} mapped, {meta} metadata, {free} free; {} log batches replayed",
        uuid::Uuid::from_bytes(loaded.geo.uuid),
        st.volumes.len(),
        loaded.geo.unit_count,
        loaded.geo.unit_size / 1024,
        loaded.batches
    );
    Ok(CheckReport { problems, warnings, summary, damaged_copies })
}

/// What [`repair`] did.
#[derive(Debug, Clone)]
pub struct RepairReport {
    /// Each refcount changed, in ascending unit order. Empty: nothing needed repair.
    pub changed: Vec<RefcountRepair>,
    /// Units referenced by no mapping that were held as used (leaked): free now.
    pub freed: u64,
    /// Damaged copies of superblock slots or checkpoint chunks [`check`] named, written
    /// again (a fresh checkpoint, both slots): their warnings, as check gave them.
    pub rewritten_copies: Vec<String>,
    /// The summary of [`check`] on the repaired pool.
    pub summary: String,
}

/// Repairs a stopped pool whose refcounts disagree with its mappings (what `check`
/// reports as refcount mismatches, and open refuses): loads it as open does, rebuilds
/// every refcount from the mappings (the number of distinct mapping pages that map
/// each unit) and the free set from those, and writes a fresh checkpoint. Each change
/// is in the report. It also writes again a damaged copy of a superblock slot or of a
/// checkpoint chunk that `check` read around (docs/on-disk-format.md 5.5). The
/// mappings are the source of truth and are not changed; a pool whose mappings or
/// records are damaged is refused, and so is one `check` finds nothing wrong with
/// (nothing is written then).
///
/// Errors: [`ErrorKind::Corrupt`] when the pool does not load or its mappings are
/// damaged (the message says so: a repair cannot fix those); [`ErrorKind::InUse`] when
/// a server has it open; [`ErrorKind::Io`].
pub fn repair(path: &Path) -> Result<RepairReport> {
    let before = check(path)?;
    let mut changed = Vec::new();
    if !before.problems.is_empty() || before.damaged_copies {
        let pool =
            Pool::open_inner(path, &IoOptions::default(), journal::Accept::default(), false, false, Some(&mut changed))
                .map_err(|e| e.op("repair pool"))?;
        pool.close().map_err(|e| e.op("repair pool"))?;
    }
    let after = check(path)?;
    if let Some(p) = after.problems.first() {
        return Err(Error::corrupt(format!(
            "{p} ({} problem(s) left that a repair of the refcounts cannot fix)",
            after.problems.len()
        ))
        .op("repair pool"));
    }
    let freed = changed.iter().filter(|(_, _, now)| *now == 0).count() as u64;
    let rewritten_copies = if before.damaged_copies { before.warnings } else { Vec::new() };
    Ok(RepairReport { changed, freed, rewritten_copies, summary: after.summary })
}
