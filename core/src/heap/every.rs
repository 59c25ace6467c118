//! The every-allocation tier: lws's hidden header in front of each allocation.
//!
//! Layout of a block (`a = max(align, 8)`, `pre` a multiple of `a`):
//!
//! ```text
//! base                                                   user = base + pre
//! | pad (< a) | blob (len − 2 bytes) | len: u16 BE | prev | next | meta | user's bytes…
//! ```
//!
//! `blob` is the lws compressed trace and size; `len` counts the blob and itself, as lws's
//! trailer does; `prev`/`next` chain live blocks (pointers to their `Links`, null when the
//! block is not listed); `meta` is the owner slot the block is charged to. `pre =
//! round_up(len + 24, a)`, so free recovers the base from the pointer, the caller's layout
//! and `len`, as lws recovers it by aligning back. A block allocated while the tracker was
//! busy (its own work) has an empty blob (`len == 2`), is not listed and not charged.
//!
//! The list is guarded by one lock, taken only to link and unlink (the stack walk and the
//! encoding happen before it).

use super::owner;
use super::{Busy, Event};
use crate::codec::lws::{encode_into, MAX_BLOB, MAX_DEPTH};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// The list links and owner word right before the user's bytes.
#[repr(C)]
pub(crate) struct Links {
    prev: *mut Links,
    next: *mut Links,
    /// Owner slot + 1 when listed and charged; 0 when not.
    meta: u64,
}

const LINKS: usize = std::mem::size_of::<Links>();

/// Head of the live list (a pointer to the newest block's links).
pub(crate) struct List {
    pub(crate) head: *mut Links,
    pub(crate) count: usize,
}

// SAFETY: the pointers are only followed under the mutex, and point into live blocks (a
// block is unlinked under the mutex before it is freed).
unsafe impl Send for List {}

pub(crate) static LIST: Mutex<List> = Mutex::new(List {
    head: std::ptr::null_mut(),
    count: 0,
});

#[inline]
fn header_align(layout: Layout) -> usize {
    layout.align().max(8)
}

#[inline]
fn pre_for(len: usize, a: usize) -> usize {
    (len + LINKS).next_multiple_of(a)
}

/// The user pointer's header fields.
///
/// # Safety
/// `user` was handed out by this tier.
#[inline]
pub(crate) unsafe fn links(user: *mut u8) -> *mut Links {
    // SAFETY: the caller's contract: LINKS bytes of header precede `user`.
    unsafe { user.sub(LINKS).cast() }
}

/// The blob's length field (blob + 2).
///
/// # Safety
/// As [`links`].
#[inline]
pub(crate) unsafe fn blob_len(user: *mut u8) -> usize {
    // SAFETY: the caller's contract: the length's 2 bytes precede the links.
    let b = unsafe { user.sub(LINKS + 2).cast::<[u8; 2]>().read() };
    usize::from(u16::from_be_bytes(b))
}

/// The blob with its length trailer.
///
/// # Safety
/// As [`links`]; the slice lives as long as the block.
pub(crate) unsafe fn blob<'a>(user: *mut u8) -> &'a [u8] {
    // SAFETY: the caller's contract; `len` bytes end right before the links.
    unsafe {
        let len = blob_len(user);
        std::slice::from_raw_parts(user.sub(LINKS + len), len)
    }
}

/// Allocates a block; records its stack unless the tracker is busy on this thread.
///
/// # Safety
/// `layout` has a non-zero size.
#[inline]
pub(crate) unsafe fn alloc<A: GlobalAlloc>(inner: &A, layout: Layout, zeroed: bool) -> *mut u8 {
    let busy = Busy::enter();
    if busy.nested() || !super::RECORD.load(Ordering::Relaxed) {
        // SAFETY: the caller's contract.
        return unsafe { raw_block(inner, layout, zeroed, &[0, 2], 0) };
    }
    // SAFETY: the caller's contract.
    unsafe { record(inner, layout, zeroed) }
}

/// The recording path: stack, blob, block, list, owner, event.
///
/// # Safety
/// As [`alloc`]; the caller holds [`Busy`].
#[inline(never)]
unsafe fn record<A: GlobalAlloc>(inner: &A, layout: Layout, zeroed: bool) -> *mut u8 {
    let mut frames = [0u64; MAX_DEPTH];
    let n = super::capture(&mut frames);
    let mut blob = [0u8; MAX_BLOB];
    let len = match encode_into(&frames[..n], layout.size() as u64, &mut blob) {
        Ok(len) => len,
        // Not representable (an address ≥ 2^63): an empty trace with the size.
        Err(_) => encode_into(&[], layout.size() as u64, &mut blob).unwrap_or(0),
    };
    if len == 0 {
        // SAFETY: the caller's contract.
        return unsafe { raw_block(inner, layout, zeroed, &[0, 2], 0) };
    }
    let slot = owner::current_slot();
    // SAFETY: the caller's contract.
    let user = unsafe { raw_block(inner, layout, zeroed, &blob[..len], slot as u64 + 1) };
    if user.is_null() {
        return user;
    }
    owner::charge(slot, layout.size() as i64, 1);
    super::totals::add(
        &frames[..n],
        owner::fiber_of(slot).0.unwrap_or(0),
        layout.size() as i64,
        1,
    );
    // SAFETY: `user` was just made by raw_block with links in front.
    unsafe { link(links(user)) };
    super::report(&Event {
        alloc: true,
        ptr: user as usize,
        size: layout.size(),
        fiber: owner::fiber_of(slot).0,
        blob: &blob[..len],
    });
    user
}

