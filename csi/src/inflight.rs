//! One operation at a time per volume or snapshot name: a second call on a name while
//! the first runs gets `ABORTED` (spec.md "Concurrency"; the sidecars retry), as in
//! Mayastor's CSI driver.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::CsiError;

/// The names with a call in flight.
#[derive(Debug, Default, Clone)]
pub(crate) struct InFlight(Arc<Mutex<HashSet<String>>>);

/// Held while a call runs on its name; dropping it frees the name.
#[derive(Debug)]
pub(crate) struct Guard {
    set: InFlight,
    key: String,
}

impl InFlight {
    /// Takes `key` (`volume/NAME` or `snapshot/NAME`) for the caller.
    ///
    /// Errors: `ABORTED` when a call on `key` is in flight.
    pub(crate) fn take(&self, key: String) -> Result<Guard, CsiError> {
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !set.insert(key.clone()) {
            return Err(CsiError::new(
                tonic::Code::Aborted,
                format!("an operation on {key} is in progress; retry when it has finished"),
            ));
        }
        Ok(Guard { set: self.clone(), key })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.set.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}
