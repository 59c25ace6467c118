//! Probe reads (`embed::overflow::ProbeReads`): this process's memory read in place, a read
//! of an address that is not there failing instead of faulting. One test function: a step
//! below replaces the process's SIGSEGV handler, which no other probe may overlap (while
//! that handler is in, a real fault would spin in it: the test would hang, not pass).

use fibertrace_fiber::embed::overflow::ProbeReads;

const PAGE: usize = 4096;

/// Maps `pages` pages, readable and writable, filled with their offsets' low bytes.
fn map(pages: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping of our own; checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let p = p.cast::<u8>();
    for i in 0..pages * PAGE {
        // SAFETY: within the mapping just made.
        unsafe { p.add(i).write(i as u8) };
    }
    p
}

fn read(probe: &ProbeReads, addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut out = vec![0xEE; len];
    probe.read(addr, &mut out).then_some(out)
}

extern "C" fn other_handler(_: libc::c_int) {}

static OPENED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An overflow handler that records which fiber's reserve was opened.
unsafe fn on_overflow(_ctx: usize, fid: u64) {
    OPENED.store(fid, std::sync::atomic::Ordering::SeqCst);
}

fn sound() -> bool {
    ProbeReads::with(|p| p.is_some())
}

/// Gives this thread an alternate signal stack with room for a probe's fault (the standard
/// library's is the kernel's least, `AT_MINSIGSTKSZ`: 11,952 bytes on a CPU with AMX, no
/// room left for a handler), as a program that uses probe reads on its own threads does.
/// The mapping is left to the process's end (a test's threads are few).
fn roomy_altstack() {
    const SIZE: usize = 256 * 1024;
    let mem = map(SIZE / PAGE);
    let st = libc::stack_t {
        ss_sp: mem.cast(),
        ss_flags: 0,
        ss_size: SIZE,
    };
    // SAFETY: a mapping of ours, never unmapped, as this thread's alternate stack.
    assert_eq!(unsafe { libc::sigaltstack(&st, std::ptr::null_mut()) }, 0);
}

