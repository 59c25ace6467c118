//! Which frames of a report are glue: calls the runtime, the standard library or a host
//! (the Lua layer) makes between a user's code and what it called — `catch_unwind` and the
//! closures it calls, boxed `FnOnce` calls, the fiber trampoline, a host's wrapper of each
//! function it gives its language. The text reports leave them out by default (a frame whose
//! every function level is glue is left out, the others keep their other levels), so that a
//! fiber's trace reads as the user's calls; [`set_native_detail`] shows everything. The
//! snapshot and its JSON keep every frame.
//!
//! A level is recognized by its demangled name (and, for a host, its source file), so how it
//! can be wrong: a user's function with one of these exact names is hidden too; a host's glue
//! in a build without debug information keeps the frames a file name would have recognized.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use fibertrace_core::symbolize::Symbol;

/// Says whether a function level (its demangled name, its source file when known) is a
/// host's glue.
pub type GlueFn = fn(name: &str, file: Option<&str>) -> bool;

static DETAIL: AtomicBool = AtomicBool::new(false);
static HOSTS: RwLock<Vec<GlueFn>> = RwLock::new(Vec::new());

/// The standard library's and this runtime's glue, by exact name (generic arguments left
/// out, see [`base_name`]).
const GLUE: &[&str] = &[
    "std::panicking::catch_unwind",
    "std::panicking::catch_unwind::do_call",
    "std::panicking::try",
    "std::panicking::try::do_call",
    "std::panic::catch_unwind",
    "__rust_try",
    "core::ops::function::FnOnce::call_once",
    "core::ops::function::FnOnce::call_once{{vtable.shim}}",
    "<core::panic::unwind_safe::AssertUnwindSafe<F> as core::ops::function::FnOnce<()>>::call_once",
    "<alloc::boxed::Box<F,A> as core::ops::function::FnOnce<Args>>::call_once",
    crate::frames::TRAMPOLINE,
    // How the standard library starts the main thread and a spawned one.
    "std::rt::lang_start",
    "std::rt::lang_start::{{closure}}",
    "std::rt::lang_start_internal",
    "std::rt::lang_start_internal::{closure#0}",
    "std::rt::lang_start_internal::{{closure}}",
    "std::sys::backtrace::__rust_begin_short_backtrace",
];

/// The standard library's calls of a closure through a trait object or a box
/// (`<&dyn Fn<()> as FnOnce<()>>::call_once`, `<Box<F,A> as FnOnce<Args>>::call_once`).
fn fn_once_shim(name: &str) -> bool {
    name.starts_with('<')
        && name.contains(" as core::ops::function::FnOnce<")
        && (name.ends_with(">::call_once") || name.ends_with(">::call_once{{vtable.shim}}"))
}

/// A name without its generic arguments: `std::panic::catch_unwind::<F, R>` (as debug
/// information names an inlined instance) and `call_user<F, T>` are `std::panic::catch_unwind`
/// and `call_user`; a qualified path (`<A as B>::f`) is kept whole.
fn base_name(name: &str) -> &str {
    if let Some(i) = name.find("::<") {
        return &name[..i];
    }
    if !name.starts_with('<') && name.ends_with('>') {
        if let Some(i) = name.find('<') {
            return &name[..i];
        }
    }
    name
}

/// Shows (`true`) or hides (`false`, the default) glue frames in every text report of the
/// process.
pub fn set_native_detail(on: bool) {
    DETAIL.store(on, Ordering::Relaxed);
}

/// Whether text reports show glue frames.
pub fn native_detail() -> bool {
    DETAIL.load(Ordering::Relaxed)
}

/// Adds a host's glue (a host calls it once as it installs; adding the same function again
/// does nothing).
pub fn add_host_glue(f: GlueFn) {
    let mut v = HOSTS.write().unwrap_or_else(|e| e.into_inner());
    if !v.iter().any(|g| std::ptr::fn_addr_eq(*g, f)) {
        v.push(f);
    }
}

/// Whether a function level is glue (whatever [`native_detail`] says).
pub fn is_glue(s: &Symbol) -> bool {
    let Some(name) = s.name.as_deref() else {
        return false;
    };
    if GLUE.contains(&base_name(name)) || fn_once_shim(name) {
        return true;
    }
    let hosts = HOSTS.read().unwrap_or_else(|e| e.into_inner());
    hosts.iter().any(|g| g(name, s.file.as_deref()))
}

/// The filter a text report passes to the formatter: `None` when glue is shown.
pub fn filter() -> Option<&'static dyn Fn(&Symbol) -> bool> {
    (!native_detail()).then_some(&is_glue as &dyn Fn(&Symbol) -> bool)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sym(name: &str) -> Symbol {
        Symbol {
            name: Some(name.to_string()),
            file: None,
            line: None,
            column: None,
            inlined: false,
        }
    }

    #[test]
    fn glue_names_with_and_without_generic_arguments() {
        for g in [
            "std::panicking::catch_unwind",
            "std::panicking::catch_unwind::<i32, &dyn core::ops::function::Fn<(), Output = i32>>",
            "std::panicking::catch_unwind::do_call::<std::rt::lang_start_internal::{closure#0}, isize>",
            "std::rt::lang_start_internal::{closure#0}",
            "<&dyn core::ops::function::Fn<(), Output = i32> + core::marker::Sync as core::ops::function::FnOnce<()>>::call_once",
            "<alloc::boxed::Box<F,A> as core::ops::function::FnOnce<Args>>::call_once",
            "fibertrace_fiber::frames::call_user",
            "fibertrace_fiber::frames::call_user<app::{closure_env#0}, u32>",
        ] {
            assert!(is_glue(&sym(g)), "{g}");
        }
        for user in [
            "app::main",
            "app::catch_unwind",
            "std::panicking::catch_unwind_extra",
            "<app::Job as app::Run>::call_once",
            "fibertrace_fiber::sched::block",
        ] {
            assert!(!is_glue(&sym(user)), "{user}");
        }
        assert!(!is_glue(&Symbol {
            name: None,
            ..sym("")
        }));
    }
}
