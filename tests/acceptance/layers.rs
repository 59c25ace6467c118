//! The code's structure, checked: no import circle between the top-level modules of a crate,
//! `fibertrace-fiber`'s layers used only downwards (inspection above the machinery), and
//! architecture-specific code only in `arch/<arch>.rs` leaf files.
//!
//! A module's references are read from its sources: `crate::m`, `$crate::m`, `use crate::{m,
//! ...}`, and names the crate root re-exports (`crate::Fiber` is `sched`'s). Comments are
//! skipped (a doc link is no import).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use fibertrace_acceptance::repo;

/// Every `.rs` file under `dir`, with its path relative to `dir`.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The code of a file without its comments (line comments; block comments are not used).
fn code(src: &str) -> String {
    src.lines()
        .map(|l| match l.find("//") {
            // A `//` inside a string literal (a URL) would cut the line short: good enough
            // for finding paths, which never follow one.
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level module a file belongs to (`None`: the crate root, or a binary).
fn module_of(rel: &str) -> Option<String> {
    let first = rel.split('/').next().unwrap();
    match first {
        "lib.rs" | "main.rs" | "bin" => None,
        f => Some(f.trim_end_matches(".rs").to_string()),
    }
}

fn idents_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        // `$crate::` is found by its `crate::` too; a longer word ending in `crate` is not.
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(body) = rest.strip_prefix('{') {
            // use crate::{a, b::c, D}
            let end = body.find('}').unwrap_or(body.len());
            for item in body[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

/// The crate root's re-exports: name -> the top-level module it comes from.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let code = code(lib);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("pub use ") {
        rest = &rest[i + 8..];
        let end = rest.find(';').unwrap();
        let stmt: String = rest[..end].split_whitespace().collect();
        let Some((module, names)) = stmt.split_once("::") else {
            continue;
        };
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.rsplit("::").next().unwrap().trim();
            if !n.is_empty() {
                map.insert(n.to_string(), module.to_string());
            }
        }
    }
    map
}

/// Edges between a crate's top-level modules: module -> the modules it refers to.
fn graph(krate: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = repo().join(krate).join("src");
    let files = sources(&src);
    let lib = files
        .iter()
        .find(|(r, _)| r == "lib.rs")
        .map(|(_, s)| s.clone())
        .unwrap();
    let re = reexports(&lib);
    let modules: BTreeSet<String> = files.iter().filter_map(|(r, _)| module_of(r)).collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in &files {
        let Some(m) = module_of(rel) else { continue };
        let entry = g.entry(m.clone()).or_default();
        for name in idents_after(&code(text), "crate::") {
            let target = if modules.contains(&name) {
                Some(name)
            } else {
                re.get(&name).cloned()
            };
            if let Some(t) = target.filter(|t| *t != m) {
                entry.insert(t);
            }
        }
    }
    g
}

/// A cycle in `g`, if there is one (as the list of modules around it).
fn cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = path.iter().position(|p| p == n).unwrap();
                let mut c = path[at..].to_vec();
                c.push(n.to_string());
                return Some(c);
            }
            _ => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    for krate in ["core", "fiber", "lua"] {
        let g = graph(krate);
        assert!(g.len() >= 5, "{krate}: modules not found: {g:?}");
        if let Some(c) = cycle(&g) {
            panic!("{krate}: import circle {}", c.join(" -> "));
        }
    }
}

/// Edges between the files of one folder (the child modules of its `mod.rs`): `super::x`
/// and `crate::<folder path>::x` references.
fn folder_graph(krate: &str, folder: &str) -> BTreeMap<String, BTreeSet<String>> {
    let dir = repo().join(krate).join("src").join(folder);
    let files = sources(&dir);
    let child = |rel: &str| -> Option<String> {
        let first = rel.split('/').next().unwrap();
        (first != "mod.rs").then(|| first.trim_end_matches(".rs").to_string())
    };
    let children: BTreeSet<String> = files.iter().filter_map(|(r, _)| child(r)).collect();
    let full = format!("crate::{}::", folder.replace('/', "::"));
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in &files {
        let Some(m) = child(rel) else { continue };
        // A file directly in the folder reaches siblings by `super::`; one a level deeper
        // by `super::super::`, which the plain search sees as `super::` too (and names its
        // own siblings there, which are not this folder's children unless named alike).
        let code = code(text);
        // A glob of the parent would hide which siblings a file uses.
        assert!(
            !code.lines().any(|l| l.starts_with("use super::*")),
            "{krate}/src/{folder}/{rel}: `use super::*` hides its dependencies; name them"
        );
        let mut names = idents_after(&code, "super::");
        names.extend(idents_after(&code, &full));
        let entry = g.entry(m.clone()).or_default();
        for n in names {
            if children.contains(&n) && n != m {
                entry.insert(n);
            }
        }
    }
    g
}

