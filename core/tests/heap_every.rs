//! The every-allocation tier as a process's global allocator: exact stacks, sizes and owners
//! of live allocations, lws `~m#` lines, realloc and alignment, events, thread teardown.

use fibertrace_core::codec::lws::LwsTrace;
use fibertrace_core::heap::{self, Owner, Tracked};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[global_allocator]
static HEAP: Tracked<System> = Tracked::every(System);

/// Tests share the live list and the owner table; a few assert on totals.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[inline(never)]
fn leaf(n: usize) -> Vec<u8> {
    let v = Vec::with_capacity(n);
    std::hint::black_box(v)
}

#[inline(never)]
fn middle(n: usize) -> Vec<u8> {
    std::hint::black_box(leaf(n))
}

#[inline(never)]
fn outer(n: usize) -> Vec<u8> {
    std::hint::black_box(middle(n))
}

/// The function names of a group's first frames (outermost function level of each frame).
fn names(frames: &[fibertrace_core::Frame], n: usize) -> Vec<String> {
    frames
        .iter()
        .take(n)
        .map(|f| {
            fibertrace_core::resolve(f)
                .and_then(|r| r.function().map(str::to_string))
                .unwrap_or_else(|| "??".into())
        })
        .collect()
}

fn find(ptr: usize) -> Option<heap::LiveAlloc> {
    heap::live().into_iter().find(|a| a.ptr == ptr)
}

#[test]
fn an_allocation_three_calls_deep_is_listed_with_those_frames_its_size_and_owner() {
    let _l = lock();
    assert_eq!(heap::tier(), heap::Tier::Every);
    let owner = Owner::new(41);
    let prev = heap::switch_to(Some(&owner));
    let v = outer(12345);
    heap::restore(prev);
    let ptr = v.as_ptr() as usize;
    let a = find(ptr).expect("the allocation is listed");
    assert_eq!(a.size, 12345);
    assert_eq!(a.fiber, Some(41));
    assert!(!a.exited);
    let groups = heap::group(std::slice::from_ref(&a));
    assert_eq!(groups.len(), 1);
    assert_eq!(
        names(&groups[0].frames, 3),
        [
            "heap_every::leaf",
            "heap_every::middle",
            "heap_every::outer"
        ]
    );
    // The file:line of the innermost frame is the allocation's line in `leaf`.
    let r = fibertrace_core::resolve(&groups[0].frames[0]).unwrap();
    let s = r.symbols.last().unwrap();
    assert!(s
        .file
        .as_deref()
        .unwrap()
        .ends_with("core/tests/heap_every.rs"));
    assert_eq!(s.line, Some(22));
    assert_eq!(owner.usage().live_bytes, 12345);
    assert_eq!(owner.usage().live_objects, 1);

    // Freed from another thread (another owner current there): credited to fiber 41.
    let other = Owner::new(42);
    std::thread::spawn(move || {
        let prev = heap::switch_to(Some(&other));
        drop(v);
        heap::restore(prev);
        assert_eq!(other.usage().live_bytes, 0);
    })
    .join()
    .unwrap();
    assert_eq!(owner.usage().live_bytes, 0);
    assert_eq!(owner.usage().live_objects, 0);
    assert_eq!(owner.usage().alloc_bytes, 12345);
    assert!(find(ptr).is_none());
}

#[test]
fn an_exited_owner_keeps_its_live_bytes_visible_until_they_are_freed() {
    let _l = lock();
    let v;
    {
        let owner = Owner::new(77);
        let prev = heap::switch_to(Some(&owner));
        v = outer(4000);
        heap::restore(prev);
        owner.close();
    }
    let row = heap::owners()
        .into_iter()
        .find(|r| r.fiber == Some(77))
        .expect("the exited owner is listed");
    assert!(row.exited);
    assert_eq!(row.usage.live_bytes, 4000);
    let a = find(v.as_ptr() as usize).unwrap();
    assert_eq!((a.fiber, a.exited), (Some(77), true));
    drop(v);
    assert!(heap::owners().iter().all(|r| r.fiber != Some(77)));
}

