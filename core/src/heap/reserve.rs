//! An emergency reserve for the process's allocator: when the inner allocator has no memory
//! left (the address-space limit reached, say, after a Lua heap took everything), allocations
//! are served from a fixed arena set aside in the program image, so that the code that
//! *reports* — `fiber.info()`, a dump, a crash report — can finish instead of aborting the
//! process (Rust's reaction to a failed allocation, on stable Rust, is to abort).
//!
//! Invariants: the arena is one per process (a `static`), shared by every [`Reserve`]. Its
//! state is a single word — the number of live arena blocks, the arena's epoch, and the
//! offset of the first byte not carved since it last emptied — changed only by
//! compare-and-swap, so a block is handed out once; the offset goes back to 0 (and the epoch
//! on by one) only by the free that leaves no block live. A block up to 64 KiB is carved
//! in a size class (a power of two from 16 bytes, aligned to its size up to a page); freed
//! out of order, it goes on its class's free list, a lock-free stack whose head carries the
//! epoch its blocks were freed in, and is handed out again before any untouched byte. A list
//! of an earlier epoch is empty (its blocks were given back whole when the arena emptied):
//! a carve counts its block live before it looks at a list, so the epoch cannot change
//! while it does. The links of the lists are kept beside the arena, not in the free blocks,
//! so that no byte a caller holds is ever read or written here. A pointer is the arena's
//! when it lies inside the arena's bytes: those are freed and reallocated here, every other
//! one by the inner allocator.
//!
//! Code that does not allocate through Rust — the C library's own bookkeeping (registering a
//! thread-local's destructor, say), a Lua heap — cannot use the arena. For it, [`set_aside`]
//! takes some address space at the start and the first failure gives it back (once), then
//! asks the inner allocator again: under an address-space limit, that is room for the C
//! library too.
//!
//! Past the arena, last, a block up to 64 KiB takes the symbolizer's set-aside room
//! (`symbolize::set_aside_room`, given back whole): frames left unnamed beat an abort.
//!
//! How it can fall short: the reserve is [`RESERVE_BYTES`]; an allocation that does not fit
//! in what is left of it, nor in the symbolizer's room, fails as before (the process aborts;
//! a line on the standard error says how much of the reserve was in use). A block over 64 KiB freed out of order is not
//! reused until every arena block is free, nor is a freed block of one class for another
//! (up to half of a class block is padding). Memory that the inner allocator refuses for a
//! reason other than exhaustion (an impossible layout) is refused here too only when it does
//! not fit.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// The bytes set aside (8 MiB): in the image's zero-filled data, so no page is touched — nor
/// counted in the resident memory — before the inner allocator first fails.
pub const RESERVE_BYTES: usize = 8 << 20;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; RESERVE_BYTES]>);

// SAFETY: the bytes are only reached through blocks handed out by `carve` (each block to
// one owner, by the compare-and-swap on `STATE`); the arena itself is never read or
// written as a whole.
unsafe impl Sync for Arena {}

static ARENA: Arena = Arena(UnsafeCell::new([0; RESERVE_BYTES]));

/// Live blocks (bits 44-63) | epoch (bits 24-43) | offset of the first byte not carved since
/// the arena last emptied (bits 0-23).
static STATE: AtomicU64 = AtomicU64::new(0);

/// Bits of an offset (and of an offset + 1, in a list's head and links).
const OFF_BITS: u32 = 24;
const OFF_MASK: u64 = (1 << OFF_BITS) - 1;
/// Bits of the epoch (in `STATE` and a list's head) and of a list's change count.
const MID_BITS: u32 = 20;
const MID_MASK: u64 = (1 << MID_BITS) - 1;
const TOP_SHIFT: u32 = OFF_BITS + MID_BITS;

/// The smallest class's block; class `k` is of `MIN_CLASS << k` bytes.
const MIN_CLASS: usize = 16;
/// Size classes: 16 bytes to 64 KiB.
const CLASSES: usize = 13;

/// Each class's free list: its blocks' epoch (bits 44-63) | a count of the head's changes,
/// so that a head seen again after others took and gave back blocks is not taken for the
/// same (bits 24-43) | the first block's offset + 1 (bits 0-23; 0: empty).
static FREE: [AtomicU64; CLASSES] = [const { AtomicU64::new(0) }; CLASSES];