#[test]
fn no_folder_has_an_import_circle_between_its_files() {
    let mut checked = 0;
    for krate in ["core", "fiber", "lua"] {
        let src = repo().join(krate).join("src");
        let mut stack = vec![src.clone()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p.clone());
                    if p.join("mod.rs").exists() {
                        let folder = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
                        let g = folder_graph(krate, &folder);
                        if let Some(c) = cycle(&g) {
                            panic!("{krate}/src/{folder}: import circle {}", c.join(" -> "));
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked >= 8, "only {checked} folders found");
}

#[test]
fn the_circle_check_finds_a_circle() {
    // The check itself can fail: a graph with a circle is caught.
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(cycle(&g).unwrap(), ["a", "b", "c", "a"]);
    // And references are read through the root's re-exports.
    let re = reexports("pub use sched::{spawn, Fiber};\npub use task::ControlBlock;\n");
    assert_eq!(re["Fiber"], "sched");
    assert_eq!(re["ControlBlock"], "task");
    assert_eq!(
        idents_after(
            "use crate::{task::X, sched};\n$crate::inspect::f()",
            "crate::"
        ),
        ["task", "sched", "inspect"]
    );
}

/// `fibertrace-fiber`'s layers, bottom first (the order `inspect`'s module doc gives). A
/// module may use only modules of lower layers.
const FIBER_LAYERS: &[&[&str]] = &[
    &["clock", "frames"],
    &["task"],
    &["running"],
    &["overflow"],
    &["stack"],
    &["registry"],
    &["publish"],
    &["sched"],
    &["sync"],
    &["inspect"],
    &["runtime", "embed"],
];

#[test]
fn fiber_inspection_sits_above_the_machinery() {
    let g = graph("fiber");
    let rank = |m: &str| {
        FIBER_LAYERS
            .iter()
            .position(|l| l.contains(&m))
            .unwrap_or_else(|| panic!("module {m} is in no layer of FIBER_LAYERS"))
    };
    for (m, uses) in &g {
        for u in uses {
            assert!(
                rank(u) < rank(m),
                "fiber: {m} uses {u}, which is not below it (layers: {FIBER_LAYERS:?})"
            );
        }
    }
    // Nothing but the wiring uses inspection.
    let users: Vec<&String> = g
        .iter()
        .filter(|(_, uses)| uses.contains("inspect"))
        .map(|(m, _)| m)
        .collect();
    assert_eq!(users, ["runtime"]);
}

#[test]
fn architecture_specific_code_is_only_in_arch_leaf_files() {
    // What only one architecture has: its intrinsics, inline assembly, its register names in
    // the unwinding crates.
    let marks = [
        "core::arch::x86_64",
        "std::arch::x86_64",
        "asm!",
        "framehop::x86_64",
        "framehop::aarch64",
        "X86_64::",
        "AArch64::",
        "_rdtsc",
    ];
    let mut found = Vec::new();
    for krate in ["core", "fiber", "lua"] {
        for (rel, text) in sources(&repo().join(krate).join("src")) {
            let leaf = rel.starts_with("arch/") && rel != "arch/mod.rs";
            if leaf {
                continue;
            }
            let code = code(&text);
            for m in marks {
                if code.contains(m) {
                    found.push(format!("{krate}/src/{rel}: {m}"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "architecture-specific code outside arch/<arch>.rs:\n{}",
        found.join("\n")
    );
}

/// The modules each library shows its users (everything else is reached through the crate
/// root's re-exports, or not at all): a module made public by accident fails here.
#[test]
fn each_crate_shows_only_its_documented_modules() {
    let expect: [(&str, &[&str]); 3] = [
        (
            "core",
            &[
                "arch",
                "backtrace",
                "capture",
                "codec",
                "format",
                "frame",
                "heap",
                "image",
                "remote",
                "symbolize",
                "unwind",
            ],
        ),
        // The machinery (clock, frames, overflow, sched, task, ...) is private; what a
        // language host needs of it is in `embed`.
        ("fiber", &["embed", "inspect", "registry", "sync"]),
        (
            "lua",
            &[
                "decode",
                "frames",
                "heap",
                "host",
                "interleave",
                "render",
                "symbols",
            ],
        ),
    ];
    for (krate, want) in expect {
        let lib = std::fs::read_to_string(repo().join(krate).join("src/lib.rs")).unwrap();
        let lib = code(&lib);
        let mut got: Vec<&str> = lib
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub mod "))
            .map(|l| l.trim_end_matches(';').trim())
            .collect();
        got.sort();
        assert_eq!(got, want, "{krate}: public modules");
    }
}

/// The Lua host's object and function modules are written against its safe layer
/// (`host/call.rs`): no `unsafe` block or function outside their tests; only the `unsafe impl
/// UdBlock` that binds an object type to its metatable.
#[test]
fn the_lua_hosts_functions_use_only_the_safe_layer() {
    let host = repo().join("lua/src/host");
    let mut checked = 0;
    for file in [
        "channel.rs",
        "cond.rs",
        "fiber_fns.rs",
        "slice.rs",
        "objects.rs",
        "export.rs",
    ] {
        let src = std::fs::read_to_string(host.join(file)).unwrap();
        let body = match src.find("#[cfg(test)]") {
            Some(i) => &src[..i],
            None => &src[..],
        };
        let body = code(body);
        for (n, line) in body.lines().enumerate() {
            let rest = line.replace("unsafe impl UdBlock", "");
            assert!(
                !rest.contains("unsafe"),
                "{file}:{}: `unsafe` outside the safe layer: {line}",
                n + 1
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 6);
    // The check can fail: the layer itself is all `unsafe` blocks.
    let call = code(&std::fs::read_to_string(host.join("call.rs")).unwrap());
    assert!(call.matches("unsafe {").count() > 20);
}
