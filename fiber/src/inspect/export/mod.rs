//! Exports: a [`Snapshot`] in the formats the tools people already use read.
//!
//! | [`Format`] | what | read by |
//! |---|---|---|
//! | `text` | Go's `debug=2` shape, every fiber ([`super::dump::snapshot_text`]) | a person |
//! | `grouped` | Go's `debug=1` shape ([`super::dump::snapshot_grouped`]) | a person |
//! | `json` | the snapshot itself, versioned (`docs/snapshot-schema.md`) | programs |
//! | `pprof` | gzipped `profile.proto`, one sample per fiber, labelled | `go tool pprof`, Parca, Pyroscope |
//! | `folded` | `scheduler;fiber:NAME;root;...;leaf COUNT` lines | `inferno-flamegraph`, `flamegraph.pl` |
//! | `svg` | a flame graph of the folded stacks (the `inferno` crate) | a browser |
//! | `speedscope` | speedscope's file format, one profile per scheduler | speedscope |
//!
//! Every export but `json` shows what the text reports show: the glue frames of the runtime
//! and of a host left out (see [`super::glue`], and [`super::glue::set_native_detail`] to keep
//! them), a layer's frames (Lua) in their place in the stack. `json` keeps every frame.
//!
//! The stack views (`pprof`, `folded`, `svg`, `speedscope`) show each fiber's own stack;
//! its creators are in the text views, and in `pprof` its parent is a label. A frame that
//! did not resolve is named by its image and offset (`libfoo.so+0x1234`), or its address.
//!
//! How an export can be wrong: as its snapshot (see [`super`]); a Lua frame's file and line
//! are read back from its label (`name in @file:line`), so a chunk name that itself holds
//! ` in ` and `:` can split at the wrong place.

mod folded;
mod pprof;
mod speedscope;

use std::io::{self, Write};
use std::os::unix::fs::FileTypeExt as _;
use std::path::Path;
use std::sync::Arc;

use fibertrace_core::symbolize::{self, ImageRef, Resolved, Symbol};
use fibertrace_core::Frame;

use super::info::InfoOptions;
use super::{FiberInfo, FrameInfo, Snapshot};

pub use folded::folded;

/// An export format (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Every fiber with its trace, as Go's `debug=2` goroutine dump.
    Text,
    /// Identical fibers folded into groups, as Go's `debug=1`.
    Grouped,
    /// The snapshot as JSON.
    Json,
    /// A gzipped pprof `profile.proto`.
    Pprof,
    /// Folded stacks, one line per distinct stack with its fiber count.
    Folded,
    /// A flame graph of the folded stacks, as SVG.
    Svg,
    /// speedscope's JSON file format.
    Speedscope,
}

impl Format {
    /// Every format, in the order of the module doc.
    pub const ALL: [Format; 7] = [
        Format::Text,
        Format::Grouped,
        Format::Json,
        Format::Pprof,
        Format::Folded,
        Format::Svg,
        Format::Speedscope,
    ];

    /// Its name, as [`Format::parse`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Grouped => "grouped",
            Format::Json => "json",
            Format::Pprof => "pprof",
            Format::Folded => "folded",
            Format::Svg => "svg",
            Format::Speedscope => "speedscope",
        }
    }

    /// The media type an HTTP server gives it.
    pub fn media_type(self) -> &'static str {
        match self {
            Format::Text | Format::Grouped | Format::Folded => "text/plain; charset=utf-8",
            Format::Json | Format::Speedscope => "application/json",
            Format::Pprof => "application/octet-stream",
            Format::Svg => "image/svg+xml",
        }
    }

    /// The format named `name` (`text`, `grouped`, `json`, `pprof`, `folded`, `svg`,
    /// `speedscope`); an unknown name is an error that lists the known ones.
    pub fn parse(name: &str) -> Result<Format, ExportError> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                ExportError(format!(
                    "unknown dump format {}: one of {}",
                    short_quoted(name),
                    Format::ALL.map(Format::name).join(", ")
                ))
            })
    }
}

