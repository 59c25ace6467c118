//! Symbolization and formatting: exact names, offsets, file:line; Tarantool's format; serde;
//! shared-library exports without debug info; concurrent resolution.

mod common;

use std::hint::black_box;

use fibertrace_core::format::{self, resolve_all, ResolvedBacktrace};
use fibertrace_core::symbolize::{self, resolve};
use fibertrace_core::{collect, Backtrace, CaptureOptions, Frame};

#[inline(never)]
fn outer() -> (Backtrace, u32) {
    let r = inner();
    black_box(&r);
    r
}

#[inline(never)]
fn inner() -> (Backtrace, u32) {
    let (bt, l) = (collect(&CaptureOptions::default()), line!());
    black_box(&bt);
    (bt, l)
}

#[test]
fn default_text_format_names_offsets_and_lines() {
    let (bt, line) = outer();
    let text = format::display(bt.frames());
    let first = text.lines().next().unwrap();
    let Frame::Ra(addr) = bt.frames()[0] else {
        panic!("{bt:?}")
    };
    let off = addr - inner as *const () as usize as u64;
    let prefix = format!("#0  {addr:#x} in resolve::inner+{off:#x} at ");
    assert!(first.starts_with(&prefix), "{first:?} vs {prefix:?}");
    assert!(
        first.ends_with(&format!("core/tests/resolve.rs:{line}")),
        "{first}"
    );
    let second = text.lines().nth(1).unwrap();
    assert!(second.starts_with("#1  0x"), "{second}");
    assert!(second.contains(" in resolve::outer+0x"), "{second}");
}

#[test]
fn tarantool_format_uses_decimal_offsets_from_one() {
    let (bt, _) = outer();
    let Frame::Ra(addr) = bt.frames()[0] else {
        panic!()
    };
    let off = addr - inner as *const () as usize as u64;
    assert_eq!(
        format::tarantool_c_frame(1, &bt.frames()[0]).unwrap(),
        format!("#1  {addr:#x} in resolve::inner+{off}")
    );
    let text = format::tarantool(bt.frames(), None);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("#1  {addr:#x} in resolve::inner+{off}"));
    assert!(lines[1].starts_with("#2  0x"), "{}", lines[1]);
    assert!(lines[1].contains(" in resolve::outer+"), "{}", lines[1]);
    // Unresolvable address.
    assert_eq!(
        format::tarantool_c_frame(12, &Frame::Pc(0x10)).unwrap(),
        "#12 0x10 in ??+0"
    );
}

#[test]
fn markers_and_lua_frames_in_text() {
    let frames = [
        Frame::Omitted(91),
        Frame::Lua(fibertrace_core::LuaFrameId(3)),
        Frame::Parent(7),
        Frame::Pc(0x10),
        Frame::Truncated,
    ];
    let namer = |id: fibertrace_core::LuaFrameId| Some(format!("leaf in @script.lua:{}", id.0));
    let text = format::text(
        &frames,
        &format::TextOptions {
            lua: Some(&namer),
            ..Default::default()
        },
    );
    assert_eq!(
        text,
        "#0  ... 91 frames omitted ...\n\
         #1  leaf in @script.lua:3\n\
         --- created by fiber 7 ---\n\
         #2  0x10 in ??\n\
         #3  ... truncated ...\n"
    );
}

#[test]
fn shared_library_export_without_debug_info_is_named() {
    let q = libc::qsort as *const () as usize as u64;
    let r = resolve(&Frame::Pc(q + 4)).unwrap();
    assert_eq!(r.function(), Some("qsort"));
    assert_eq!(r.offset_of(q + 4), Some(4));
    let img = r.image.as_ref().unwrap();
    assert!(img.path.contains("libc.so"), "{}", img.path);
    assert!(img.build_id.is_some());
}

#[test]
fn return_addresses_are_looked_up_one_byte_back() {
    let f = inner as *const () as usize as u64;
    // A return address equal to the next function's start belongs to the previous one.
    assert_eq!(Frame::Ra(f).lookup_address(), Some(f - 1));
    assert_eq!(Frame::Pc(f).lookup_address(), Some(f));
    let r = resolve(&Frame::Pc(f)).unwrap();
    assert_eq!(r.function(), Some("resolve::inner"));
    assert_eq!(r.offset_of(f), Some(0));
}

#[test]
fn resolved_backtrace_serializes() {
    let (bt, line) = outer();
    let resolved = resolve_all(bt.frames());
    let json = serde_json::to_string(&resolved).unwrap();
    let back: ResolvedBacktrace = serde_json::from_str(&json).unwrap();
    assert_eq!(back, resolved);
    let f0 = resolved.frames[0].resolved.as_ref().unwrap();
    assert_eq!(f0.function(), Some("resolve::inner"));
    assert_eq!(f0.innermost().unwrap().line, Some(line));
    // The raw trace serializes too.
    let raw = serde_json::to_string(&bt).unwrap();
    assert_eq!(serde_json::from_str::<Backtrace>(&raw).unwrap(), bt);
}

