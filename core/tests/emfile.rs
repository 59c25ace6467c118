//! The symbolizer out of file descriptors (a test binary of its own: it lowers the process's
//! limit on open files and uses every descriptor up).
//!
//! In a program that set no descriptors aside, a lookup made while none is free cannot open
//! the program's file and names nothing; it is not kept, and the lookup once descriptors are
//! free names the function (the failed lookups were kept, and every later trace stayed
//! `??`). With descriptors set aside (`symbolize::set_aside_descriptors`, as `fibertrace run`
//! does), a lookup at the limit names it (checked by the Lua host's tests, where `run` sets
//! them aside: `lua/tests/reliability.rs`, `lua/tests/http.rs`).

use std::hint::black_box;

use fibertrace_core::symbolize;

#[inline(never)]
fn marker() -> u32 {
    black_box(7)
}

/// Opens `/dev/null` until the process is out of descriptors; the files.
fn use_every_descriptor() -> Vec<std::fs::File> {
    let mut held = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                return held;
            }
        }
    }
}

#[test]
fn a_lookup_out_of_descriptors_is_tried_again_once_they_are_free() {
    // A low limit (soft only: the hard one stays), for this process alone.
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and fill a struct of ours.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max.min(256);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
    let addr = marker as *const () as usize as u64 + 1;
    let name = |addr: u64| {
        symbolize::resolve_address(addr)
            .function()
            .map(str::to_owned)
    };
    let held = use_every_descriptor();
    assert!(held.len() > 100, "{}", held.len());
    assert_eq!(name(addr), None);
    drop(held);
    assert_eq!(name(addr).as_deref(), Some("emfile::marker"));
}