#[test]
fn m_lines_carry_the_stored_blob_and_round_trip_through_the_lws_decoder() {
    let _l = lock();
    let v = outer(777);
    let a = find(v.as_ptr() as usize).unwrap();
    // The blob stored in front of the allocation is lws's canonical encoding of its trace.
    let t = LwsTrace::decode(&a.blob).unwrap();
    assert_eq!(t.size, 777);
    assert_eq!(t.addrs, a.addrs);
    assert_eq!(t.encode().unwrap(), a.blob);
    let mut out = Vec::new();
    let n = heap::write_m_lines(&mut out).unwrap();
    assert!(n >= 1);
    let text = String::from_utf8(out).unwrap();
    // One line per allocation counted, each a whole `~m#` line.
    assert_eq!(text.lines().count(), n);
    assert!(text.ends_with('\n') && text.lines().all(|l| l.starts_with("~m#")));
    let line = text
        .lines()
        .find(|l| LwsTrace::from_m_line(l).is_ok_and(|t| t.size == 777 && t.addrs == a.addrs))
        .expect("a ~m# line for the allocation");
    assert!(line.starts_with("~m#"));
    // The decoded line lws's tool prints.
    let b = LwsTrace::from_m_line(line).unwrap().to_b_line();
    assert!(b.starts_with("~b#size: 777, 0x"), "{b}");
    drop(v);
}

#[test]
fn realloc_and_alignment_keep_the_bytes_and_the_record_follows_the_block() {
    let _l = lock();
    for align in [1usize, 8, 16, 64, 4096] {
        let layout = Layout::from_size_align(100, align).unwrap();
        // SAFETY: a non-zero-sized layout; the block is written within its size, then
        // reallocated and freed with the layouts it has.
        unsafe {
            let p = HEAP.alloc(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % align, 0);
            for i in 0..100 {
                *p.add(i) = i as u8;
            }
            assert_eq!(find(p as usize).unwrap().size, 100);
            let q = HEAP.realloc(p, layout, 5000);
            assert_eq!(q as usize % align, 0);
            for i in 0..100 {
                assert_eq!(*q.add(i), i as u8);
            }
            assert!(find(p as usize).is_none_or(|_| p == q));
            assert_eq!(find(q as usize).unwrap().size, 5000);
            let z = HEAP.alloc_zeroed(Layout::from_size_align(300, align).unwrap());
            assert!((0..300).all(|i| *z.add(i) == 0));
            HEAP.dealloc(z, Layout::from_size_align(300, align).unwrap());
            HEAP.dealloc(q, Layout::from_size_align(5000, align).unwrap());
            assert!(find(q as usize).is_none());
        }
    }
}

static EVENTS_SEEN: AtomicUsize = AtomicUsize::new(0);

fn on_event(e: &heap::Event<'_>) {
    if e.size == 31337 {
        let t = LwsTrace::decode(e.blob).expect("the event's blob decodes");
        assert_eq!(t.size, 31337);
        EVENTS_SEEN.fetch_add(if e.alloc { 1 } else { 100 }, Ordering::SeqCst);
    }
}

#[test]
fn the_event_callback_sees_each_allocation_and_its_free() {
    let _l = lock();
    heap::set_events(Some(on_event));
    let v = outer(31337);
    drop(v);
    heap::set_events(None);
    assert_eq!(EVENTS_SEEN.load(Ordering::SeqCst), 101);
}

#[test]
fn a_thread_that_allocates_in_its_thread_local_destructors_does_not_crash() {
    struct AllocOnDrop(Vec<String>);
    impl Drop for AllocOnDrop {
        fn drop(&mut self) {
            // Allocates (and frees) while the thread's locals are being destroyed.
            let mut v: Vec<String> = (0..100).map(|i| format!("late {i}")).collect();
            v.append(&mut self.0);
            let b = Box::new([7u8; 4096]);
            std::hint::black_box((&v, &b));
        }
    }
    thread_local! {
        static FIRST: std::cell::RefCell<Option<AllocOnDrop>> = const { std::cell::RefCell::new(None) };
        static SECOND: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let hs: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(|| {
                SECOND.with(|s| s.borrow_mut().extend_from_slice(&[1; 1000]));
                FIRST.with(|f| *f.borrow_mut() = Some(AllocOnDrop(vec!["x".repeat(50)])));
                outer(10)
            })
        })
        .collect();
    for h in hs {
        drop(h.join().expect("the thread ends normally"));
    }
}