/// The link of each listed block, by its offset / `MIN_CLASS`: the next block's offset + 1
/// (0: the last). Beside the arena, in zero-filled data (2 MiB of address space, touched only
/// where blocks are listed).
static LINKS: [AtomicU32; RESERVE_BYTES / MIN_CLASS] =
    [const { AtomicU32::new(0) }; RESERVE_BYTES / MIN_CLASS];

/// Allocations served from the arena since the process began.
static SERVED: AtomicU64 = AtomicU64::new(0);

/// The address space set aside by [`set_aside`]: its start (page-aligned) with its length in
/// pages in the low 12 bits, one word so that it is taken and given back whole; 0: none.
static ASIDE: AtomicUsize = AtomicUsize::new(0);

/// Most bytes [`set_aside`] takes (4,095 pages).
pub const SET_ASIDE_MAX: usize = 4095 * PAGE;

const PAGE: usize = 4096;

const _: () = assert!(
    RESERVE_BYTES < 1 << OFF_BITS,
    "offsets are 24 bits in `STATE`"
);
const _: () = assert!(
    RESERVE_BYTES / MIN_CLASS < 1 << MID_BITS,
    "the live count is 20 bits in `STATE` (blocks over 64 KiB are few)"
);

thread_local! {
    /// Set while this thread allocates for a heap that raises its own out-of-memory error
    /// (see [`keep_reserve_out`]).
    static NO_RESERVE: Cell<bool> = const { Cell::new(false) };
}

/// Keeps the reserve and the set-aside space out of this thread's allocations while held: a
/// refusal of the inner allocator is a refusal (the heap tracker's own bookkeeping meanwhile
/// is still served). For an allocator of a heap that handles running out itself (a Lua state
/// raises `not enough memory`): it would otherwise take the reserve first, keep it in its
/// live objects, and leave nothing for the reports. A guard, not a closure, so that the
/// allocating function stays the frame a heap record sees first.
pub struct ReserveKeptOut {
    was: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// See [`ReserveKeptOut`].
#[inline]
pub fn keep_reserve_out() -> ReserveKeptOut {
    ReserveKeptOut {
        was: NO_RESERVE.try_with(|c| c.replace(true)).unwrap_or(false),
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for ReserveKeptOut {
    #[inline]
    fn drop(&mut self) {
        let _ = NO_RESERVE.try_with(|c| c.set(self.was));
    }
}

/// Whether a refusal now stays one: under [`keep_reserve_out`], except for the heap
/// tracker's own bookkeeping (its tables: allocations nested inside a tracked allocation),
/// which the reserve serves.
fn reserve_kept_out() -> bool {
    NO_RESERVE.try_with(Cell::get).unwrap_or(true) && super::tracked_depth() <= 1
}

/// Whether a thread with a `stack`-byte stack can be started now: always without an
/// address-space limit; under one, whether that much and 1 MiB besides can be mapped. The
/// standard library maps a new thread's signal stack as the thread starts and aborts the
/// process when it cannot: at the memory limit, code that would start a helper thread does
/// its work where it is instead.
pub fn room_for_thread(stack: usize) -> bool {
    room_for(stack.saturating_add(1 << 20))
}

/// Whether `bytes` of address space can be had now: always without an address-space limit
/// (`ulimit -v`); under one, whether that much can be mapped (it is not kept). For work that
/// allocates a lot where a failed allocation aborts the process (a report of megabytes): it
/// can be declined instead.
pub fn room_for(bytes: usize) -> bool {
    crate::symbolize::address_space_room(bytes)
}

/// Under an address-space limit (`RLIMIT_AS`, `ulimit -v`), has glibc's allocator serve
/// every thread from one arena: each thread's own arena reserves 64 MiB of address space
/// (two helper threads of a program under `ulimit -v 700000` left its Lua heap 245 MB where
/// it had 382). Without a limit, or on another C library, nothing. Call it early, before
/// threads start. Whether it was set.
pub fn one_arena_under_limit() -> bool {
    // SAFETY: getrlimit fills a struct of ours.
    let limited = unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_AS, &mut r) == 0 && r.rlim_cur != libc::RLIM_INFINITY
    };
    if !limited {
        return false;
    }
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallopt sets a tunable of glibc's allocator; M_ARENA_MAX takes a count.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        false
    }
}