/// `s` quoted for a message, cut past 64 characters (with its length): an argument of
/// megabytes is not repeated whole.
pub fn short_quoted(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((at, _)) => format!("{:?}... ({} bytes)", &s[..at], s.len()),
    }
}

/// A path for a message, cut past 256 bytes (with its length).
fn short_path(path: &Path) -> String {
    let s = path.display().to_string();
    match s.char_indices().nth(256) {
        None => s,
        Some((at, _)) => format!("{}... ({} bytes)", &s[..at], s.len()),
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an export failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportError(pub String);

impl std::fmt::Display for ExportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ExportError {}

/// The process's heap (see `fibertrace_core::heap`) as a gzipped pprof heap profile with Go's
/// four sample types (`alloc_objects`, `alloc_space`, `inuse_objects`, `inuse_space`), one
/// sample per stack and fiber, labelled by fiber. `name` names a live fiber, `label` a Lua
/// frame, and `frames_of` turns a recorded stack into frames (a host that records Lua
/// frames in stacks decodes them; [`native_frames`] otherwise). An error when no tracker
/// runs.
pub fn heap_pprof(
    name: &dyn Fn(u64) -> Option<String>,
    label: &dyn Fn(fibertrace_core::LuaFrameId) -> Option<String>,
    frames_of: fn(&[u64]) -> Vec<Frame>,
) -> Result<Vec<u8>, ExportError> {
    use fibertrace_core::heap;
    if heap::tier() == heap::Tier::Off {
        return Err(ExportError(NOT_TRACKED.to_string()));
    }
    let mut d = pprof::HeapData {
        rows: std::collections::HashMap::new(),
        names: std::collections::HashMap::new(),
        labels: std::collections::HashMap::new(),
        frames_of,
    };
    for t in heap::totals() {
        let e = d.rows.entry((t.addrs, t.fiber)).or_default();
        e.0[0] += t.objects as i64;
        e.0[1] += t.bytes as i64;
    }
    // Read one at a time: room for the rows only, not for a list of every allocation. Into
    // a map of its own, empty until the walk (a block allocated before it may not be freed
    // inside it, as `d.rows` growing would), merged after.
    type LiveRows = std::collections::HashMap<(Vec<u64>, Option<u64>), (i64, i64, bool)>;
    let mut live = LiveRows::new();
    heap::for_each_live(|a| {
        let k = (a.addrs.to_vec(), a.fiber);
        let e = live.entry(k).or_default();
        e.0 += a.objects;
        e.1 += a.bytes;
        e.2 |= a.exited;
    });
    for (k, (objects, bytes, exited)) in live {
        let e = d.rows.entry(k).or_default();
        e.0[2] += objects;
        e.0[3] += bytes;
        e.1 |= exited;
    }
    for (addrs, fiber) in d.rows.keys() {
        if let Some(f) = fiber {
            if !d.names.contains_key(f) {
                if let Some(n) = name(*f) {
                    d.names.insert(*f, n);
                }
            }
        }
        for fr in frames_of(addrs) {
            if let Frame::Lua(id) = fr {
                if let std::collections::hash_map::Entry::Vacant(v) = d.labels.entry(id) {
                    if let Some(l) = label(id) {
                        v.insert(l);
                    }
                }
            }
        }
    }
    // (At the memory limit, here: see `fibertrace_core::heap::room_for_thread`.)
    if crate::current().is_none() || !fibertrace_core::heap::room_for_thread(8 << 20) {
        return Ok(pprof::heap_profile(&d));
    }
    // On a fiber: the symbolizer and the encoder on a thread of their own (see `to_bytes`).
    Ok(std::thread::scope(|s| {
        match std::thread::Builder::new()
            .name("fibertrace-export".into())
            .stack_size(8 << 20)
            .spawn_scoped(s, || {
                // The report's own work, not the program's (the caller's thread is paused
                // alike): at the memory limit, each of its allocations recorded with its
                // stack took from the emergency reserve the report needs.
                fibertrace_core::heap::untracked(|| pprof::heap_profile(&d))
            }) {
            Ok(h) => h.join().unwrap_or_default(),
            Err(_) => pprof::heap_profile(&d),
        }
    }))
}

/// Why there is no heap view: no tracker runs.
pub const NOT_TRACKED: &str = "the heap is not tracked in this process: install \
fibertrace_core::heap::Tracked as the global allocator (fibertrace run: --heap or --leaks, or \
FIBERTRACE_HEAP=sampled|every)";

/// A recorded stack's return addresses as frames.
pub fn native_frames(addrs: &[u64]) -> Vec<Frame> {
    addrs.iter().map(|&a| Frame::Ra(a)).collect()
}

/// A snapshot in format `fmt`.
///
/// Called on a fiber, the encoding runs on a helper thread: a fiber's stack is small and
/// fixed, and the encoders (gzip's state, the flame graph's layout) can take more of it than
/// a fiber has, in a build without optimizations. (If no thread can be made, or at the memory
/// limit, it runs here.)
pub fn to_bytes(snap: &Snapshot, fmt: Format) -> Vec<u8> {
    // (At the memory limit, here: a thread that cannot map its signal stack aborts the
    // process as it starts; see `fibertrace_core::heap::room_for_thread`.)
    if crate::current().is_none() || !fibertrace_core::heap::room_for_thread(8 << 20) {
        return encode(snap, fmt);
    }
    std::thread::scope(|s| {
        let helper = std::thread::Builder::new()
            .name("fibertrace-export".into())
            .stack_size(8 << 20)
            .spawn_scoped(s, || fibertrace_core::heap::untracked(|| encode(snap, fmt)));
        match helper {
            Ok(h) => h.join().unwrap_or_else(|_| {
                format!("fibertrace: the {fmt} export failed (a panic in its encoder)\n")
                    .into_bytes()
            }),
            Err(_) => encode(snap, fmt),
        }
    })
}

fn encode(snap: &Snapshot, fmt: Format) -> Vec<u8> {
    match fmt {
        Format::Text => super::dump::snapshot_text(snap).into_bytes(),
        Format::Grouped => super::dump::snapshot_grouped(snap).into_bytes(),
        // A snapshot holds no map with non-string keys and no float that is not finite
        // (times are clamped): serialization does not fail; if it ever did, the error is
        // the document.
        Format::Json => serde_json::to_vec_pretty(snap).unwrap_or_else(|e| {
            serde_json::json!({ "error": e.to_string() })
                .to_string()
                .into_bytes()
        }),
        Format::Pprof => pprof::profile(snap),
        Format::Folded => folded(snap).into_bytes(),
        Format::Svg => folded::svg(snap),
        Format::Speedscope => speedscope::file(snap),
    }
}

/// The whole process's fibers, now, in format `fmt`.
#[inline(never)]
pub fn export(fmt: Format) -> Vec<u8> {
    report_entry!();
    to_bytes(&super::snapshot(&InfoOptions::default()), fmt)
}

/// Writes the whole process's fibers, now, in format `fmt` to the file at `path`: written
/// beside it and renamed over it once complete, so a reader never sees half a file and a
/// failed write leaves what was there.
#[inline(never)]
pub fn export_to_file(fmt: Format, path: &Path) -> Result<usize, ExportError> {
    report_entry!();
    let bytes = to_bytes(&super::snapshot(&InfoOptions::default()), fmt);
    write_file(path, &bytes)?;
    Ok(bytes.len())
}

/// Writes `bytes` to `path`. A regular file (or none yet) is written through a temporary
/// file in the same directory, renamed over it once written and synced: a reader never sees
/// half a file and a failed write leaves what was there. A symbolic link to a regular file
/// keeps being a link: its target is written so. What is not a regular file — a terminal, a
/// FIFO, a device like `/dev/null` or `/dev/full` — and the process's own streams
/// (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, anything under `/proc`), whatever they are, are
/// written into, appended, as a shell's `>>` would: never replaced by a file. The process's
/// own descriptors (`/dev/stdout`, `/dev/stderr`, `/dev/fd/N`, `/proc/self/fd/N`) are written
/// through the descriptor itself: opened again by name, a file (`> out.log`) got a file
/// offset of its own, and what the program wrote after the dump wrote over it. A FIFO
/// without a reader is an error, not a wait; so is one whose reader takes nothing for 10 s.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ExportError> {
    let fail = |what: &str, e: io::Error| ExportError(format!("{}: {what}: {e}", short_path(path)));
    if path.file_name().is_none() {
        return Err(ExportError(format!(
            "{}: not a file name",
            short_path(path)
        )));
    }
    if let Some(fd) = own_descriptor(path) {
        return write_descriptor(fd, bytes).map_err(|e| fail("cannot write", e));
    }
    if kernel_setting(path) {
        return Err(fail("cannot write", kernel_setting_error()));
    }
    let special = own_stream(path);
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(fail("cannot write", io::Error::other("is a directory"))),
        Ok(m) if special || !m.is_file() => {
            write_into(path, bytes, m.file_type()).map_err(|e| fail("cannot write", e))
        }
        // A regular file, maybe through links: the file itself is replaced.
        Ok(_) => {
            let target = std::fs::canonicalize(path).map_err(|e| fail("cannot write", e))?;
            replace_file(&target, bytes).map_err(|e| fail("cannot write", e))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(fail(
                    "cannot write",
                    io::Error::other("a symbolic link to nothing"),
                ));
            }
            replace_file(path, bytes).map_err(|e| fail("cannot write", e))
        }
        Err(e) => Err(fail("cannot write", e)),
    }
}

