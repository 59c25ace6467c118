//! Glue frames (catch_unwind, boxed FnOnce calls, the fiber trampoline) are left out of the
//! text reports by default and shown with `glue::set_native_detail(true)`. One test: the
//! setting is process-wide.

use fibertrace_fiber::{channel, glue, Builder, Channel, Scheduler};

#[inline(never)]
fn wait_inside(rx: &Channel<u8>) -> u8 {
    let v = rx.recv().unwrap();
    std::hint::black_box(v)
}

#[inline(never)]
fn through_catch_unwind(rx: &Channel<u8>) -> u8 {
    let v = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait_inside(rx))).unwrap();
    std::hint::black_box(v)
}

/// The function names of a fiber block's frames, each level of a frame (inline ones too),
/// without addresses, offsets and locations.
fn levels(block: &str) -> Vec<String> {
    block
        .lines()
        .take_while(|l| !l.starts_with("created by"))
        .filter_map(|l| {
            let rest = l
                .split_once(" in ")
                .map(|(_, r)| r)
                .or_else(|| l.trim_start().strip_prefix("inlined into "))?;
            let rest = rest.split(" at ").next().unwrap();
            let name = match rest.rsplit_once("+0x") {
                Some((n, _)) => n,
                None => rest,
            };
            Some(name.to_string())
        })
        .collect()
}

#[test]
fn glue_is_hidden_by_default_and_shown_with_native_detail() {
    let (hidden, shown) = Scheduler::new()
        .block_on(|| {
            let ch = channel::<u8>(1);
            let rx = ch.clone();
            let h = Builder::new()
                .name("glued")
                .spawn(move || through_catch_unwind(&rx));
            fibertrace_fiber::yield_now();
            let block = |text: String| {
                text.split("\n\n")
                    .find(|b| b.contains("\"glued\" ["))
                    .unwrap_or_else(|| panic!("{text}"))
                    .to_string()
            };
            let hidden = block(fibertrace_fiber::dump::dump_text());
            glue::set_native_detail(true);
            let shown = block(fibertrace_fiber::dump::dump_text());
            glue::set_native_detail(false);
            ch.send(1).unwrap();
            assert_eq!(h.join().unwrap(), 1);
            (hidden, shown)
        })
        .unwrap();
    let hidden = levels(&hidden);
    let shown = levels(&shown);
    let is_glue = |n: &String| {
        n.starts_with("std::panicking::")
            || n.starts_with("std::panic::catch_unwind")
            || n == "__rust_try"
            || n.contains("FnOnce")
            || n == fibertrace_fiber::TRAMPOLINE
    };
    // By default: the user's calls and the runtime's wait only.
    assert!(!hidden.iter().any(is_glue), "{hidden:#?}");
    assert_eq!(
        &hidden[..3],
        [
            "fibertrace_fiber::sched::block",
            "fibertrace_fiber::sync::Channel<T>::recv_until",
            "fibertrace_fiber::sync::Channel<T>::recv",
        ],
        "{hidden:#?}"
    );
    let user: Vec<&str> = hidden[3..]
        .iter()
        .map(|s| s.as_str())
        .filter(|s| s.starts_with("glue::"))
        .collect();
    assert_eq!(
        user,
        [
            "glue::wait_inside",
            "glue::through_catch_unwind::{{closure}}",
            "glue::through_catch_unwind",
            "glue::glue_is_hidden_by_default_and_shown_with_native_detail::{{closure}}::{{closure}}",
        ],
        "{hidden:#?}"
    );
    // With native detail: the same levels with the glue between them.
    assert!(
        shown.iter().any(|n| n == "std::panicking::catch_unwind"),
        "{shown:#?}"
    );
    assert!(
        shown.iter().any(|n| n
            == "<core::panic::unwind_safe::AssertUnwindSafe<F> as core::ops::function::FnOnce<()>>::call_once"),
        "{shown:#?}"
    );
    let without: Vec<&String> = shown.iter().filter(|n| !is_glue(n)).collect();
    assert_eq!(without, hidden.iter().collect::<Vec<_>>(), "{shown:#?}");
}