#[test]
fn probe_reads_copy_what_is_mapped_and_fail_where_nothing_is() {
    roomy_altstack();
    let p = map(3);
    let base = p as u64;
    let bytes = |from: usize, len: usize| (from..from + len).map(|i| i as u8).collect::<Vec<_>>();
    ProbeReads::with(|probe| {
        let probe = probe.expect("the runtime's handler is in place");
        // Mapped memory, every length the copy handles (a word, the byte copy around it).
        for (from, len) in [(0, 0), (5, 1), (8, 8), (13, 8), (1, 7), (3, 9), (100, 256)] {
            assert_eq!(
                read(probe, base + from as u64, len),
                Some(bytes(from, len)),
                "{len} bytes at +{from}"
            );
        }
        // Across a page boundary, both pages mapped; the whole mapping.
        assert_eq!(
            read(probe, base + PAGE as u64 - 4, 8),
            Some(bytes(PAGE - 4, 8))
        );
        assert_eq!(read(probe, base, 3 * PAGE), Some(bytes(0, 3 * PAGE)));
    });

    // The last page unmapped, the middle one made unreadable.
    // SAFETY: our own mapping's pages.
    unsafe {
        assert_eq!(libc::munmap(p.add(2 * PAGE).cast(), PAGE), 0);
        assert_eq!(libc::mprotect(p.add(PAGE).cast(), PAGE, libc::PROT_NONE), 0);
    }
    let gone = base + 2 * PAGE as u64;
    let locked = base + PAGE as u64;
    ProbeReads::with(|probe| {
        let probe = probe.expect("in place");
        for len in [1, 8, 9, 64] {
            assert_eq!(
                read(probe, gone, len),
                None,
                "{len} bytes of an unmapped page"
            );
            assert_eq!(
                read(probe, locked, len),
                None,
                "{len} bytes of a PROT_NONE page"
            );
        }
        // A read that starts readable and runs into the unreadable page fails as a whole.
        assert_eq!(read(probe, locked - 4, 8), None);
        assert_eq!(read(probe, locked - 100, 200), None);
        // The first page still reads.
        assert_eq!(read(probe, base + 16, 8), Some(bytes(16, 8)));
        // Addresses never mapped: null, low, non-canonical (a general protection fault, not
        // a page fault), the top of the address space; a range that would wrap around is
        // refused before any read.
        for addr in [0, 8, 0x1000, 0x8000_0000_0000_0000, u64::MAX - 8] {
            assert_eq!(read(probe, addr, 8), None, "{addr:#x}");
            assert_eq!(read(probe, addr, 3), None, "{addr:#x}");
        }
        assert_eq!(read(probe, u64::MAX - 3, 3), None);
        assert_eq!(read(probe, u64::MAX - 3, 8), None);
    });

    // A file mapped past its end (truncated after the mapping): SIGBUS, not SIGSEGV.
    let path = std::env::temp_dir().join(format!("fibertrace-probe-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.set_len(2 * PAGE as u64).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a shared read-only mapping of our own file, unmapped below.
    let fm = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * PAGE,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(fm, libc::MAP_FAILED);
    file.set_len(PAGE as u64).unwrap();
    ProbeReads::with(|probe| {
        let probe = probe.expect("in place");
        assert_eq!(read(probe, fm as u64, 8), Some(vec![0; 8]));
        assert_eq!(
            read(probe, fm as u64 + PAGE as u64, 8),
            None,
            "past the file's end"
        );
        assert_eq!(read(probe, fm as u64 + PAGE as u64 + 1, 5), None);
    });
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(fm, 2 * PAGE) };
    drop(file);
    std::fs::remove_file(&path).unwrap();

    // Many threads failing at once, each with its own probes, and reading what is there.
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                roomy_altstack();
                ProbeReads::with(|probe| {
                    let probe = probe.expect("in place on every thread");
                    for i in 0..20_000u64 {
                        let mut w = [0u8; 8];
                        assert!(!probe.read(locked + (i % 512) * 8, &mut w));
                        assert!(!probe.read(8 * (t + 1), &mut w));
                        assert!(probe.read(base + (i % 512) * 8, &mut w));
                        assert_eq!(w[0], ((i % 512) * 8) as u8);
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    // A thread that blocks SIGSEGV or SIGBUS gets no probes (a fault would end the process),
    // nor one without an alternate signal stack (the fault's frame may not fit where it runs).
    for sig in [libc::SIGSEGV, libc::SIGBUS] {
        std::thread::spawn(move || {
            roomy_altstack();
            assert!(sound());
            // SAFETY: this thread's own mask, a set of ours.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, sig);
                assert_eq!(
                    libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()),
                    0
                );
            }
            assert!(!sound(), "signal {sig} blocked");
        })
        .join()
        .unwrap();
    }
    std::thread::spawn(|| {
        // The standard library's alternate stack: enough where the kernel's least leaves
        // room for the handler, not enough on a CPU whose signal frames are large.
        // SAFETY: reads this thread's alternate stack and the auxiliary vector.
        let (std_size, least) = unsafe {
            let mut ss: libc::stack_t = std::mem::zeroed();
            assert_eq!(libc::sigaltstack(std::ptr::null(), &mut ss), 0);
            (ss.ss_size, (libc::getauxval(51) as usize).max(2048))
        };
        assert_eq!(sound(), std_size >= least + 4096, "{std_size} vs {least}");
        roomy_altstack();
        assert!(sound());
        // SAFETY: disables this thread's alternate stack (ours, left mapped).
        unsafe {
            let mut ss: libc::stack_t = std::mem::zeroed();
            ss.ss_flags = libc::SS_DISABLE;
            assert_eq!(libc::sigaltstack(&ss, std::ptr::null_mut()), 0);
        }
        assert!(!sound(), "no alternate stack");
    })
    .join()
    .unwrap();

    // In a fiber whose thread has an overflow handler: a read of the fiber's own reserve or
    // guard (below its stack) fails, and is not taken for an overflow.
    // SAFETY: the handler only stores to an atomic; it stays valid (a plain function).
    unsafe { fibertrace_fiber::embed::overflow::set_thread_handler(Some((on_overflow, 0))) };
    let s = fibertrace_fiber::Scheduler::with_options(fibertrace_fiber::SchedulerOptions {
        stack_size: 256 * 1024,
        ..Default::default()
    });
    s.spawn(|| {
        let local = std::hint::black_box([0u8; 16]);
        let here = &raw const local as u64;
        ProbeReads::with(|probe| {
            let probe = probe.expect("in place in a fiber");
            // 8 KiB under the usable part's bottom (its top is less than that above `here`):
            // the reserve; 8 KiB under the reserve: the guard.
            for below in [256 + 8, 256 + 256 + 8] {
                assert_eq!(
                    read(probe, here - below * 1024, 8),
                    None,
                    "{below} KiB below"
                );
            }
        });
        assert!(!fibertrace_fiber::embed::overflow::running_fiber_open());
    });
    s.run().unwrap();
    // SAFETY: removes the handler set above.
    unsafe { fibertrace_fiber::embed::overflow::set_thread_handler(None) };
    assert_eq!(OPENED.load(std::sync::atomic::Ordering::SeqCst), 0);

    // Another handler of SIGSEGV or SIGBUS: no probes, until ours is back.
    for sig in [libc::SIGSEGV, libc::SIGBUS] {
        // SAFETY: the disposition is read, replaced by a handler of ours, then put back;
        // no probe runs meanwhile (this is the only test of this binary).
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = other_handler as *const () as usize;
            assert_eq!(libc::sigaction(sig, &sa, &mut ours), 0);
            assert!(!sound(), "signal {sig} taken over");
            assert_eq!(libc::sigaction(sig, &ours, std::ptr::null_mut()), 0);
        }
        ProbeReads::with(|probe| {
            assert_eq!(read(probe.expect("back in place"), gone, 8), None);
        });
    }
}
