//! Range locks and pins of the data path. A write holds the range locks of its logical
//! units (the store's `stripes`, striped by volume and logical unit) until its bitmap
//! bits are set: exclusively for the units of the partial 4 KiB blocks at its edges
//! (read, merged and rewritten, so that no concurrent write to the block is undone),
//! shared for the rest (so that a trim cannot unmap a unit before the write marks its
//! blocks); a trim holds them exclusively while it clears bits. In-flight I/O pins the
//! data units it reads or writes ([`Pins`]), so a trim or delete cannot hand them to
//! another volume before it completes.
//!
//! Not here: the lock order (the store's module docs), plans (plan.rs).

use crate::store::Store;

/// Which units a range lock call takes exclusively.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Exclusive<'a> {
    /// Every unit of the range.
    All,
    /// These (the rest of the range shared).
    Only(&'a [u64]),
}

/// A held range lock.
pub(crate) enum StripeGuard<'a> {
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'a, ()>),
    Exclusive(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'a, ()>),
}

/// Index of the lock stripe for (`volume`, `key`) among `n` stripes.
pub(crate) fn stripe_of(volume: u64, key: u64, n: usize) -> usize {
    let h = (volume.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key).wrapping_mul(0xff51_afd7_ed55_8ccd);
    // The high bits mix best; 32 of them cover any stripe count in use.
    (h >> 32) as usize % n
}

/// The stripes a call locking logical units `units` of `volume` takes, out of `n`, as
/// `(stripe, exclusive)`: each stripe once, in index order (so two callers never wait
/// for each other in a cycle), exclusive if any unit that falls in it is.
pub(crate) fn stripes_to_lock(
    volume: u64,
    units: std::ops::Range<u64>,
    exclusive: Exclusive<'_>,
    n: usize,
) -> Vec<(usize, bool)> {
    let all = matches!(exclusive, Exclusive::All);
    let mut want: Vec<(usize, bool)> = if units.end - units.start >= n as u64 {
        (0..n).map(|s| (s, all)).collect()
    } else {
        units.map(|u| (stripe_of(volume, u, n), all)).collect()
    };
    if let Exclusive::Only(some) = exclusive {
        want.extend(some.iter().map(|&u| (stripe_of(volume, u, n), true)));
    }
    // Exclusive sorts after shared for the same stripe; keep the last of each.
    want.sort_unstable();
    want.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 |= later.1;
        }
        same
    });
    want
}

/// Takes the range locks of logical units `units` of `volume` ([`stripes_to_lock`]).
pub(crate) async fn lock_units<'a>(
    store: &'a Store,
    volume: u64,
    units: std::ops::Range<u64>,
    exclusive: Exclusive<'_>,
) -> Vec<StripeGuard<'a>> {
    let stripes = store.stripes();
    let want = stripes_to_lock(volume, units, exclusive, stripes.len());
    let mut guards = Vec::with_capacity(want.len());
    for (s, excl) in want {
        let lock = &stripes[s];
        guards.push(if excl {
            StripeGuard::Exclusive(lock.write().await)
        } else {
            StripeGuard::Shared(lock.read().await)
        });
    }
    guards
}

/// Data units pinned by in-flight I/O; unpinned when dropped.
pub(crate) struct Pins<'a> {
    store: &'a Store,
    units: Vec<u32>,
}

impl<'a> Pins<'a> {
    /// No unit pinned yet.
    pub(crate) fn new(store: &'a Store) -> Pins<'a> {
        Pins { store, units: Vec::new() }
    }

    /// Pins `u` (once more, unless it is the last one pinned).
    pub(crate) fn add(&mut self, u: u32) {
        if self.units.last() != Some(&u) {
            self.store.pins().add(u);
            self.units.push(u);
        }
    }
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        for &u in &self.units {
            self.store.pins().sub(u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unaligned_write_locks_only_its_edge_units_exclusively() {
        // Units 10..14 of volume 3, the write's first and last blocks partial.
        let n = 4096;
        let want = stripes_to_lock(3, 10..14, Exclusive::Only(&[10, 13]), n);
        let excl: Vec<usize> = want.iter().filter(|(_, e)| *e).map(|(s, _)| *s).collect();
        let mut edge: Vec<usize> = [10, 13].iter().map(|&u| stripe_of(3, u, n)).collect();
        edge.sort_unstable();
        assert_eq!(excl, edge, "exclusive: the edge units' stripes only");
        assert_eq!(want.len(), 4, "each unit's stripe once");
        assert!(want.windows(2).all(|w| w[0].0 < w[1].0), "in index order");
        // An aligned write takes none exclusively; a trim takes all.
        assert!(stripes_to_lock(3, 10..14, Exclusive::Only(&[]), n).iter().all(|(_, e)| !e));
        assert!(stripes_to_lock(3, 10..14, Exclusive::All, n).iter().all(|(_, e)| *e));
    }

    #[test]
    fn a_range_as_long_as_the_stripes_takes_each_stripe_once() {
        let want = stripes_to_lock(1, 0..100, Exclusive::Only(&[99]), 16);
        assert_eq!(want.len(), 16);
        assert_eq!(want.iter().filter(|(_, e)| *e).count(), 1);
    }
}