/// Takes `bytes` (rounded up to pages, at most [`SET_ASIDE_MAX`]) of address space — no
/// memory: a mapping nothing may touch — to give back at the first allocation the inner
/// allocator refuses, for the code that cannot use the arena (see the module docs). Call it
/// once, early: a call while space is set aside keeps it (after it was given back, a call
/// sets aside anew). Whether the space was taken.
pub fn set_aside(bytes: usize) -> bool {
    if bytes == 0 || bytes > SET_ASIDE_MAX || ASIDE.load(Ordering::Acquire) != 0 {
        return false;
    }
    let pages = bytes.div_ceil(PAGE);
    // SAFETY: a fresh anonymous mapping, not accessible, placed by the kernel: it touches no
    // existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    if ASIDE
        .compare_exchange(0, p as usize | pages, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // SAFETY: the mapping just made, never published.
        unsafe { libc::munmap(p, pages * PAGE) };
        return false;
    }
    true
}

/// Gives the set-aside space back, once, for a refused request of `size` bytes it could
/// hold (a larger one, or an impossible one, would not fit in it anyway): whether it did.
#[cold]
fn give_back(size: usize) -> bool {
    let seen = ASIDE.load(Ordering::Acquire);
    if seen == 0 || size > (seen & (PAGE - 1)) * PAGE {
        return false;
    }
    let taken = ASIDE.swap(0, Ordering::AcqRel);
    if taken == 0 {
        return false;
    }
    // SAFETY: the mapping made by `set_aside`, start and length in the one word taken out of
    // `ASIDE` by this swap alone (nobody else unmaps it); nothing lives in it.
    unsafe {
        libc::munmap(
            (taken & !(PAGE - 1)) as *mut libc::c_void,
            (taken & (PAGE - 1)) * PAGE,
        )
    };
    true
}

fn base() -> usize {
    ARENA.0.get() as usize
}

fn holds(ptr: *mut u8) -> bool {
    let p = ptr as usize;
    p >= base() && p < base() + RESERVE_BYTES
}

fn live_of(s: u64) -> u64 {
    s >> TOP_SHIFT
}

fn epoch_of(s: u64) -> u64 {
    (s >> OFF_BITS) & MID_MASK
}

fn next_of(s: u64) -> usize {
    (s & OFF_MASK) as usize
}

/// The block for `size` bytes at `align`: its class (`None`: over 64 KiB, carved to size),
/// its bytes and its alignment.
fn shape(size: usize, align: usize) -> (Option<usize>, usize, usize) {
    let need = size.max(align).max(MIN_CLASS);
    if need > MIN_CLASS << (CLASSES - 1) {
        return (None, size.max(1), align);
    }
    let bytes = need.next_power_of_two();
    let k = (bytes / MIN_CLASS).trailing_zeros() as usize;
    (Some(k), bytes, bytes.min(PAGE))
}

/// A block of the arena for `layout`, or null when what is left does not hold it.
#[cold]
fn carve(layout: Layout) -> *mut u8 {
    // The arena's base is page-aligned: an offset aligned to `align` (at most a page here; a
    // larger alignment fails) gives an aligned address.
    if layout.align() > PAGE {
        return std::ptr::null_mut();
    }
    let (class, bytes, align) = shape(layout.size(), layout.align());
    // Counted live first: the arena cannot empty, and the epoch stays, while this carve
    // looks at a free list.
    let mut cur = STATE.load(Ordering::Relaxed);
    let epoch = loop {
        let new = cur + (1 << TOP_SHIFT);
        match STATE.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break epoch_of(cur),
            Err(seen) => cur = seen,
        }
    };
    if let Some(off) = class.and_then(|k| pop(k, epoch)) {
        SERVED.fetch_add(1, Ordering::Relaxed);
        return (base() + off) as *mut u8;
    }
    let mut cur = STATE.load(Ordering::Relaxed);
    loop {
        let start = (next_of(cur) + align - 1) & !(align - 1);
        let end = match start.checked_add(bytes) {
            Some(end) if end <= RESERVE_BYTES => end,
            _ => {
                uncount();
                return std::ptr::null_mut();
            }
        };
        let new = (cur & !OFF_MASK) | end as u64;
        match STATE.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => {
                SERVED.fetch_add(1, Ordering::Relaxed);
                return (base() + start) as *mut u8;
            }
            Err(seen) => cur = seen,
        }
    }
}

