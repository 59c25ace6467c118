//! At the address-space limit, with the emergency reserve spent, a small allocation takes the
//! symbolizer's set-aside room rather than abort the process: a report that allocates more
//! than the reserve holds (a listing of hundreds of thousands of allocations, say) finishes.
//!
//! The work runs in a child process (this test binary, started again), which sets its own
//! `RLIMIT_AS`: a limit is the process's, and the other tests must not share it.

use std::process::Command;

use fibertrace_core::heap::{self, Reserve, RESERVE_BYTES};

#[global_allocator]
static HEAP: Reserve<std::alloc::System> = Reserve::new(std::alloc::System);

const CHILD: &str = "FT_TEST_LAST_RESORT_CHILD";

/// The address space this process maps now, in bytes.
fn mapped() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm.split(' ').next().unwrap().parse().unwrap();
    pages * 4096
}

/// In the child: sets a limit, fills the address space (its refusals kept refusals), then
/// allocates twice the reserve in small blocks. Prints what it saw.
fn child() {
    let room = 256u64 << 20;
    let limit = mapped() + room;
    let r = libc::rlimit {
        rlim_cur: limit,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads a struct of ours; the limit is this process's only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &r) }, 0);
    // The room a report at the limit would open the program's file and parse it in.
    assert!(fibertrace_core::symbolize::set_aside_room(16 << 20));
    // Everything else, in blocks from 1 MiB down to 64 bytes: the refusals stay refusals
    // (as a Lua heap's do), so the reserve is untouched.
    let mut fill: Vec<Vec<u8>> = Vec::with_capacity(1 << 20);
    {
        let _out = heap::keep_reserve_out();
        let mut size = 1usize << 20;
        while size >= 64 {
            let mut v = Vec::new();
            if fill.len() < fill.capacity() && v.try_reserve_exact(size).is_ok() {
                v.push(1u8);
                fill.push(v);
            } else {
                size /= 2;
            }
        }
    }
    assert_eq!(
        heap::reserve_use().served,
        0,
        "the fill took from the reserve"
    );
    // Twice the reserve in 1 KiB blocks: the reserve, then the symbolizer's room.
    let blocks = 2 * RESERVE_BYTES / 1024;
    let mut held: Vec<Box<[u8; 1024]>> = Vec::new();
    held.try_reserve_exact(blocks)
        .expect("room for the list of blocks");
    for i in 0..blocks {
        held.push(Box::new([i as u8; 1024]));
    }
    let u = heap::reserve_use();
    println!(
        "filled {} blocks; held {}; reserve served {} carved {}",
        fill.len(),
        held.len(),
        u.served,
        u.taken
    );
    assert!(held.iter().enumerate().all(|(i, b)| b[1023] == i as u8));
}

#[test]
fn a_small_allocation_past_the_spent_reserve_takes_the_symbolizers_room_not_an_abort() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let o = Command::new(exe)
        .args([
            "--exact",
            "a_small_allocation_past_the_spent_reserve_takes_the_symbolizers_room_not_an_abort",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let line = out
        .lines()
        .find_map(|l| l.find("filled ").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{out}{err}"));
    let n = |key: &str| -> usize {
        line.split(key)
            .nth(1)
            .and_then(|r| r.split([' ', ';']).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{key} in {line}"))
    };
    assert_eq!(n("held "), 2 * RESERVE_BYTES / 1024, "{line}");
    // The reserve served until it was spent (within a block's padding of its size), and
    // the rest came from the room given back.
    assert!(n("served ") > 0, "{line}");
    assert!(n("carved ") > RESERVE_BYTES - (64 << 10), "{line}");
    assert!(n("served ") < 2 * RESERVE_BYTES / 1024, "{line}");
}
