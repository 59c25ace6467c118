//! A walk from inside a signal handler goes through the signal frame: past the kernel's
//! signal-return trampoline it resumes from the interrupted context, so the interrupted
//! function itself is in the trace (it is in no frame record: its pc is only in the saved
//! context), followed by its callers.

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use fibertrace_core::{collect, Backtrace, CaptureOptions, Frame, Unwinder};

static DONE: AtomicBool = AtomicBool::new(false);
static MODE: Mutex<Unwinder> = Mutex::new(Unwinder::Auto);
static CAUGHT: Mutex<Option<Backtrace>> = Mutex::new(None);

#[inline(never)]
extern "C" fn on_signal(_sig: libc::c_int) {
    // The interrupted code (a spin loop) holds neither lock.
    let mode = *MODE.lock().unwrap();
    let bt = collect(&CaptureOptions::with_unwinder(mode));
    *CAUGHT.lock().unwrap() = Some(bt);
    DONE.store(true, Ordering::SeqCst);
}

#[inline(never)]
fn spin_here() {
    while !DONE.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    black_box(());
}

#[inline(never)]
fn spin_outer() {
    spin_here();
    black_box(());
}

fn trace_from_handler(mode: Unwinder) -> Backtrace {
    DONE.store(false, Ordering::SeqCst);
    *MODE.lock().unwrap() = mode;
    // SAFETY: installs a handler for SIGUSR2 (which nothing else in this test binary uses).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        black_box(collect(&CaptureOptions::default())); // set up this thread's caches
                                                        // SAFETY: pthread_self has no preconditions.
        tx.send(unsafe { libc::pthread_self() } as u64).unwrap();
        spin_outer();
    });
    let th = rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: the thread is alive (it spins until the handler ran).
    let sent = unsafe { libc::pthread_kill(th as libc::pthread_t, libc::SIGUSR2) };
    assert_eq!(sent, 0);
    t.join().unwrap();
    let bt = CAUGHT.lock().unwrap().take().expect("the handler ran");
    bt
}

#[test]
fn a_walk_from_a_signal_handler_reaches_the_interrupted_function() {
    for mode in [Unwinder::Auto, Unwinder::Precise] {
        let bt = trace_from_handler(mode);
        let n = common::short_names(bt.frames());
        let h = n
            .iter()
            .position(|x| x == "on_signal")
            .unwrap_or_else(|| panic!("{mode:?}: {n:?}"));
        // The handler, the trampoline (no symbol in a stripped libc), then the interrupted
        // context: its pc (a `Pc` frame, in the spin loop or, unoptimised, in the atomic
        // load it calls), and on through the callers.
        assert!(
            matches!(bt.frames()[h + 2], Frame::Pc(_)),
            "{mode:?}: the interrupted pc: {:?} {n:?}",
            bt.frames()
        );
        // Outermost names: in an optimised build the loop's atomic load is inlined into it.
        let after: Vec<String> = bt.frames()[h + 2..]
            .iter()
            .map(common::outer_name)
            .collect();
        let k = after
            .iter()
            .position(|x| x == "spin_here")
            .unwrap_or_else(|| panic!("{mode:?}: {n:?}"));
        assert!(
            after[..k].iter().all(|x| x == "atomic_load" || x == "load"),
            "{mode:?}: {n:?}"
        );
        assert_eq!(after[k + 1], "spin_outer", "{mode:?}: {n:?}");
    }
}
