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

/// A name as the legacy symbol mangling's demangler writes it, whichever wrote it: a crate
/// built with the v0 mangling (`-C symbol-mangling-version=v0`, nightly's default), and the
/// debug information of an inlined call, name a closure `{closure#0}` where the legacy form
/// is `{{closure}}`, a vtable shim `{shim:vtable#0}` where it is `{{vtable.shim}}`, an
/// inherent method `<app::Job>::run` where it is `app::Job::run`, and keep the generic
/// arguments of each path segment (`run_main::<&Vec<u8>>::{closure#1}`) that the legacy form
/// leaves out. The glue lists are written in the legacy form; each name is brought to it
/// before it is looked up.
fn legacy_form(name: &str) -> std::borrow::Cow<'_, str> {
    let inherent = inherent_impl_end(name);
    if inherent.is_none()
        && !name.contains("{closure#")
        && !name.contains("{shim:vtable#")
        && !name.contains("::<")
    {
        return std::borrow::Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len());
    let mut rest = match inherent {
        // `<app::Job>::run` → `app::Job::run`.
        Some(end) => {
            out.push_str(&name[1..end]);
            &name[end + 1..]
        }
        None => name,
    };
    while let Some(c) = rest.chars().next() {
        // A segment's generic arguments, `::<…>`: left out.
        if rest.starts_with("::<") {
            if let Some(len) = angle_len(&rest[2..]) {
                rest = &rest[2 + len..];
                continue;
            }
        }
        if c == '{' {
            let replaced = [
                ("{closure#", "{{closure}}"),
                ("{shim:vtable#", "{{vtable.shim}}"),
            ]
            .iter()
            .find_map(|(lead, legacy)| {
                let digits = rest.strip_prefix(lead)?;
                let n = digits.bytes().take_while(u8::is_ascii_digit).count();
                (n > 0 && digits[n..].starts_with('}')).then(|| (lead.len() + n + 1, *legacy))
            });
            if let Some((len, legacy)) = replaced {
                out.push_str(legacy);
                rest = &rest[len..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    std::borrow::Cow::Owned(out)
}

/// The length of the bracketed `<…>` that `s` starts with, through its matching `>` (the
/// `>` of a `->` inside is not one); `None` when it is not closed.
fn angle_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    if b.first() != Some(&b'<') {
        return None;
    }
    let mut depth = 0usize;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'<' => depth += 1,
            b'>' if i > 0 && b[i - 1] == b'-' => {}
            b'>' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Where the `>` closing a leading `<Type>` of an inherent method's name is (`<app::Job>::run`,
/// `<app::Pool<T>>::get`), when the name is one: not a trait's (`<A as B>::f`), and followed
/// by `::`.
fn inherent_impl_end(name: &str) -> Option<usize> {
    let len = angle_len(name)?;
    let inside = &name[1..len - 1];
    // (` as ` at the top level makes it a trait's; one inside a nested `<…>` does not.)
    let mut depth = 0usize;
    for (i, c) in inside.char_indices() {
        match c {
            '<' => depth += 1,
            '>' if i > 0 && inside.as_bytes()[i - 1] == b'-' => {}
            '>' => depth = depth.saturating_sub(1),
            ' ' if depth == 0 && inside[i..].starts_with(" as ") => return None,
            _ => {}
        }
    }
    name[len..].starts_with("::").then_some(len - 1)
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
    let name = &*legacy_form(name);
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

    #[test]
    fn v0_and_inlined_names_are_brought_to_the_legacy_form() {
        for (v0, legacy) in [
            ("app::main::{closure#0}", "app::main::{{closure}}"),
            (
                "app::f::{closure#12}::{closure#0}",
                "app::f::{{closure}}::{{closure}}",
            ),
            ("<app::Job>::run", "app::Job::run"),
            (
                "<app::Pool<u8>>::get::{closure#1}",
                "app::Pool<u8>::get::{{closure}}",
            ),
            (
                "core::ops::function::FnOnce::call_once{shim:vtable#0}",
                "core::ops::function::FnOnce::call_once{{vtable.shim}}",
            ),
            // Unchanged: already legacy, a trait's method, a closure's type, no number.
            ("app::main::{{closure}}", "app::main::{{closure}}"),
            ("<app::Job as app::Run>::run", "<app::Job as app::Run>::run"),
            (
                "app::call<app::{closure_env#0}>",
                "app::call<app::{closure_env#0}>",
            ),
            ("app::{closure#}", "app::{closure#}"),
            ("app::{closure#1", "app::{closure#1"),
            ("<app::Job>", "<app::Job>"),
            ("<<app::Job>::run", "<<app::Job>::run"),
            ("", ""),
            // Generic arguments of a segment, nested ones and a function type's arrow too.
            (
                "<app::Host>::run_main::<&alloc::vec::Vec<u8>>::{closure#1}",
                "app::Host::run_main::{{closure}}",
            ),
            ("app::call::<fn() -> u8, 3>::go", "app::call::go"),
            ("<fn() -> u8>::f", "fn() -> u8::f"),
            ("app::f::<unclosed", "app::f::<unclosed"),
            (
                "<app::Pool<<app::X as app::Y>::Z>>::get",
                "app::Pool<<app::X as app::Y>::Z>::get",
            ),
        ] {
            assert_eq!(legacy_form(v0), legacy, "{v0}");
        }
    }

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
        // As the v0 mangling and inlined calls' debug information name them.
        for g in [
            "std::rt::lang_start::{closure#0}",
            "core::ops::function::FnOnce::call_once{shim:vtable#0}",
            "std::panicking::catch_unwind::do_call::<app::main::{closure#3}, ()>",
        ] {
            assert!(is_glue(&sym(g)), "{g}");
        }
        for user in [
            "app::main",
            "app::main::{closure#0}",
            "<app::Job>::run",
            "<app::Job<std::rt::lang_start::{closure#0}>>::run",
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
