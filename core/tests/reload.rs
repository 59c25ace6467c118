//! A library unloaded and another loaded at its address (a plugin reloaded): frames in it
//! are named from the library there now, not from the one the symbolizer read before — by
//! any lookup once one that was not cached noticed the change, or after
//! [`symbolize::revalidate`]. Its own test binary: it loads and unloads libraries in the
//! process, whose image table every test of a binary shares.

#[path = "../../tests/scratch.rs"]
mod scratch;
use scratch::Scratch;

use std::ffi::CString;
use std::path::Path;
use std::process::Command;

use fibertrace_core::{symbolize, Frame};

/// A shared library of two functions, `ft_<tag>_one` and `ft_<tag>_two` (tags of one length:
/// the two libraries' code has one layout), built with the C compiler.
fn library(dir: &Path, tag: &str) -> CString {
    let src = dir.join(format!("{tag}.c"));
    std::fs::write(
        &src,
        format!(
            "int ft_{tag}_one(int x) {{ return x * 3 + 1; }}\n\
             int ft_{tag}_two(int x) {{ return x * 5 + 2; }}\n"
        ),
    )
    .unwrap();
    let so = dir.join(format!("lib{tag}.so"));
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .expect("the C compiler (cc) runs");
    assert!(st.success());
    CString::new(so.to_str().unwrap()).unwrap()
}

/// Loads `lib`: its handle and the addresses of its two functions.
fn load(lib: &CString, tag: &str) -> (*mut libc::c_void, u64, u64) {
    // SAFETY: a NUL-terminated path; the library's constructors are the C compiler's own.
    let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "{lib:?} loads");
    let sym = |name: String| {
        let name = CString::new(name).unwrap();
        // SAFETY: a valid handle and a NUL-terminated name.
        let a = unsafe { libc::dlsym(h, name.as_ptr()) } as u64;
        assert_ne!(a, 0, "{name:?}");
        a
    };
    (
        h,
        sym(format!("ft_{tag}_one")),
        sym(format!("ft_{tag}_two")),
    )
}

fn unload(h: *mut libc::c_void) {
    // SAFETY: a handle from `dlopen`, closed once; nothing of the library is used after.
    assert_eq!(unsafe { libc::dlclose(h) }, 0);
}

/// The function the full lookup and the symbol table's name at `pc`.
fn names(pc: u64) -> (Option<String>, Option<String>) {
    let full = symbolize::resolve(&Frame::Pc(pc)).unwrap();
    let outer = symbolize::resolve_outer(&Frame::Pc(pc)).unwrap();
    (
        full.function().map(str::to_string),
        outer.function().map(str::to_string),
    )
}

fn both(name: &str) -> (Option<String>, Option<String>) {
    (Some(name.to_string()), Some(name.to_string()))
}

const MINE: &str = "reload::a_function_of_this_binary";

#[inline(never)]
fn a_function_of_this_binary(x: u64) -> u64 {
    std::hint::black_box(x).rotate_left(9) ^ 0x77
}

#[test]
fn a_library_loaded_where_another_was_unloaded_is_named_as_itself() {
    let dir = Scratch::new("reload");
    let (a, b) = (library(&dir, "aaaa"), library(&dir, "bbbb"));
    // Both libraries built before either is loaded: nothing else is mapped between the
    // unload and the next load, and the loader puts the second where the first was.
    let mine = a_function_of_this_binary as *const () as usize as u64;
    assert_eq!(names(mine + 1), both(MINE));
    let (ha, a_one, a_two) = load(&a, "aaaa");
    assert_eq!(names(a_one + 1), both("ft_aaaa_one"));
    unload(ha);
    let (hb, b_one, b_two) = load(&b, "bbbb");
    assert_eq!(
        (b_one, b_two),
        (a_one, a_two),
        "the loader put the second library where the first one was (what this test needs)"
    );
    // An address not looked up before: the lookup notices the change (and reads the library
    // there now, not the one it opened for that address before).
    assert_eq!(names(b_two + 1), both("ft_bbbb_two"));
    let r = symbolize::resolve(&Frame::Pc(b_two + 1)).unwrap();
    assert!(
        r.image.as_ref().unwrap().path.ends_with("/libbbbb.so"),
        "{r:?}"
    );
    // And the address looked up before is not named from the cache of the old library.
    assert_eq!(names(b_one + 1), both("ft_bbbb_one"));
    // What was cached of other images is kept: a thread that holds another still, which
    // gets cached answers only, still has this test's own function.
    {
        let _h = fibertrace_core::capture::holding_another_thread();
        assert_eq!(names(mine + 1), both(MINE));
    }
    // The other way round, every address cached: only `revalidate` learns of the change.
    unload(hb);
    let (ha, a_one2, _) = load(&a, "aaaa");
    assert_eq!(a_one2, a_one, "the first library back where it was");
    symbolize::revalidate();
    assert_eq!(names(a_one + 1), both("ft_aaaa_one"));
    assert_eq!(names(a_two + 1), both("ft_aaaa_two"));
    unload(ha);
}