/// Allocates a block with `blob` (its length trailer included) and `meta`, unlinked.
///
/// # Safety
/// `layout` has a non-zero size; `blob.len() >= 2` and ends with its length.
unsafe fn raw_block<A: GlobalAlloc>(
    inner: &A,
    layout: Layout,
    zeroed: bool,
    blob: &[u8],
    meta: u64,
) -> *mut u8 {
    let a = header_align(layout);
    let pre = pre_for(blob.len(), a);
    let Some(total) = pre.checked_add(layout.size()) else {
        return std::ptr::null_mut();
    };
    let Ok(full) = Layout::from_size_align(total, a) else {
        return std::ptr::null_mut();
    };
    // SAFETY: `full` has a non-zero size.
    let base = unsafe {
        if zeroed {
            inner.alloc_zeroed(full)
        } else {
            inner.alloc(full)
        }
    };
    if base.is_null() {
        return base;
    }
    // SAFETY: `pre ≥ blob.len() + LINKS`, all inside the block; `user` is aligned to `a`
    // (base is, and pre is a multiple of it), so the links (8-aligned) are too.
    unsafe {
        let user = base.add(pre);
        std::ptr::copy_nonoverlapping(blob.as_ptr(), user.sub(LINKS + blob.len()), blob.len());
        links(user).write(Links {
            prev: std::ptr::null_mut(),
            next: std::ptr::null_mut(),
            meta,
        });
        user
    }
}

/// Links a block at the head of the live list.
///
/// # Safety
/// `l` is the links of a live block of this tier, not listed.
unsafe fn link(l: *mut Links) {
    let mut list = LIST.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: under the list lock; `l` and the head are live blocks' links.
    unsafe {
        (*l).prev = std::ptr::null_mut();
        (*l).next = list.head;
        if !list.head.is_null() {
            (*list.head).prev = l;
        }
    }
    list.head = l;
    list.count += 1;
}

/// Unlinks a listed block.
///
/// # Safety
/// `l` is the links of a listed block.
unsafe fn unlink(l: *mut Links) {
    let mut list = LIST.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: under the list lock; neighbours are listed blocks.
    unsafe {
        let (p, n) = ((*l).prev, (*l).next);
        if p.is_null() {
            list.head = n;
        } else {
            (*p).next = n;
        }
        if !n.is_null() {
            (*n).prev = p;
        }
        (*l).prev = std::ptr::null_mut();
        (*l).next = std::ptr::null_mut();
    }
    list.count -= 1;
}

/// Frees a block.
///
/// # Safety
/// `user` was handed out by this tier with `layout`.
#[inline]
pub(crate) unsafe fn dealloc<A: GlobalAlloc>(inner: &A, user: *mut u8, layout: Layout) {
    // SAFETY: the caller's contract.
    unsafe {
        let l = links(user);
        let meta = (*l).meta;
        if meta != 0 {
            // Reported however the free is made (paused or not): its allocation was.
            let _busy = Busy::enter();
            let slot = (meta - 1) as u32;
            super::report(&Event {
                alloc: false,
                ptr: user as usize,
                size: layout.size(),
                fiber: owner::fiber_of(slot).0,
                blob: blob(user),
            });
            unlink(l);
            owner::credit((meta - 1) as u32, layout.size() as i64, 1);
        }
        let a = header_align(layout);
        let pre = pre_for(blob_len(user), a);
        inner.dealloc(
            user.sub(pre),
            Layout::from_size_align_unchecked(pre + layout.size(), a),
        );
    }
}

/// Reallocates: a new block (recorded at this call), the bytes copied, the old one freed.
///
/// # Safety
/// As `GlobalAlloc::realloc`.
pub(crate) unsafe fn realloc<A: GlobalAlloc>(
    inner: &A,
    user: *mut u8,
    layout: Layout,
    new_size: usize,
) -> *mut u8 {
    // SAFETY: the caller's contract: `new_size`, rounded up to the alignment, does not
    // overflow, and is non-zero.
    let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
    // SAFETY: a non-zero-sized layout.
    let fresh = unsafe { alloc(inner, new_layout, false) };
    if !fresh.is_null() {
        // SAFETY: both blocks hold at least min(old, new) bytes and are distinct.
        unsafe {
            std::ptr::copy_nonoverlapping(user, fresh, layout.size().min(new_size));
            dealloc(inner, user, layout);
        }
    }
    fresh
}

/// Visits the listed blocks (newest first) under the list lock: `f(user pointer, blob,
/// owner slot)`. `f` must not allocate through the tracker's list (it runs under [`Busy`]).
pub(crate) fn for_each(mut f: impl FnMut(usize, &[u8], u32)) {
    let _busy = Busy::enter();
    let list = LIST.lock().unwrap_or_else(|e| e.into_inner());
    let mut l = list.head;
    while !l.is_null() {
        // SAFETY: under the lock every listed block is live; its blob precedes its links.
        unsafe {
            let user = l.cast::<u8>().add(LINKS);
            f(user as usize, blob(user), ((*l).meta - 1) as u32);
            l = (*l).next;
        }
    }
}

/// How many blocks are listed.
pub(crate) fn count() -> usize {
    LIST.lock().map(|l| l.count).unwrap_or(0)
}
