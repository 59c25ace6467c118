//! Fiber stacks: mmap'd with a guard page (corosensei's `DefaultStack`), kept in a per-
//! scheduler pool so that spawning reuses a stack instead of two system calls.

use corosensei::stack::{DefaultStack, Stack, StackPointer};
use fibertrace_core::StackBounds;

/// A fiber's stack: corosensei's `DefaultStack`, boxed so that handing it between the pool
/// and a coroutine moves one pointer (moving the stack object itself, a few words written
/// one way and read another, stalled on store forwarding at every spawn and exit).
pub(crate) struct FiberStack(Box<DefaultStack>);

// SAFETY: delegates to `DefaultStack`, which upholds the trait's contract (a valid, aligned
// stack range that stays allocated while the value lives); the box neither moves nor changes
// the stack it holds.
unsafe impl Stack for FiberStack {
    #[inline]
    fn base(&self) -> StackPointer {
        self.0.base()
    }

    #[inline]
    fn limit(&self) -> StackPointer {
        self.0.limit()
    }
}

/// Stacks kept for reuse, per size.
const POOL_MAX: usize = 64;

pub(crate) struct Pool {
    free: Vec<(usize, FiberStack)>,
}

impl Pool {
    pub fn new() -> Self {
        Pool { free: Vec::new() }
    }

    #[inline]
    pub fn take(&mut self, size: usize) -> std::io::Result<FiberStack> {
        if let Some(i) = self.free.iter().rposition(|(s, _)| *s == size) {
            return Ok(self.free.swap_remove(i).1);
        }
        Self::new_stack(size)
    }

    #[cold]
    #[inline(never)]
    fn new_stack(size: usize) -> std::io::Result<FiberStack> {
        DefaultStack::new(size).map(|s| FiberStack(Box::new(s)))
    }

    pub fn give(&mut self, size: usize, stack: FiberStack) {
        if self.free.len() < POOL_MAX {
            self.free.push((size, stack));
        }
    }
}

/// The usable bounds of a stack. The top 16 bytes hold corosensei's parent link, which is
/// stale while the coroutine is suspended: walks never read it.
#[inline]
pub(crate) fn bounds(stack: &FiberStack) -> StackBounds {
    StackBounds::new(stack.limit().get() as u64, stack.base().get() as u64 - 16)
}
