//! Fiber stacks: mmap'd with a guard page (corosensei's `DefaultStack`), kept in a per-
//! scheduler pool so that spawning reuses a stack instead of two system calls.

use corosensei::stack::{DefaultStack, Stack};
use fibertrace_core::StackBounds;

/// Stacks kept for reuse, per size.
const POOL_MAX: usize = 64;

pub(crate) struct Pool {
    free: Vec<(usize, DefaultStack)>,
}

impl Pool {
    pub fn new() -> Self {
        Pool { free: Vec::new() }
    }

    pub fn take(&mut self, size: usize) -> std::io::Result<DefaultStack> {
        if let Some(i) = self.free.iter().rposition(|(s, _)| *s == size) {
            return Ok(self.free.swap_remove(i).1);
        }
        DefaultStack::new(size)
    }

    pub fn give(&mut self, size: usize, stack: DefaultStack) {
        if self.free.len() < POOL_MAX {
            self.free.push((size, stack));
        }
    }
}

/// The usable bounds of a stack. The top 16 bytes hold corosensei's parent link, which is
/// stale while the coroutine is suspended: walks never read it.
pub(crate) fn bounds(stack: &DefaultStack) -> StackBounds {
    StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16)
}