/// Whether `path` names one of the process's own streams, whatever they are (a file
/// `2> err.txt` is appended to, not replaced).
fn own_stream(path: &Path) -> bool {
    path.starts_with("/proc")
        || path.starts_with("/dev/fd")
        || ["/dev/stdout", "/dev/stderr"]
            .iter()
            .any(|s| path == Path::new(s))
}

/// Whether `path` is (or leads to) a kernel setting under `/proc/sys`: the process's streams
/// under `/proc` are appended to, and a dump given `/proc/sys/kernel/hostname` (by root)
/// replaced the machine's name with its first bytes.
fn kernel_setting(path: &Path) -> bool {
    let sys = |p: &Path| p.starts_with("/proc/sys");
    sys(path) || std::fs::canonicalize(path).is_ok_and(|p| sys(&p))
}

fn kernel_setting_error() -> io::Error {
    io::Error::other("a kernel setting (/proc/sys), not a file for a dump")
}

/// The descriptor of this process that `path` names (`/dev/stdout`, `/dev/stderr`,
/// `/dev/stdin`, `/dev/fd/N`, `/proc/self/fd/N`, `/proc/thread-self/fd/N`,
/// `/proc/PID/fd/N` with this process's id), if it is open.
fn own_descriptor(path: &Path) -> Option<libc::c_int> {
    let s = path.to_str()?;
    let fd = match s {
        "/dev/stdin" => 0,
        "/dev/stdout" => 1,
        "/dev/stderr" => 2,
        _ => {
            let me = format!("/proc/{}/fd/", std::process::id());
            let n = [
                "/dev/fd/",
                "/proc/self/fd/",
                "/proc/thread-self/fd/",
                me.as_str(),
            ]
            .iter()
            .find_map(|p| s.strip_prefix(p))?;
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            n.parse().ok()?
        }
    };
    // SAFETY: F_GETFD reads a descriptor's flags; it fails (EBADF) on one not open.
    (unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0).then_some(fd)
}

