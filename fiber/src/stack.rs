//! Fiber stacks: mmap'd with a guard region below them, kept in a per-scheduler pool so that
//! spawning reuses a stack instead of system calls.
//!
//! A stack is one mapping, `[guard | reserve | usable]`, from low to high addresses:
//! - the usable part is the size asked for;
//! - the reserve ([`RESERVE`] bytes) is inaccessible until the fiber overflows into it: then
//!   [`crate::overflow`] opens it, if the scheduler has an overflow handler (the Lua host's
//!   raises LuaJIT's `C stack overflow` at the next Lua instruction, and the reserve is the
//!   room that error needs), and closes it again once the stack has unwound; without a
//!   handler, a fault there is an overflow like one into the guard;
//! - the guard is [`GUARD`] bytes of inaccessible memory, not one page: a C function with a
//!   large frame (LuaJIT's `string.gsub` keeps an 8 KiB buffer on the stack) could step over
//!   a single page into whatever is mapped below. A fault in it is reported (which fiber) and
//!   the process stops.
//!
//! The memory is reserved without commitment (`MAP_NORESERVE`): untouched stack pages cost
//! no memory. [`bounds`] include the reserve (frames may live there while it is open).

use corosensei::stack::{Stack, StackPointer};
use fibertrace_core::StackBounds;

pub(crate) use crate::overflow::{GUARD, RESERVE};

const PAGE: usize = 4096;

/// A fiber's stack: `[GUARD | RESERVE | usable]` in one private anonymous mapping, unmapped on
/// drop.
pub(crate) struct FiberStack {
    /// Start of the mapping (the guard's start).
    map: usize,
    /// Length of the mapping.
    len: usize,
}

impl FiberStack {
    fn new(size: usize) -> std::io::Result<FiberStack> {
        let usable = size
            .max(PAGE)
            .checked_next_multiple_of(PAGE)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let len = usable
            .checked_add(GUARD + RESERVE)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a new private anonymous mapping (no address hint, no file); the result is
        // checked before use.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let stack = FiberStack {
            map: map as usize,
            len,
        };
        // SAFETY: the range lies inside the mapping just made (GUARD and RESERVE are
        // page-aligned).
        let rc = unsafe {
            libc::mprotect(
                (stack.map + GUARD + RESERVE) as *mut libc::c_void,
                usable,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if rc != 0 {
            // (Dropping `stack` unmaps it.)
            return Err(std::io::Error::last_os_error());
        }
        if let Some((_, reserve)) = address_space_reserve() {
            if !fibertrace_core::heap::room_for(reserve) {
                // The stack fits, but what the rest of the process maps next would not:
                // refused as if it did not fit (dropping `stack` unmaps it).
                return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
            }
        }
        Ok(stack)
    }
}

/// Under an address-space limit (`RLIMIT_AS`, `ulimit -v`), the limit and the room a new
/// stack must leave free for the rest of the process: a sixteenth of the limit, at least
/// 8 MiB and at most 64 MiB. Without it, spawning up to the limit left nothing for the next
/// mapping anywhere in the process (a thread's stack, the main thread's next allocation:
/// a Rust allocation that fails aborts the process). `None` without a limit. Read at each
/// new mapping (a program may lower its limit while it runs); stacks taken from the pool
/// take no new address space and do not ask.
pub(crate) fn address_space_reserve() -> Option<(u64, usize)> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain query into a local.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0;
    if !ok || rl.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let reserve = (rl.rlim_cur / 16).clamp(8 << 20, 64 << 20) as usize;
    Some((rl.rlim_cur, reserve))
}

impl FiberStack {
    /// The start of the reserve (the lowest address of [`bounds`]).
    fn reserve(&self) -> u64 {
        (self.map + GUARD) as u64
    }
}

impl Drop for FiberStack {
    fn drop(&mut self) {
        // An overflow handled in this stack may have left its reserve open.
        crate::overflow::forget_reserve(self.reserve(), false);
        // SAFETY: the mapping was made by `new` and is unmapped once, here; no coroutine runs
        // on it any more (corosensei drops its stack only after the coroutine is done).
        unsafe { libc::munmap(self.map as *mut libc::c_void, self.len) };
    }
}

// SAFETY: base and limit bound the read-write part of a mapping this value owns for its whole
// life; base is 16-byte aligned (page-aligned) and above limit.
unsafe impl Stack for FiberStack {
    #[inline]
    fn base(&self) -> StackPointer {
        StackPointer::new(self.map + self.len).expect("a mapping is not at address 0")
    }

    /// The whole mapping's start: corosensei's limit includes the guard.
    #[inline]
    fn limit(&self) -> StackPointer {
        StackPointer::new(self.map).expect("a mapping is not at address 0")
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
        FiberStack::new(size)
    }

    /// Unmaps the stacks kept.
    pub fn clear(&mut self) {
        self.free = Vec::new();
    }

    pub fn give(&mut self, size: usize, stack: FiberStack) {
        // The next fiber gets the reserve closed, whatever this one did.
        crate::overflow::forget_reserve(stack.reserve(), true);
        if self.free.len() < POOL_MAX {
            self.free.push((size, stack));
        }
    }
}

/// The bounds of a stack: above the guard (the reserve included), and below the top 16 bytes,
/// which hold corosensei's parent link (stale while the coroutine is suspended: walks never
/// read it).
#[inline]
pub(crate) fn bounds(stack: &FiberStack) -> StackBounds {
    StackBounds::new(
        (stack.limit().get() + GUARD) as u64,
        stack.base().get() as u64 - 16,
    )
}
