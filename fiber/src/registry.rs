//! The process-wide registry of schedulers and their fibers, readable from any thread.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::control::{FiberId, FiberShared};
use crate::sample::Sampler;

/// Fibers by id (a hash map: a spawn and an exit each cost one insert or remove; readers sort).
type FiberMap =
    HashMap<FiberId, Arc<FiberShared>, BuildHasherDefault<fibertrace_core::symbolize::AddrHasher>>;

static NEXT_SCHED: AtomicU64 = AtomicU64::new(1);
static SCHEDULERS: Mutex<Vec<Weak<SchedShared>>> = Mutex::new(Vec::new());

/// What other threads may see of a scheduler.
pub struct SchedShared {
    /// Its id.
    pub id: u64,
    /// Its name.
    pub name: String,
    pub(crate) fibers: Mutex<FiberMap>,
    pub(crate) sampler: Sampler,
    /// Whether it is idle, waiting for a timer (a stall detector must not fire then).
    pub(crate) idle: AtomicBool,
}

impl std::fmt::Debug for SchedShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedShared")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish()
    }
}

impl SchedShared {
    pub(crate) fn add(&self, f: Arc<FiberShared>) {
        self.fibers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(f.id, f);
    }

    pub(crate) fn remove(&self, id: FiberId) {
        self.fibers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Its live fibers, in id order.
    pub fn fibers(&self) -> Vec<Arc<FiberShared>> {
        let map = self.fibers.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(FiberId, &Arc<FiberShared>)> = map.iter().map(|(&id, f)| (id, f)).collect();
        // Sorted by the copied ids, then cloned in that order: control blocks are allocated
        // in id order, so the clones walk memory forward instead of hopping at random.
        v.sort_unstable_by_key(|(id, _)| *id);
        v.into_iter().map(|(_, f)| f.clone()).collect()
    }
}

pub(crate) fn register(name: String) -> Arc<SchedShared> {
    let s = Arc::new(SchedShared {
        id: NEXT_SCHED.fetch_add(1, Ordering::Relaxed),
        name,
        fibers: Mutex::new(FiberMap::default()),
        sampler: Sampler::new(),
        idle: AtomicBool::new(false),
    });
    let mut all = SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.push(Arc::downgrade(&s));
    s
}

pub(crate) fn unregister(s: &Arc<SchedShared>) {
    let mut all = SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(s)));
}

/// Every live scheduler of the process.
pub fn schedulers() -> Vec<Arc<SchedShared>> {
    SCHEDULERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect()
}

/// Finds a fiber by id in any scheduler.
pub fn find(id: FiberId) -> Option<(Arc<SchedShared>, Arc<FiberShared>)> {
    for s in schedulers() {
        let f = s
            .fibers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned();
        if let Some(f) = f {
            return Some((s, f));
        }
    }
    None
}