/// One live block fewer; the last one empties the arena (the next epoch begins, with every
/// byte untouched and every free list empty).
fn uncount() {
    let mut cur = STATE.load(Ordering::Relaxed);
    loop {
        debug_assert!(live_of(cur) > 0, "a free of an arena block with none live");
        let emptied = live_of(cur) <= 1;
        let new = if emptied {
            ((epoch_of(cur) + 1) & MID_MASK) << OFF_BITS
        } else {
            cur - (1 << TOP_SHIFT)
        };
        match STATE.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => {
                if emptied {
                    clear_stale_lists();
                }
                return;
            }
            Err(seen) => cur = seen,
        }
    }
}

/// Empties the lists of an earlier epoch (they are empty to every carve already), so that
/// no list outlives the 2^20 epochs after which its epoch would read as current again. A
/// list changed meanwhile is left (a change makes it current).
fn clear_stale_lists() {
    for head in &FREE {
        let h = head.load(Ordering::Relaxed);
        if h != 0 && h >> TOP_SHIFT != epoch_of(STATE.load(Ordering::Relaxed)) {
            let _ = head.compare_exchange(h, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}

/// A block of class `k` freed in `epoch` (the current one: the caller holds a live block),
/// taken off its list: its offset.
fn pop(k: usize, epoch: u64) -> Option<usize> {
    let head = &FREE[k];
    let mut h = head.load(Ordering::Acquire);
    loop {
        if h & OFF_MASK == 0 || h >> TOP_SHIFT != epoch {
            return None;
        }
        let off = (h & OFF_MASK) as usize - 1;
        // Another thread may take this block first and list it again, with another link:
        // then the head's change count differs and the swap below fails.
        let link = u64::from(LINKS[off / MIN_CLASS].load(Ordering::Relaxed));
        let count = ((h >> OFF_BITS) + 1) & MID_MASK;
        let new = epoch << TOP_SHIFT | count << OFF_BITS | link;
        match head.compare_exchange_weak(h, new, Ordering::Acquire, Ordering::Acquire) {
            Ok(_) => return Some(off),
            Err(seen) => h = seen,
        }
    }
}

/// Lists block `off` of class `k`, freed in `epoch` (the current one: the block is still
/// counted live). A list of an earlier epoch is dropped for it.
fn push(k: usize, off: usize, epoch: u64) {
    let head = &FREE[k];
    let mut h = head.load(Ordering::Relaxed);
    loop {
        let first = if h >> TOP_SHIFT == epoch {
            h & OFF_MASK
        } else {
            0
        };
        LINKS[off / MIN_CLASS].store(first as u32, Ordering::Relaxed);
        let count = ((h >> OFF_BITS) + 1) & MID_MASK;
        let new = epoch << TOP_SHIFT | count << OFF_BITS | (off as u64 + 1);
        match head.compare_exchange_weak(h, new, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(seen) => h = seen,
        }
    }
}

/// Gives block `ptr` (made for `size` bytes at `align`) back: the last one carved gives its
/// bytes back at once (a report's temporary allocations come and go mostly in that order),
/// another one of a class goes on its free list, and the arena empties itself when no block
/// is live.
fn release(ptr: *mut u8, size: usize, align: usize) {
    let off = ptr as usize - base();
    let (class, bytes, _) = shape(size, align);
    let mut cur = STATE.load(Ordering::Relaxed);
    loop {
        let live = live_of(cur);
        debug_assert!(live > 0, "a free of an arena block with none live");
        if live <= 1 || off + bytes != next_of(cur) {
            break;
        }
        let new = (cur - (1 << TOP_SHIFT)) & !OFF_MASK | off as u64;
        match STATE.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return,
            Err(seen) => cur = seen,
        }
    }
    // Listed while still counted (the epoch it is listed in is the current one), unless the
    // arena is about to empty anyway.
    if let Some(k) = class.filter(|_| live_of(cur) > 1) {
        push(k, off, epoch_of(cur));
    }
    uncount();
}

/// Grows or shrinks block `ptr` (made for `size` bytes at `align`) to `new_size` where it
/// is, when it is the last one carved, the arena holds the new size and the new block's
/// alignment allows: whether it did.
fn resize_last(ptr: *mut u8, size: usize, align: usize, new_size: usize) -> bool {
    if new_size > size && reserve_kept_out() {
        return false;
    }
    let off = ptr as usize - base();
    let (_, bytes, _) = shape(size, align);
    let (_, new_bytes, new_align) = shape(new_size, align);
    let end = off.saturating_add(new_bytes);
    if !off.is_multiple_of(new_align) || end > RESERVE_BYTES {
        return false;
    }
    if new_bytes == bytes {
        // The same class: the block holds the new size already.
        return true;
    }
    let mut cur = STATE.load(Ordering::Relaxed);
    loop {
        if off + bytes != next_of(cur) {
            return false;
        }
        let new = (cur & !OFF_MASK) | end as u64;
        match STATE.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(seen) => cur = seen,
        }
    }
}

/// Says once, on the standard error, that the reserve refused `size` bytes and how much of
/// it was in use: the line before the abort that usually follows (a report's own allocation
/// failing). Refusals of more than 64 KiB are not told (code that asks for that much at the
/// limit usually takes a refusal in its stride). Allocates nothing.
#[cold]
fn tell_spent(size: usize) {
    static TOLD: AtomicBool = AtomicBool::new(false);
    if size > MIN_CLASS << (CLASSES - 1) || TOLD.swap(true, Ordering::Relaxed) {
        return;
    }
    struct Line {
        buf: [u8; 256],
        len: usize,
    }
    impl std::fmt::Write for Line {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let u = reserve_use();
    let mut line = Line {
        buf: [0; 256],
        len: 0,
    };
    let _ = std::fmt::Write::write_fmt(
        &mut line,
        format_args!(
            "fibertrace: out of memory, and the emergency reserve refused {size} bytes \
             ({} of {RESERVE_BYTES} bytes carved, {} blocks live, {} served)\n",
            u.taken, u.live, u.served
        ),
    );
    // SAFETY: writes bytes of a buffer of ours to the standard error; nothing is allocated.
    unsafe { libc::write(2, line.buf.as_ptr().cast(), line.len) };
}

/// What the reserve has done: allocations it served since the process began, and the blocks
/// and bytes of it in use now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReserveUse {
    /// Allocations served from the reserve since the process began.
    pub served: u64,
    /// Blocks of the reserve live now.
    pub live: u64,
    /// Bytes of the reserve carved since it last emptied (a freed block counts until the
    /// reserve empties, or until it is the last one carved: listed for reuse, it counts).
    pub taken: usize,
}

/// The reserve's figures (all zero while the inner allocator has never failed).
pub fn reserve_use() -> ReserveUse {
    let s = STATE.load(Ordering::Relaxed);
    ReserveUse {
        served: SERVED.load(Ordering::Relaxed),
        live: live_of(s),
        taken: next_of(s),
    }
}

/// A [`GlobalAlloc`] that serves from the inner allocator, and from the process's emergency
/// reserve (see the module docs) when the inner one fails. Put it under the tracker:
///
/// ```no_run
/// use fibertrace_core::heap::{Reserve, Tracked};
/// #[global_allocator]
/// static HEAP: Tracked<Reserve<std::alloc::System>> =
///     Tracked::sampled(Reserve::new(std::alloc::System));
/// ```
pub struct Reserve<A> {
    inner: A,
}

impl<A> Reserve<A> {
    /// `inner`, with the emergency reserve behind it.
    pub const fn new(inner: A) -> Self {
        Reserve { inner }
    }
}

impl<A: GlobalAlloc> Reserve<A> {
    /// After the inner allocator refused `layout`: nothing under [`keep_reserve_out`];
    /// else the inner allocator again once the set-aside space is given back, else an arena
    /// block (zeroed when `zeroed`: an emptied arena's bytes may hold an earlier block's).
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc` (a non-zero-sized layout).
    #[cold]
    unsafe fn refused(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        if reserve_kept_out() {
            return std::ptr::null_mut();
        }
        if give_back(layout.size()) {
            // SAFETY: the caller's contract.
            let p = unsafe { self.inner_again(layout, zeroed) };
            if !p.is_null() {
                return p;
            }
        }
        let q = carve(layout);
        if q.is_null() {
            // The arena spent: a small block refused now aborts the process (the code that
            // asks for one does not expect a refusal). Last, the symbolizer's set-aside room
            // (tens of MB, the program's file size and more): frames left unnamed beat an
            // abort. (Not for a large block, whose refusal the caller usually takes in its
            // stride: that room stays for the report that needs it.)
            if layout.size() <= MIN_CLASS << (CLASSES - 1)
                && crate::symbolize::give_back_room_to_the_allocator()
            {
                // SAFETY: the caller's contract.
                let p = unsafe { self.inner_again(layout, zeroed) };
                if !p.is_null() {
                    return p;
                }
            }
            tell_spent(layout.size());
        }
        if zeroed && !q.is_null() {
            // SAFETY: `q` is a fresh arena block of `layout.size()` bytes.
            unsafe { std::ptr::write_bytes(q, 0, layout.size()) };
        }
        q
    }

    /// The inner allocator asked again, once room was given back.
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc` (a non-zero-sized layout).
    unsafe fn inner_again(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: the caller's contract.
        unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        }
    }
}