/// Writes all of `bytes` to this process's open descriptor `fd` (left open).
fn write_descriptor(fd: libc::c_int, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: write(2) from a live buffer to a descriptor checked open by the caller.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Writes `bytes` into what is at `path` (not a regular file, or a process's stream),
/// appended: opened without creating or truncating it. A FIFO is opened without
/// waiting for a reader (none: the error `ENXIO`), then written to as any file.
fn write_into(path: &Path, bytes: &[u8], kind: std::fs::FileType) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let fifo = kind.is_fifo();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(if fifo { libc::O_NONBLOCK } else { 0 })
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) if fifo => io::Error::other("a FIFO with no reader"),
            _ => e,
        })?;
    if fifo {
        return write_fifo(&mut f, bytes);
    }
    f.write_all(bytes)?;
    f.flush()
}

/// How long a FIFO's reader may take nothing before a write into it gives up.
const FIFO_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Writes `bytes` into the FIFO `f` (opened non-blocking, its reader there), waiting for
/// the reader to take them, but not for one that takes nothing for [`FIFO_IDLE`]: an error
/// then (a reader that never read held a program's normal exit up forever).
fn write_fifo(f: &mut std::fs::File, mut bytes: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    while !bytes.is_empty() {
        match f.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: `p` is one live pollfd for a descriptor `f` keeps open.
                let r = unsafe { libc::poll(&mut p, 1, FIFO_IDLE.as_millis() as libc::c_int) };
                if r == 0 {
                    return Err(io::Error::other(format!(
                        "the FIFO's reader took nothing for {} s",
                        FIFO_IDLE.as_secs()
                    )));
                }
                if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                    return Err(io::Error::last_os_error());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `bytes` to the regular file (or no file) at `path` through a temporary file
/// beside it, renamed over it once written and synced.
fn replace_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temporary_file(path).ok_or_else(|| io::Error::other("not a file name"))?;
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The temporary file [`write_file`] writes a regular file `path` through, beside it:
/// `.NAME.PID.tmp` (for a program that ends while one is written, to remove it). A name too
/// long for that (a file name has at most 255 bytes: a name of 244 bytes could never be
/// written) is cut, with a hash of the whole name after it: `.PREFIX.HASH.PID.tmp`. `None`
/// when `path` has no file name.
pub fn temporary_file(path: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    const NAME_MAX: usize = 255;
    let given = path.file_name()?.as_bytes();
    let tail = format!(".{}.tmp", std::process::id());
    let mut name = b".".to_vec();
    if 1 + given.len() + tail.len() <= NAME_MAX {
        name.extend_from_slice(given);
    } else {
        // FNV-1a of the whole name: two long names with one prefix get two files.
        let hash = given.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        let hash = format!(".{hash:016x}");
        name.extend_from_slice(&given[..NAME_MAX - 1 - hash.len() - tail.len()]);
        name.extend_from_slice(hash.as_bytes());
    }
    name.extend_from_slice(tail.as_bytes());
    Some(path.with_file_name(std::ffi::OsString::from_vec(name)))
}

/// Whether [`write_file`] could write `path` now, found without writing it (for a dump
/// asked for at a program's exit: a mistake shows before the program runs). What it would
/// do is tried as far as it can be undone: a regular file (or none yet) by making and
/// removing its temporary file beside it — a directory that cannot be written, a name too
/// long, a read-only file system —, and the file itself if it is immutable (it could not be
/// replaced); a link to nothing, a loop of links and a directory are refused as the write
/// would refuse them; what is not a regular file is opened for appending, and closed. What
/// may change by then is found only then: room on the disk, a FIFO's reader (a FIFO is not
/// opened now: without a reader that fails, and one may come), a file made immutable or a
/// directory taken away meanwhile.
pub fn check_writable(path: &Path) -> Result<(), ExportError> {
    use std::os::unix::ffi::OsStrExt;
    let fail = |e: io::Error| ExportError(format!("{}: cannot write: {e}", short_path(path)));
    if path.file_name().is_none() {
        return Err(ExportError(format!(
            "{}: not a file name",
            short_path(path)
        )));
    }
    if own_descriptor(path).is_some() {
        return Ok(());
    }
    if kernel_setting(path) {
        return Err(fail(kernel_setting_error()));
    }
    let try_temporary = |p: &Path| -> io::Result<()> {
        let tmp = temporary_file(p).ok_or_else(|| io::Error::other("not a file name"))?;
        std::fs::File::create(&tmp)?;
        std::fs::remove_file(&tmp)
    };
    let special = own_stream(path);
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(fail(io::Error::other("is a directory"))),
        Ok(m) if m.file_type().is_fifo() => Ok(()),
        Ok(m) if special || !m.is_file() => std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map(drop)
            .map_err(fail),
        Ok(_) => {
            let target = std::fs::canonicalize(path).map_err(fail)?;
            let c = std::ffi::CString::new(target.as_os_str().as_bytes())
                .map_err(|_| fail(io::Error::other("a NUL byte in the name")))?;
            // SAFETY: access(2) of a NUL-terminated path that lives across the call. Only
            // EPERM is taken as a refusal: the kernel's answer for an immutable file (a
            // file that is only read-only, EACCES, is replaced by the rename all the same).
            let denied = unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
            if denied {
                return Err(fail(io::Error::other(
                    "the file cannot be replaced (it is immutable)",
                )));
            }
            try_temporary(&target).map_err(fail)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(fail(io::Error::other("a symbolic link to nothing")));
            }
            // (`new/` names a directory to be: the write's rename onto it fails so.)
            if path.as_os_str().as_bytes().ends_with(b"/") {
                return Err(fail(io::Error::from_raw_os_error(libc::ENOTDIR)));
            }
            try_temporary(path).map_err(fail)
        }
        Err(e) => Err(fail(e)),
    }
}