#[test]
fn concurrent_resolution_from_8_threads_agrees() {
    let (bt, _) = outer();
    let frames: Vec<Frame> = bt.frames().to_vec();
    symbolize::clear_cache();
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let frames = frames.clone();
            std::thread::spawn(move || {
                let mut out = vec![None; frames.len()];
                for k in 0..frames.len() {
                    // Each thread walks the frames in a different order (rotated, and
                    // reversed on odd threads).
                    let r = (k + t) % frames.len();
                    let i = if t % 2 == 1 { frames.len() - 1 - r } else { r };
                    out[i] = resolve(&frames[i]).map(|r| (*r).clone());
                }
                out
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let expected: Vec<_> = frames
        .iter()
        .map(|f| resolve(f).map(|r| (*r).clone()))
        .collect();
    for r in &results {
        assert_eq!(r, &expected);
    }
    assert_eq!(
        expected[0].as_ref().unwrap().function(),
        Some("resolve::inner")
    );
}

#[test]
fn libraries_loaded_later_are_found() {
    // Build the image table first, then load a library it cannot know.
    let before = fibertrace_core::image::table().images().len();
    // SAFETY: dlopen with a NUL-terminated name; the handle is deliberately kept open.
    let h = unsafe { libc::dlopen(c"libbz2.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "libbz2.so.1 is part of Debian's base system");
    // SAFETY: dlsym on a valid handle with a NUL-terminated name.
    let f = unsafe { libc::dlsym(h, c"BZ2_bzlibVersion".as_ptr()) } as u64;
    assert_ne!(f, 0);
    let r = resolve(&Frame::Pc(f + 1)).unwrap();
    assert_eq!(r.function(), Some("BZ2_bzlibVersion"));
    assert_eq!(r.offset_of(f + 1), Some(1));
    assert!(r.image.as_ref().unwrap().path.contains("libbz2.so"));
    assert!(fibertrace_core::image::table().images().len() > before);
}

#[test]
fn offline_lookup_outside_code_finds_nothing() {
    let exe = std::env::current_exe().unwrap();
    let elf = symbolize::ElfSymbols::open(&exe).unwrap();
    assert_eq!(elf.lookup(1), symbolize::Lookup::default());
    // And a real function is found by its file address.
    let img = &fibertrace_core::image::table().images()[0];
    let f = inner as *const () as usize as u64;
    let l = elf.lookup(f - img.base);
    assert_eq!(
        l.symbols.last().and_then(|s| s.name.as_deref()),
        Some("resolve::inner")
    );
    assert_eq!(l.function_start, Some(f - img.base));
    assert_eq!(elf.build_id(), img.build_id.as_deref());
}

/// A stripped library's internal functions (not exported) are named from its detached debug
/// file when one is installed (Debian's `libc6-dbg`: CI installs it), with file and line;
/// without it they stay unnamed. Either way the exported names stay the file's own.
#[test]
fn a_stripped_librarys_internals_are_named_from_its_detached_debug_file() {
    // A thread's outermost frames are glibc's `start_thread`, which glibc does not export.
    let bt = std::thread::spawn(|| {
        collect(&CaptureOptions::with_unwinder(
            fibertrace_core::Unwinder::Precise,
        ))
    })
    .join()
    .unwrap();
    let libc: Vec<_> = bt
        .frames()
        .iter()
        .filter_map(resolve)
        .filter(|r| r.image.as_ref().is_some_and(|i| i.path.contains("libc.so")))
        .collect();
    let start = libc.last().expect("a libc frame at the bottom");
    let id = start.image.as_ref().unwrap().build_id.clone().unwrap();
    let detached = std::path::PathBuf::from(format!(
        "/usr/lib/debug/.build-id/{}/{}.debug",
        &id[..2],
        &id[2..]
    ));
    let names: Vec<&str> = libc.iter().filter_map(|r| r.function()).collect();
    if detached.is_file() {
        assert!(names.contains(&"start_thread"), "{names:?}");
        let s = libc
            .iter()
            .find(|r| r.function() == Some("start_thread"))
            .unwrap();
        assert!(
            s.symbols.iter().any(|l| l
                .file
                .as_deref()
                .is_some_and(|f| f.ends_with("pthread_create.c"))),
            "{s:?}"
        );
    } else {
        assert!(!names.contains(&"start_thread"), "{names:?}");
    }
    // The exported name, not the debug file's alias (`__GI_qsort`).
    let q = libc::qsort as *const () as usize as u64;
    assert_eq!(
        resolve(&Frame::Pc(q + 4)).unwrap().function(),
        Some("qsort")
    );
    // The symbol-table tier names them alike: exports from the library's own table, its
    // internals (`start_thread`) from the debug file's when it is installed.
    for r in &libc {
        let o = symbolize::resolve_outer_address(r.lookup_address);
        assert_eq!(o.function(), r.function(), "{r:?}");
        assert_eq!(o.function_start, r.function_start, "{r:?}");
        assert!(o.symbols.len() <= 1, "{o:?}");
    }
    assert_eq!(
        symbolize::resolve_outer(&Frame::Pc(q + 4))
            .unwrap()
            .function(),
        Some("qsort")
    );
}

/// The DWARF is loaded at the first full lookup, by path: a file replaced on disk since it
/// was opened (a deploy renames a new build over the old) is not read — its names come from
/// the symbol table read at open, and the DWARF's absence says why.
#[test]
fn a_file_replaced_after_it_was_opened_is_named_from_its_own_symbol_table() {
    let dir = std::env::temp_dir().join(format!("fibertrace-replaced-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("prog");
    std::fs::copy(std::env::current_exe().unwrap(), &copy).unwrap();
    let elf = symbolize::ElfSymbols::open(&copy).unwrap();
    // Another ELF file renamed over it.
    let other = dir.join("other");
    std::fs::copy("/bin/true", &other).unwrap();
    std::fs::rename(&other, &copy).unwrap();
    let img = &fibertrace_core::image::table().images()[0];
    let f = inner as *const () as usize as u64;
    let l = elf.lookup(f - img.base);
    assert_eq!(
        l.symbols.last().and_then(|s| s.name.as_deref()),
        Some("resolve::inner"),
        "{l:?}"
    );
    assert_eq!(l.function_start, Some(f - img.base));
    assert_eq!(l.symbols.len(), 1, "no DWARF levels: {l:?}");
    assert_eq!(
        (l.symbols[0].file.as_deref(), l.symbols[0].line),
        (None, None)
    );
    assert!(!l.partial, "a lasting answer");
    assert_eq!(
        elf.dwarf_error(),
        Some("the file was replaced since it was opened")
    );
    // The same file left in place loads its DWARF: lines.
    std::fs::copy(std::env::current_exe().unwrap(), dir.join("kept")).unwrap();
    let kept = symbolize::ElfSymbols::open(dir.join("kept")).unwrap();
    let l = kept.lookup(f - img.base);
    assert_eq!(kept.dwarf_error(), None);
    assert!(l.symbols.last().unwrap().line.is_some(), "{l:?}");
    // The same build put in its place (a reinstall: a new file, the same build id): read.
    std::fs::copy(std::env::current_exe().unwrap(), dir.join("again")).unwrap();
    let again = symbolize::ElfSymbols::open(dir.join("again")).unwrap();
    std::fs::copy(std::env::current_exe().unwrap(), dir.join("new")).unwrap();
    std::fs::rename(dir.join("new"), dir.join("again")).unwrap();
    let l = again.lookup(f - img.base);
    assert_eq!(again.dwarf_error(), None);
    assert!(l.symbols.last().unwrap().line.is_some(), "{l:?}");
    // A file removed since: named from the table, and said why.
    std::fs::copy(std::env::current_exe().unwrap(), dir.join("gone")).unwrap();
    let gone = symbolize::ElfSymbols::open(dir.join("gone")).unwrap();
    std::fs::remove_file(dir.join("gone")).unwrap();
    let l = gone.lookup(f - img.base);
    assert_eq!(l.symbols.len(), 1, "{l:?}");
    assert_eq!(l.symbols[0].name.as_deref(), Some("resolve::inner"));
    assert!(!l.partial);
    assert_eq!(
        gone.dwarf_error(),
        Some("the file was removed since it was opened")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A function only [`a_thread_that_holds_another_gets_cached_answers_only`] looks up.
#[inline(never)]
fn looked_up_while_holding(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_mul(7) ^ 0x33
}

/// A thread that holds another still (`capture::holding_another_thread`) never does a
/// lookup's work: what the caches have, else the address alone, not kept; once it lets go,
/// lookups are whole again.
#[test]
fn a_thread_that_holds_another_gets_cached_answers_only() {
    use fibertrace_core::capture::{
        holding_another_thread as enter, is_holding_another_thread as active,
    };
    let f = looked_up_while_holding as *const () as usize as u64;
    let pc = Frame::Pc(f + 1);
    {
        let _outer = enter();
        {
            let _nested = enter();
            assert!(active());
        }
        assert!(active(), "a nested guard keeps the mark");
        let r = resolve(&pc).unwrap();
        assert_eq!(r.lookup_address, f + 1);
        assert_eq!((r.function(), r.image.is_none()), (None, true), "{r:?}");
        let o = symbolize::resolve_outer(&pc).unwrap();
        assert_eq!(o.function(), None, "{o:?}");
    }
    assert!(!active());
    let name = Some("resolve::looked_up_while_holding");
    assert_eq!(resolve(&pc).unwrap().function(), name);
    // Cached now: a holding thread gets it; the symbol table's tier is cached apart.
    let _h = enter();
    assert_eq!(resolve(&pc).unwrap().function(), name);
    assert_eq!(symbolize::resolve_outer(&pc).unwrap().function(), None);
    drop(_h);
    assert_eq!(symbolize::resolve_outer(&pc).unwrap().function(), name);
}