// SAFETY: a pointer handed out is either the inner allocator's (for `layout`) or an arena
// block of at least `layout.size()` bytes at `layout.align()` that no other live allocation
// overlaps (`carve`); each is freed or grown by the party that made it (`holds` tells them
// apart: arena blocks lie inside the arena, the inner allocator's outside it).
unsafe impl<A: GlobalAlloc> GlobalAlloc for Reserve<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract (a non-zero-sized layout).
        let p = unsafe { self.inner.alloc(layout) };
        if p.is_null() {
            // SAFETY: as above.
            return unsafe { self.refused(layout, false) };
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        if p.is_null() {
            // SAFETY: as above.
            return unsafe { self.refused(layout, true) };
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if holds(ptr) {
            release(ptr, layout.size(), layout.align());
        } else {
            // SAFETY: not an arena block, so the inner allocator's, made with `layout`.
            unsafe { self.inner.dealloc(ptr, layout) }
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !holds(ptr) {
            // SAFETY: the inner allocator's pointer, with its layout (the caller's contract).
            let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
            if !p.is_null() || reserve_kept_out() {
                return p;
            }
        } else if resize_last(ptr, layout.size(), layout.align(), new_size) {
            return ptr;
        }
        // An arena block, or the inner allocator could not grow its own: a new block
        // (inner first), the bytes copied, the old one freed by its maker.
        // SAFETY: the caller's contract: `new_size` rounded up to `align` does not overflow.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: `new` is non-zero-sized (the caller's contract for realloc).
        let q = unsafe { self.alloc(new) };
        if !q.is_null() {
            // SAFETY: both blocks hold at least the bytes copied, and they do not overlap
            // (`q` is a live block distinct from `ptr`).
            unsafe { std::ptr::copy_nonoverlapping(ptr, q, layout.size().min(new_size)) };
            // SAFETY: `ptr` was allocated with `layout` by this allocator.
            unsafe { self.dealloc(ptr, layout) };
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena is one per process: its tests take turns.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// An allocator that has no memory.
    struct Empty;
    // SAFETY: it hands out nothing, so frees nothing.
    unsafe impl GlobalAlloc for Empty {
        unsafe fn alloc(&self, _: Layout) -> *mut u8 {
            std::ptr::null_mut()
        }
        unsafe fn dealloc(&self, _: *mut u8, _: Layout) {
            unreachable!("nothing was handed out")
        }
    }

    #[test]
    fn an_empty_allocator_is_served_from_the_reserve_until_it_runs_out_then_it_empties_itself() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let r = Reserve::new(Empty);
        let small = Layout::from_size_align(24, 8).unwrap();
        let page = Layout::from_size_align(100, 4096).unwrap();
        let before = reserve_use();
        // SAFETY: non-zero layouts; every block is freed with its layout below.
        unsafe {
            let a = r.alloc(small);
            let b = r.alloc_zeroed(page);
            assert!(holds(a) && holds(b));
            assert_eq!(b as usize % 4096, 0, "the alignment asked for");
            assert!((b as usize) >= a as usize + 24, "blocks do not overlap");
            assert!(std::slice::from_raw_parts(b, 100).iter().all(|&x| x == 0));
            a.write_bytes(7, 24);
            // Grown: a new block holding the old bytes.
            let c = r.realloc(a, small, 5000);
            assert!(holds(c) && c != a);
            assert!(std::slice::from_raw_parts(c, 24).iter().all(|&x| x == 7));
            let u = reserve_use();
            assert_eq!(u.live, 2);
            assert_eq!(u.served, before.served + 3);
            // More than is left: refused (null), as the inner allocator refused.
            let huge = Layout::from_size_align(RESERVE_BYTES, 8).unwrap();
            assert!(r.alloc(huge).is_null());
            assert!(r.alloc(Layout::from_size_align(8, 8192).unwrap()).is_null());
            r.dealloc(b, page);
            assert_eq!(reserve_use().live, 1);
            assert!(reserve_use().taken > 5000, "kept until every block is free");
            r.dealloc(c, Layout::from_size_align(5000, 8).unwrap());
            assert_eq!(reserve_use().live, 0);
            assert_eq!(reserve_use().taken, 0, "emptied: the whole reserve again");
            let d = r.alloc(huge);
            assert_eq!(d as usize, base(), "the whole reserve, from its start");
            r.dealloc(d, huge);
        }
    }

    #[test]
    fn the_last_block_grows_and_shrinks_in_place_and_gives_its_bytes_back_at_once() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let r = Reserve::new(Empty);
        let l = Layout::from_size_align(100, 8).unwrap();
        let big = Layout::from_size_align(70_000, 8).unwrap();
        // SAFETY: non-zero layouts; every block is freed with its layout below.
        unsafe {
            let x = r.alloc(l);
            // (100 bytes: a block of the 128-byte class.)
            let at = reserve_use().taken;
            let y = r.alloc(big);
            assert_eq!(
                y as usize,
                x as usize + 128,
                "carved to size, after the class block"
            );
            assert_eq!(reserve_use().taken, at + 70_000);
            y.write_bytes(3, 70_000);
            let y2 = r.realloc(y, big, 100_000);
            assert_eq!(y2, y, "the last block grows where it is");
            assert_eq!(reserve_use().taken, at + 100_000);
            // Shrunk into a class whose alignment its place has (64 bytes at offset 128).
            let y3 = r.realloc(y2, Layout::from_size_align(100_000, 8).unwrap(), 50);
            assert_eq!(y3, y);
            assert_eq!(reserve_use().taken, at + 64);
            assert!(std::slice::from_raw_parts(y3, 50).iter().all(|&b| b == 3));
            // Within its class: where it is, whether last or not.
            let y4 = r.realloc(y3, Layout::from_size_align(50, 8).unwrap(), 60);
            assert_eq!(y4, y);
            assert_eq!(reserve_use().taken, at + 64);
            r.dealloc(y4, Layout::from_size_align(60, 8).unwrap());
            assert_eq!(reserve_use().taken, at, "its bytes back at once");
            assert_eq!(reserve_use().live, 1);
            // A refusal kept out of the reserve stays a refusal.
            let kept = keep_reserve_out();
            assert!(r.alloc(l).is_null());
            drop(kept);
            assert_eq!(reserve_use().live, 1);
            r.dealloc(x, l);
            assert_eq!(
                reserve_use(),
                ReserveUse {
                    served: reserve_use().served,
                    live: 0,
                    taken: 0
                }
            );
        }
    }

    /// A tiny generator of sizes, the same on every run.
    fn sizes(seed: &mut u64) -> usize {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        [24, 40, 64, 100, 200, 896, 1500, 4000, 9000][(*seed % 9) as usize]
    }

    #[test]
    fn blocks_freed_in_any_order_are_handed_out_again_while_another_lives_on() {
        // What a report at the memory limit does: tables that live on (made first), and
        // temporary allocations freed in the order they were made, not the reverse. Before
        // the free lists, every such free kept its bytes until the reserve emptied, which
        // the long-lived block prevented: the reserve ran out after a few thousand.
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let r = Reserve::new(Empty);
        let keep = Layout::from_size_align(3000, 8).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        let mut ring: std::collections::VecDeque<(*mut u8, Layout, u8)> = Default::default();
        let mut most = 0;
        // SAFETY: non-zero layouts; every block is freed with its layout; each block's bytes
        // are written and read only while it is live.
        unsafe {
            let kept = r.alloc(keep);
            assert!(!kept.is_null());
            kept.write_bytes(0xaa, 3000);
            for i in 0..200_000u32 {
                let l = Layout::from_size_align(sizes(&mut seed), 8).unwrap();
                let p = r.alloc(l);
                assert!(!p.is_null(), "the reserve ran out at allocation {i}");
                let mark = i as u8;
                p.write_bytes(mark, l.size());
                ring.push_back((p, l, mark));
                if ring.len() > 64 {
                    let (q, ql, qmark) = ring.pop_front().unwrap();
                    assert!(
                        std::slice::from_raw_parts(q, ql.size())
                            .iter()
                            .all(|&b| b == qmark),
                        "a block was handed out while live"
                    );
                    r.dealloc(q, ql);
                }
                most = most.max(reserve_use().taken);
            }
            assert!(
                most < 1 << 20,
                "{most} bytes carved for at most 65 blocks of 9 KiB"
            );
            for (q, ql, qmark) in ring.drain(..) {
                assert!(std::slice::from_raw_parts(q, ql.size())
                    .iter()
                    .all(|&b| b == qmark));
                r.dealloc(q, ql);
            }
            assert!(std::slice::from_raw_parts(kept, 3000)
                .iter()
                .all(|&b| b == 0xaa));
            assert_eq!(reserve_use().live, 1);
            r.dealloc(kept, keep);
            assert_eq!(reserve_use().live, 0);
            assert_eq!(reserve_use().taken, 0);
        }
    }

    #[test]
    fn racing_threads_that_free_out_of_order_never_share_a_block() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let r = Reserve::new(Empty);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let r = &r;
                s.spawn(move || {
                    let mut seed = 0x2545_f491_4f6c_dd1d ^ u64::from(t);
                    let mut held: Vec<(usize, Layout)> = Vec::new();
                    // SAFETY: non-zero layouts; every block is freed with its layout; each
                    // block's bytes are touched only while this thread holds it.
                    unsafe {
                        for i in 0..20_000 {
                            let l = Layout::from_size_align(sizes(&mut seed), 16).unwrap();
                            let p = r.alloc(l);
                            assert!(!p.is_null());
                            p.write_bytes(t, l.size());
                            held.push((p as usize, l));
                            if held.len() > 16 {
                                // Freed out of order: one from the middle.
                                let (q, ql) = held.swap_remove(i % held.len());
                                let q = q as *mut u8;
                                assert!(
                                    std::slice::from_raw_parts(q, ql.size())
                                        .iter()
                                        .all(|&b| b == t),
                                    "another thread wrote into this thread's block"
                                );
                                r.dealloc(q, ql);
                            }
                        }
                        for (q, ql) in held {
                            r.dealloc(q as *mut u8, ql);
                        }
                    }
                });
            }
        });
        assert_eq!(reserve_use().live, 0);
        assert_eq!(reserve_use().taken, 0);
    }

    #[test]
    fn blocks_carved_by_racing_threads_never_overlap() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let blocks: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let l = Layout::from_size_align(64, 16).unwrap();
                        (0..500).map(|_| carve(l) as usize).collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all: Vec<usize> = blocks.into_iter().flatten().collect();
        assert!(all.iter().all(|&p| p != 0));
        all.sort_unstable();
        assert!(
            all.windows(2).all(|w| w[1] - w[0] >= 64),
            "a block handed out twice"
        );
        for &p in &all {
            release(p as *mut u8, 64, 16);
        }
        assert_eq!(reserve_use().live, 0);
    }
}