/// One function level of an exported frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Level {
    /// The function's name.
    pub name: String,
    /// Its source file, when known.
    pub file: Option<String>,
    /// The line, 0 when unknown.
    pub line: u32,
}

/// What kind of frame an exported frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Native code.
    Native,
    /// A frame of a layer above (Lua).
    Layer,
    /// A marker: frames left out, a trace cut short.
    Marker,
}

/// One frame of a fiber's stack as the exports see it.
#[derive(Clone, Debug)]
pub(crate) struct ExFrame {
    /// The address looked up (a return address less one); 0 for a layer's frame or a marker.
    pub address: u64,
    /// The native frame's image, when known.
    pub image: Option<ImageRef>,
    /// Function levels, innermost (most inlined) first; never empty.
    pub levels: Vec<Level>,
    pub kind: Kind,
}

/// A fiber's own stack for the exports, innermost frame first: glue left out as the text
/// reports leave it out, a layer's frames read from their labels.
pub(crate) fn stack(fi: &FiberInfo) -> Vec<ExFrame> {
    let hide = super::glue::filter();
    let Some(frames) = &fi.backtrace else {
        return Vec::new();
    };
    frames.iter().filter_map(|f| ex_frame(f, hide)).collect()
}

fn ex_frame(f: &FrameInfo, hide: Option<&dyn Fn(&Symbol) -> bool>) -> Option<ExFrame> {
    let marker = |name: String| ExFrame {
        address: 0,
        image: None,
        levels: vec![Level {
            name,
            file: None,
            line: 0,
        }],
        kind: Kind::Marker,
    };
    match f.frame {
        Frame::Pc(_) | Frame::Ra(_) | Frame::Async(_) => {
            let resolved: Option<Arc<Resolved>> =
                f.resolved.clone().or_else(|| symbolize::resolve(&f.frame));
            let address = match f.frame {
                Frame::Pc(a) => a,
                Frame::Ra(a) | Frame::Async(a) => a.saturating_sub(1),
                _ => 0,
            };
            let r = resolved.as_deref();
            let all = r.map(|r| r.symbols.as_slice()).unwrap_or_default();
            let kept: Vec<&Symbol> = all.iter().filter(|s| !hide.is_some_and(|h| h(s))).collect();
            if !all.is_empty() && kept.is_empty() {
                return None;
            }
            let mut levels: Vec<Level> = kept
                .iter()
                .map(|s| Level {
                    name: s.name.clone().unwrap_or_else(|| unnamed(address, r)),
                    file: s.file.clone(),
                    line: s.line.unwrap_or(0),
                })
                .collect();
            if levels.is_empty() {
                levels.push(Level {
                    name: unnamed(address, r),
                    file: None,
                    line: 0,
                });
            }
            Some(ExFrame {
                address,
                image: r.and_then(|r| r.image.clone()),
                levels,
                kind: Kind::Native,
            })
        }
        Frame::Lua(id) => {
            let label = f
                .label
                .as_deref()
                .map(str::to_string)
                .unwrap_or_else(|| format!("[lua frame {}]", id.0));
            Some(ExFrame {
                address: 0,
                image: None,
                levels: vec![layer_level(&label)],
                kind: Kind::Layer,
            })
        }
        Frame::Omitted(n) => Some(marker(format!("[{n} frames omitted]"))),
        Frame::Truncated => Some(marker("[truncated]".to_string())),
        // Parent markers do not occur in a fiber's own frames; nothing to show.
        Frame::Parent(_) => None,
    }
}

