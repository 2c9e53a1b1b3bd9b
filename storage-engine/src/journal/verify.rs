//! Checks of a loaded pool's state that its checksums cannot make (records written
//! wrong, or damage whose checksum was recomputed), and the rebuild of its refcounts
//! from its mappings: shared by open (`pool/open.rs`) and the offline checker
//! (`check.rs`), which sit above this. Not here: loading (`recovery.rs`), opening.

use super::{derive_refcounts, State};
use crate::error::{Error, Result};
use crate::meta::Allocator;
use crate::names::{validate_name, validate_size};

/// One refcount a repair changed (`crate::repair`, or open when asked): `(data unit, refcount found, refcount now)`, the
/// latter the number of distinct mapping pages that map the unit.
pub type RefcountRepair = (u32, u32, u32);

/// What is wrong with the loaded volumes that checksums cannot catch (a record written
/// wrong, or damage whose checksum was recomputed): invalid or duplicate names, sizes
/// that are not a multiple of 4096 or past 1 PiB, mappings past a volume's end, and
/// written-block bits past a unit's blocks. Run by `check`, and by open, which
/// refuses such a pool rather than serve and keep the damage.
pub(crate) fn volume_problems(st: &State, bpu: u64) -> Vec<String> {
    let mut problems = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (id, v) in &st.volumes {
        let name_ok = match v.name.split_once('@') {
            Some((vol, snap)) => v.snapshot && validate_name(vol).is_ok() && validate_name(snap).is_ok(),
            None => !v.snapshot && validate_name(&v.name).is_ok(),
        };
        if !name_ok || !names.insert(v.name.clone()) {
            problems.push(format!("volume {id} has an invalid or duplicate name '{}'", v.name));
        }
        if validate_size(v.size).is_err() {
            problems.push(format!("volume '{}' has an invalid size {}", v.name, v.size));
        }
        let units = st.units_of(v.size);
        for (lunit, e) in v.map.mapped() {
            if lunit >= units {
                problems.push(format!("volume '{}' maps logical unit {lunit} past its end", v.name));
            }
            if bpu < 32 && e.bitmap >> bpu != 0 {
                problems.push(format!(
                    "volume '{}' logical unit {lunit} has bitmap bits past the unit's {bpu} blocks",
                    v.name
                ));
            }
        }
    }
    problems
}

/// Replaces the refcounts of `st` (a loaded pool, its log replayed) by those its
/// mappings imply, and its free set by what follows from them; returns each change.
///
/// Errors: [`ErrorKind::Corrupt`](crate::ErrorKind::Corrupt) when a mapped unit is also a unit of the checkpoint
/// (`checkpoint_units`): the mappings are damaged.
pub(crate) fn rebuild_refcounts(st: &mut State, checkpoint_units: &[u32]) -> Result<Vec<RefcountRepair>> {
    let units = st.alloc.unit_count() as usize;
    let derived = derive_refcounts(st.volumes.values().map(|v| &v.map), units);
    let mut changed = Vec::new();
    for u in 0..units as u32 {
        let (found, should) = (st.alloc.refcount(u), derived.refcount(u));
        if found == crate::meta::META {
            if should > 0 {
                return Err(Error::corrupt(format!(
                    "data unit {u} is mapped and holds the checkpoint: the mappings are damaged, and a repair \
                     rebuilds only what derives from them: restore the pool from a copy"
                )));
            }
        } else if found != should {
            changed.push((u, found, should));
        }
    }
    if !changed.is_empty() {
        let mut a = Allocator::new(units);
        for &u in checkpoint_units {
            a.set_loaded(u, crate::meta::META);
        }
        for (u, r) in derived.nonzero_refcounts() {
            a.set_loaded(u, r);
        }
        a.counts = st.alloc.counts;
        st.alloc = a;
        for &(u, found, should) in &changed {
            tracing::warn!(unit = u, found, now = should, "repaired the refcount of a data unit");
        }
    }
    Ok(changed)
}
