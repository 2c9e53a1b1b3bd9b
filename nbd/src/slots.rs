//! Connection slots: the counts the connection caps apply to ([`Live`]: in all and per
//! export, each slot uncounted when dropped) and the runtimes connections are placed on.
//! Not here: the caps' values (config.rs), where they are taken (server.rs, handshake.rs).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A runtime connections may be placed on, and how many of them it serves now.
pub(crate) struct Placement {
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) connections: Arc<AtomicUsize>,
}

/// One connection counted on a [`Placement`]; uncounted on drop.
pub(crate) struct PlacementSlot(pub(crate) Arc<AtomicUsize>);

impl Drop for PlacementSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Open connections, in all and per export.
#[derive(Default)]
pub(crate) struct Live {
    pub(crate) total: AtomicUsize,
    per_export: Mutex<HashMap<String, usize>>,
}

/// One connection counted in [`Live`]'s total; uncounted on drop.
pub(crate) struct ConnectionSlot(Arc<Live>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection counted against an export; uncounted on drop.
pub(crate) struct ExportSlot {
    live: Arc<Live>,
    name: String,
}

impl Drop for ExportSlot {
    fn drop(&mut self) {
        let mut m = self.live.per_export.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.name);
            }
        }
    }
}

impl Live {
    pub(crate) fn enter(self: &Arc<Self>, max: usize) -> Option<ConnectionSlot> {
        let mut cur = self.total.load(Ordering::Acquire);
        loop {
            if cur >= max {
                return None;
            }
            match self.total.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(ConnectionSlot(Arc::clone(self))),
                Err(now) => cur = now,
            }
        }
    }

    /// Counts one more connection on export `name`, unless it already has `max`.
    pub(crate) fn enter_export(self: &Arc<Self>, name: &str, max: usize) -> Option<ExportSlot> {
        let mut m = self.per_export.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(name.to_owned()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ExportSlot { live: Arc::clone(self), name: name.to_owned() })
    }
}