#[test]
fn many_threads_allocating_and_freeing_at_once_leave_a_consistent_list() {
    let _l = lock();
    let owner_bytes: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let o = Owner::new(1000 + t);
                let prev = heap::switch_to(Some(&o));
                let mut keep = Vec::new();
                for i in 0..2000usize {
                    let s = format!("{t}-{i}-{}", "y".repeat(i % 50));
                    if i % 4 == 0 {
                        keep.push(s);
                    }
                }
                heap::restore(prev);
                let u = o.usage();
                // The strings kept and the vector that keeps them.
                let expect: usize = keep.iter().map(|s| s.capacity()).sum::<usize>()
                    + keep.capacity() * std::mem::size_of::<String>();
                (
                    u.live_bytes,
                    expect as i64,
                    u.live_objects,
                    keep.len() as i64 + 1,
                )
            })
        })
        .map(|h| h.join().unwrap())
        .collect();
    for (live, expect, objs, n) in owner_bytes {
        // The owner's live figures are exactly the strings still kept (the owner itself is
        // dropped, and its bytes held, after the figures are read).
        assert_eq!((live, objs), (expect, n));
    }
    // Every listed block decodes.
    for a in heap::live() {
        assert_eq!(LwsTrace::decode(&a.blob).unwrap().size as usize, a.size);
    }
}

thread_local! {
    static HOOKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A layer's hook: puts a Lua frame (id 7) above the native frames, on threads that ask.
fn add_lua_frame(addrs: &mut [u64; 31], n: usize) -> usize {
    if !HOOKED.with(|h| h.get()) || n == 31 {
        return n;
    }
    addrs.copy_within(0..n, 1);
    addrs[0] = heap::LUA_TAG | 7;
    n + 1
}

#[test]
fn a_stack_hook_adds_a_layers_frames_which_the_views_read_back() {
    let _l = lock();
    heap::set_stack_hook(Some(add_lua_frame));
    HOOKED.with(|h| h.set(true));
    let v = outer(4321);
    HOOKED.with(|h| h.set(false));
    heap::set_stack_hook(None);
    let a = find(v.as_ptr() as usize).unwrap();
    let frames = heap::frames_of(&a.addrs);
    assert_eq!(
        frames[0],
        fibertrace_core::Frame::Lua(fibertrace_core::LuaFrameId(7))
    );
    assert_eq!(frames[1], fibertrace_core::Frame::Ra(a.addrs[1]));
    // The tagged entry survives the lws blob (it is below 2^63).
    assert_eq!(
        LwsTrace::decode(&a.blob).unwrap().addrs[0],
        heap::LUA_TAG | 7
    );
    drop(v);
}

/// The live list is walked while other threads allocate and free (the walk's own buffer
/// grows under the list's lock: it must be untracked, or its free would take the lock
/// again), and `~m#` lines are written meanwhile.
#[test]
fn listing_the_heap_while_threads_allocate_neither_hangs_nor_loses_blocks() {
    let _l = lock();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut keep = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    keep.push(format!("{}", keep.len()));
                    if keep.len() > 5000 {
                        keep.clear();
                    }
                }
            })
        })
        .collect();
    let mine = outer(2222);
    for _ in 0..30 {
        assert!(heap::live().iter().any(|a| a.size == 2222));
        let mut out = Vec::new();
        assert!(heap::write_m_lines(&mut out).unwrap() > 0);
    }
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    drop(mine);
}

/// Closing owners while another, which has no slot yet, is current: the free list's growth
/// inside the close must not open a slot (which takes the same list's lock).
#[test]
fn closing_many_owners_while_a_fresh_one_is_current_does_not_hang() {
    let _l = lock();
    for i in 0..3000u64 {
        let b = Owner::new(50_000 + i);
        let prev = heap::switch_to(Some(&b));
        drop(std::hint::black_box(vec![1u8; 10]));
        heap::restore(prev);
        let a = Owner::new(90_000 + i);
        let prev = heap::switch_to(Some(&a));
        b.close();
        heap::restore(prev);
    }
}
