//! The sampled tier as a process's global allocator: unbiased estimates, stacks of sampled
//! allocations, credit on free, thread teardown.

use fibertrace_core::heap::{self, Owner, Tracked};
use std::alloc::System;
use std::sync::Mutex;

#[global_allocator]
static HEAP: Tracked<System> = Tracked::sampled(System);

static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn interval(bytes: u64) {
    heap::configure(heap::Config {
        sample_interval: bytes,
        ..heap::config()
    });
}

#[inline(never)]
fn leaf(n: usize) -> Vec<u8> {
    std::hint::black_box(Vec::with_capacity(n))
}

#[inline(never)]
fn middle(n: usize) -> Vec<u8> {
    std::hint::black_box(leaf(n))
}

#[inline(never)]
fn outer(n: usize) -> Vec<u8> {
    std::hint::black_box(middle(n))
}

#[test]
fn the_estimate_of_a_known_workloads_live_bytes_is_within_ten_percent() {
    let _l = lock();
    assert_eq!(heap::tier(), heap::Tier::Sampled);
    interval(64 * 1024);
    let owner = Owner::new(5);
    let prev = heap::switch_to(Some(&owner));
    // 100,000 blocks of 1 KiB, 1,000 of 64 KiB, 10 of 1 MiB: ~180 MiB in three size classes.
    let mut keep: Vec<Vec<u8>> = Vec::with_capacity(101_010);
    for _ in 0..100_000 {
        keep.push(Vec::with_capacity(1024));
    }
    for _ in 0..1000 {
        keep.push(Vec::with_capacity(64 * 1024));
    }
    for _ in 0..10 {
        keep.push(Vec::with_capacity(1 << 20));
    }
    heap::restore(prev);
    let truth = 100_000 * 1024 + 1000 * 64 * 1024 + 10 * (1 << 20) + 101_010 * 24;
    let est = owner.usage().live_bytes;
    let err = (est - truth).abs() as f64 / truth as f64;
    assert!(
        err < 0.10,
        "estimate {est} vs {truth}: {:.1}% off",
        err * 100.0
    );
    // The samples' own sum agrees with the owner's figure.
    let sum: i64 = heap::live()
        .iter()
        .filter(|a| a.fiber == Some(5))
        .map(|a| a.bytes)
        .sum();
    assert_eq!(sum, est);
    // Half freed (every other block): the estimate follows.
    let mut i = 0;
    keep.retain(|_| {
        i += 1;
        i % 2 == 0
    });
    let half = truth - (50_000 * 1024 + 500 * 64 * 1024 + 5 * (1 << 20));
    let est = owner.usage().live_bytes;
    let err = (est - half).abs() as f64 / half as f64;
    assert!(
        err < 0.10,
        "estimate {est} vs {half}: {:.1}% off",
        err * 100.0
    );
    drop(keep);
    // Every sample credited back exactly.
    assert_eq!(owner.usage().live_bytes, 0);
    assert_eq!(owner.usage().live_objects, 0);
}

#[test]
fn a_large_allocation_is_sampled_with_its_stack_and_fiber() {
    let _l = lock();
    interval(64 * 1024);
    let owner = Owner::new(9);
    let prev = heap::switch_to(Some(&owner));
    // 16 MiB at a 64 KiB mean: sampled with probability 1 − e^−256.
    let v = outer(16 << 20);
    heap::restore(prev);
    let a = heap::live()
        .into_iter()
        .find(|a| a.ptr == v.as_ptr() as usize)
        .expect("sampled");
    assert_eq!((a.size, a.fiber, a.objects), (16 << 20, Some(9), 1));
    assert_eq!(a.bytes, 16 << 20);
    // Its `~m#` line: the sample's stack and size, as lws's decoder reads them; one whole
    // line per sample.
    let (text, n) = heap::m_lines().unwrap();
    let text = String::from_utf8(text).unwrap();
    assert_eq!(text.lines().count(), n);
    assert!(
        text.lines()
            .map(|l| fibertrace_core::codec::lws::LwsTrace::from_m_line(l).unwrap())
            .any(|t| t.size == 16 << 20 && t.addrs == a.addrs),
        "no line for the sample in\n{text}"
    );
    let g = heap::group(&[a]);
    let names: Vec<String> = g[0].frames[..3]
        .iter()
        .map(|f| {
            fibertrace_core::resolve(f)
                .unwrap()
                .function()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        names,
        [
            "heap_sampled::leaf",
            "heap_sampled::middle",
            "heap_sampled::outer"
        ]
    );
    drop(v);
    assert_eq!(owner.usage().live_bytes, 0);
}

#[test]
fn threads_allocating_in_their_destructors_and_at_once_do_not_crash() {
    struct AllocOnDrop;
    impl Drop for AllocOnDrop {
        fn drop(&mut self) {
            let v: Vec<Vec<u8>> = (0..200).map(|_| vec![1u8; 8192]).collect();
            std::hint::black_box(v);
        }
    }
    thread_local! {
        static T: std::cell::RefCell<Option<AllocOnDrop>> = const { std::cell::RefCell::new(None) };
    }
    let hs: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(|| {
                T.with(|t| *t.borrow_mut() = Some(AllocOnDrop));
                let v: Vec<String> = (0..5000).map(|i| "z".repeat(i % 300)).collect();
                v.len()
            })
        })
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap(), 5000);
    }
}

/// A tiny interval samples most allocations: the sample table grows many times while most
/// filter counters are set, and freeing its old buckets must not look the table up again
/// (its lock is held). Every sample is credited back at the end.
#[test]
fn a_dense_sample_table_grows_and_empties_without_hanging() {
    let _l = lock();
    interval(64);
    let owner = Owner::new(77);
    let prev = heap::switch_to(Some(&owner));
    let keep: Vec<Vec<u8>> = (0..100_000).map(|i| vec![0u8; 16 + i % 100]).collect();
    heap::restore(prev);
    assert!(heap::live().len() > 10_000);
    drop(keep);
    interval(64 * 1024);
    assert_eq!(owner.usage().live_bytes, 0);
    assert_eq!(owner.usage().live_objects, 0);
}