/// The name of a native frame without a symbol: `image+0xOFFSET`, or its address.
fn unnamed(address: u64, r: Option<&Resolved>) -> String {
    match r.and_then(|r| r.image.as_ref()) {
        Some(img) => {
            let file = img.path.rsplit('/').next().unwrap_or(&img.path);
            format!("{file}+{:#x}", address.wrapping_sub(img.base))
        }
        None => format!("{address:#x}"),
    }
}

/// A layer's frame from its label `name in source:line` (Lua's `@file` and `=name` chunk
/// prefixes dropped; a C function's line `-1` read as unknown). A label of another shape is
/// the name as it is.
pub(crate) fn layer_level(label: &str) -> Level {
    let whole = || Level {
        name: label.to_string(),
        file: None,
        line: 0,
    };
    let Some((name, place)) = label.rsplit_once(" in ") else {
        return whole();
    };
    let Some((source, line)) = place.rsplit_once(':') else {
        return whole();
    };
    let Ok(line) = line.parse::<i64>() else {
        return whole();
    };
    let source = source
        .strip_prefix('@')
        .or_else(|| source.strip_prefix('='))
        .unwrap_or(source);
    Level {
        name: name.to_string(),
        file: Some(source.to_string()),
        line: u32::try_from(line).unwrap_or(0),
    }
}

/// The state of a fiber for a label: what it waits on (`channel receive`, `join fiber 3`),
/// or its status (`running`, `ready`, ...).
pub(crate) fn state(fi: &FiberInfo) -> String {
    match &fi.waiting {
        Some(w) => w.what.to_string(),
        None => format!("{:?}", fi.status).to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layers_label_gives_its_name_file_and_line() {
        assert_eq!(
            layer_level("wait_here in @s.lua:4"),
            Level {
                name: "wait_here".into(),
                file: Some("s.lua".into()),
                line: 4
            }
        );
        assert_eq!(
            layer_level("get in =[C]:-1"),
            Level {
                name: "get".into(),
                file: Some("[C]".into()),
                line: 0
            }
        );
        assert_eq!(
            layer_level("function <a in b.lua:5> in @b.lua:7"),
            Level {
                name: "function <a in b.lua:5>".into(),
                file: Some("b.lua".into()),
                line: 7
            }
        );
        for odd in ["", "no place", "x in nowhere", "x in f:notanumber"] {
            assert_eq!(layer_level(odd).name, odd);
            assert_eq!(layer_level(odd).file, None);
        }
    }

    #[test]
    fn formats_parse_by_name_and_refuse_others_with_the_list() {
        for f in Format::ALL {
            assert_eq!(Format::parse(f.name()), Ok(f));
        }
        let e = Format::parse("PPROF").unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown dump format \"PPROF\": one of text, grouped, json, pprof, folded, svg, \
             speedscope"
        );
        assert!(Format::parse("").is_err());
    }
}
