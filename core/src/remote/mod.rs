//! Another process's stacks, read from the outside without running its code: every thread
//! of a live process, with symbols, file:line and inline frames from the target's own
//! binaries ([`dump`]).
//!
//! The pipeline is this crate's, over another process: its images are read from
//! `/proc/PID/maps` and the files it mapped (through `/proc/PID/root`, so a container's files
//! are its own); its memory through `process_vm_readv` (a direct-mapped cache of 1 KiB lines
//! in front, bounded, filled many lines per system call where the reader knows ahead what it
//! will read: [`Session::prefetch`]); each
//! thread is walked by framehop over that memory (DWARF call-frame information where the
//! code has it, frame pointers elsewhere), and each frame symbolized from the target's file
//! ([`crate::symbolize::ElfSymbols`]), the vDSO from its own memory.
//!
//! Two modes ([`Mode`]): *consistent* stops every thread with `ptrace` for the time of the
//! walk (see the leaf's doc for how it always lets them go); *non-blocking* stops nothing —
//! a thread blocked in a system call is walked from where the kernel shows it waits (its
//! stack pointer and program counter), a running thread cannot be walked, and the frames of
//! a thread that moves meanwhile can be torn: every thread read this way is marked not exact.
//!
//! How a result can be wrong: a file replaced on disk since the target mapped it would give
//! wrong names — its build id is checked against the one in the target's memory, and a
//! mismatch leaves the image's frames unnamed; code without call-frame information whose
//! callers keep no frame pointer ends the walk early (the walk then stops where framehop
//! finds no rule, and says so).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use framehop::{ExplicitModuleSectionInfo, FrameAddress, MayAllocateDuringUnwind, Unwinder as _};
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};
use serde::{Deserialize, Serialize};

use crate::arch::{unwind_regs, DwarfUnwinder, Registers, UnwindCache};
use crate::format::ResolvedFrame;
use crate::frame::Frame;
use crate::symbolize::{ElfSymbols, ImageRef, Resolved, Symbol};

mod cfa;
#[cfg(target_os = "linux")]
mod corefile;
#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
use linux as platform;

/// How a dump reads the threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Stop every thread (`ptrace`) while reading; let them all go after.
    #[default]
    Consistent,
    /// Stop nothing: threads blocked in a system call are read where they wait; running
    /// threads are not read; nothing read is exact.
    NonBlocking,
}

/// Options of a dump.
#[derive(Clone, Copy, Debug)]
pub struct DumpOptions {
    /// See [`Mode`].
    pub mode: Mode,
    /// Frames walked at most per thread.
    pub max_frames: usize,
    /// The size of the cache of the target's memory (bytes, in 1 KiB lines): what this
    /// process keeps of the target's memory at most (a line read replaces the one in its
    /// slot). It bounds memory, not what is read.
    pub max_memory: usize,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            mode: Mode::Consistent,
            max_frames: 256,
            max_memory: 8 << 20,
        }
    }
}

/// One thread of a dumped process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ThreadDump {
    /// Its kernel id.
    pub tid: i32,
    /// Its name (`comm`).
    pub name: String,
    /// Its frames, innermost first, resolved.
    pub frames: Vec<ResolvedFrame>,
    /// Whether the frames are of one moment (the thread was stopped).
    pub exact: bool,
    /// What the frames could not show, and why.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub note: Option<String>,
}

/// Every thread of a process, read from the outside.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProcessDump {
    /// The process id.
    pub pid: i32,
    /// Its executable, as the process's own mount namespace names it.
    pub exe: String,
    /// How it was read.
    pub mode: Mode,
    /// How long its threads were stopped (consistent mode), microseconds.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub paused_us: Option<u64>,
    /// The core file it was read from (not a live process).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub core: Option<String>,
    /// Its threads, by id.
    pub threads: Vec<ThreadDump>,
    /// Images whose frames are unnamed, and why (their file could not be read, or is not
    /// the one mapped).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub unnamed: Vec<String>,
    /// Images some frames fall in whose debug information (DWARF) could not be read, and why
    /// (a section it cannot decompress, a file replaced since it was opened): their frames
    /// are named from the symbol table alone, without file, line or inlined calls.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub without_lines: Vec<String>,
    /// The process ended while it was read (killed, or it exited while not held): frames
    /// and fibers read after that are missing or wrong, and the dump is incomplete.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub ended: bool,
    /// What makes the dump incomplete besides (a core file cut short).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub warnings: Vec<String>,
}

/// Why a dump could not be made.
#[derive(Debug)]
pub enum DumpError {
    /// No process with that id.
    NoSuchProcess(i32),
    /// This process itself (use the in-process dumps).
    Myself,
    /// Not allowed to read it.
    Permission {
        /// The process.
        pid: i32,
        /// What to do about it.
        advice: String,
    },
    /// A program of another architecture.
    Architecture {
        /// The process.
        pid: i32,
        /// What it is.
        found: String,
    },
    /// It exited while being read.
    Exited(i32),
    /// It has exited, and its parent has not waited for it yet (a zombie): no threads left.
    Zombie(i32),
    /// A kernel thread: no user-space program to read.
    KernelThread(i32),
    /// Anything else, said.
    Other(String),
}

impl std::fmt::Display for DumpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DumpError::NoSuchProcess(pid) => write!(f, "no such process: {pid}"),
            DumpError::Myself => write!(
                f,
                "that is this process itself: use its own dumps (SIGQUIT, the dump API)"
            ),
            DumpError::Permission { pid, advice } => {
                write!(f, "not allowed to read process {pid}: {advice}")
            }
            DumpError::Architecture { pid, found } => write!(
                f,
                "process {pid} is {found}; this fibertrace reads {} processes",
                crate::arch::ELF_MACHINE.1
            ),
            DumpError::Exited(pid) => write!(f, "process {pid} exited during the dump"),
            DumpError::Zombie(pid) => write!(
                f,
                "process {pid} has exited (a zombie its parent has not waited for): nothing left \
                 to read"
            ),
            DumpError::KernelThread(pid) => write!(
                f,
                "process {pid} is a kernel thread: it has no user-space stacks to read"
            ),
            DumpError::Other(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for DumpError {}

/// Linux's capabilities by number (`capability.h`).
const CAP_NAMES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// How long a dump waits for another one that holds the process (see [`held_by_a_dump`]).
const DUMP_TURN: Duration = Duration::from_secs(10);

/// Whether process `pid` is traced by a dump of this program's (the same executable) in
/// another process: it lets go once done. (A tracer in this very process is not waited for:
/// it cannot let go while this thread waits for it.)
fn held_by_a_dump(pid: i32) -> bool {
    let Some(t) = platform::tracer(pid) else {
        return false;
    };
    if in_this_process(t) {
        return false;
    }
    let (Ok(theirs), Ok(ours)) = (
        std::fs::read_link(format!("/proc/{t}/exe")),
        std::env::current_exe(),
    ) else {
        return false;
    };
    theirs == ours
}

/// Whether thread `tid` is one of this process's.
fn in_this_process(tid: i32) -> bool {
    std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
}

fn permission(pid: i32) -> DumpError {
    if let Some(t) = platform::tracer(pid) {
        let name = std::fs::read_to_string(format!("/proc/{t}/comm")).unwrap_or_default();
        return DumpError::Permission {
            pid,
            advice: format!(
                "it is already traced by process {t} ({}): a process has one tracer at a \
                 time — detach it (or use --non-blocking, which stops nothing)",
                name.trim()
            ),
        };
    }
    // Refused though this process may trace any other: the reason is the target's.
    const CAP_SYS_PTRACE: u64 = 1 << 19;
    let me = std::process::id() as i32;
    let mine = platform::capabilities(me, "CapEff").unwrap_or(0);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 && mine & CAP_SYS_PTRACE != 0 {
        let extra = platform::capabilities(pid, "CapPrm").map_or(0, |c| c & !mine);
        let advice = if extra != 0 {
            let names: Vec<String> = (0..64)
                .filter(|b| extra & (1u64 << b) != 0)
                .map(|b| match CAP_NAMES.get(b) {
                    Some(n) => format!("CAP_{n}"),
                    None => format!("capability {b}"),
                })
                .collect();
            format!(
                "it holds capabilities that fibertrace lacks ({}: CapPrm in /proc/{pid}/status, \
                 CapEff in fibertrace's): run fibertrace with them too",
                names.join(", ")
            )
        } else {
            "fibertrace runs as root with CAP_SYS_PTRACE and was still refused: the process \
             is not dumpable (prctl PR_SET_DUMPABLE, a setuid program), or a security module \
             (AppArmor, SELinux, a seccomp filter) forbids tracing it"
                .to_string()
        };
        return DumpError::Permission { pid, advice };
    }
    let scope =
        match platform::ptrace_scope() {
            Some(0) => " (kernel.yama.ptrace_scope is 0: a process of the same user may be read)"
                .to_string(),
            Some(1) => " (kernel.yama.ptrace_scope is 1: only a process's ancestors may read it — \
                    run fibertrace as root or with CAP_SYS_PTRACE, or start the target under it)"
                .to_string(),
            Some(2) => " (kernel.yama.ptrace_scope is 2: only root or CAP_SYS_PTRACE may read \
                    another process)"
                .to_string(),
            Some(3) => " (kernel.yama.ptrace_scope is 3: no process may read another until reboot)"
                .to_string(),
            Some(n) => format!(" (kernel.yama.ptrace_scope is {n})"),
            None => String::new(),
        };
    DumpError::Permission {
        pid,
        advice: format!("run fibertrace as the process's user or as root (CAP_SYS_PTRACE){scope}"),
    }
}

/// Reads every thread of process `pid` (see the module doc).
pub fn dump(pid: i32, opts: &DumpOptions) -> Result<ProcessDump, DumpError> {
    let mut s = Session::open(pid, opts)?;
    let raw = s.threads();
    s.resume();
    Ok(s.finish(raw))
}

/// Reads every thread of the process a core file holds (see [`Session::open_core`]).
pub fn dump_core(
    core: &std::path::Path,
    exe: Option<&std::path::Path>,
    root: Option<&std::path::Path>,
    opts: &DumpOptions,
) -> Result<ProcessDump, DumpError> {
    let mut s = Session::open_core(core, exe, root, opts)?;
    let raw = s.threads();
    Ok(s.finish(raw))
}

/// A thread's frames as walked, before they are named.
pub struct RawThread {
    /// Its kernel id.
    pub tid: i32,
    /// Its frames, innermost first.
    pub frames: Vec<Frame>,
    /// What the walk could not show, and why.
    pub note: Option<String>,
}

/// An open reading of another process: its images and memory, and (in the consistent mode)
/// every thread stopped until [`Session::resume`] (or the session's drop) lets them go. What
/// a layer above reads of the target (a fiber registry) it reads through this, while the
/// threads are stopped, and names after.
pub struct Session {
    pid: i32,
    exe: String,
    opts: DumpOptions,
    mem: Memory,
    images: Images,
    stopped: Option<platform::Stopped>,
    stopped_at: Option<Instant>,
    paused: Option<Duration>,
    /// The live process was found ended (gone, or a zombie) when its reading finished (see
    /// [`Session::resume`]): what was read after it ended is missing or wrong.
    ended: Option<bool>,
    /// Read from a core file: its path and contents.
    core: Option<(String, Arc<corefile::Core>)>,
    /// The unwinder's rule cache, shared by every walk of the session.
    cache: UnwindCache<MayAllocateDuringUnwind>,
}

impl Session {
    /// Opens process `pid`: checks it can be read, reads its images, and (consistent mode)
    /// stops every thread.
    pub fn open(pid: i32, opts: &DumpOptions) -> Result<Session, DumpError> {
        // A process in the middle of an exec refuses for a moment what it allows before and
        // after (its files under /proc, a seize of the thread that execs), its main thread
        // is a zombie while another thread takes its place, and it may be missing from
        // /proc while the exec moves the program to the main thread's id: a refusal, or an
        // exit, of a process still there 10 ms later (and not a zombie alone) is tried again,
        // up to 10 times; a process changing all along is said to be.
        let mut tries = 0;
        // One turn's wait for every try: a dump that still holds the process when it ends
        // is said to, not waited for again by the next try.
        let turn_until = Instant::now() + DUMP_TURN;
        loop {
            let r = Self::open_once(pid, opts, turn_until);
            // (A refusal because another process's tracer holds it is no exec's: said at
            // once, after the one wait for a dump's turn `open_once` made — unless that
            // tracer is another dump, which took its turn between the refusal and the look
            // at who held it: with several dumps at once, one was refused so. A tracer in
            // this process is this reader's last stop, still ending while the process
            // execs.)
            let changing = match &r {
                Err(DumpError::Permission { .. }) => {
                    platform::tracer(pid).is_none_or(in_this_process)
                        || (held_by_a_dump(pid) && Instant::now() < turn_until)
                }
                Err(DumpError::Zombie(_) | DumpError::Exited(_)) => true,
                _ => false,
            };
            if !changing {
                return r;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            if !platform::exists(pid) || lone_zombie(pid) {
                return r;
            }
            if tries == 10 {
                // Still there: not gone, but changing under the reading all along.
                return match r {
                    Err(DumpError::Zombie(_) | DumpError::Exited(_)) => {
                        Err(DumpError::Other(format!(
                            "process {pid} kept replacing its program (exec) or losing threads \
                             while it was read: try again"
                        )))
                    }
                    r => r,
                };
            }
            tries += 1;
        }
    }

    /// One try of [`Session::open`]; a dump holding the process is waited for until
    /// `turn_until`.
    fn open_once(pid: i32, opts: &DumpOptions, turn_until: Instant) -> Result<Session, DumpError> {
        if pid <= 0 {
            return Err(DumpError::NoSuchProcess(pid));
        }
        if pid == std::process::id() as i32 {
            return Err(DumpError::Myself);
        }
        if !platform::exists(pid) {
            return Err(DumpError::NoSuchProcess(pid));
        }
        match platform::kind(pid) {
            Some((_, true)) => return Err(DumpError::KernelThread(pid)),
            // (A main thread that ended while others run is a zombie too: their process is
            // read.)
            Some(('Z', _)) if lone_zombie(pid) => return Err(DumpError::Zombie(pid)),
            _ => {}
        }
        let exe = platform::exe(pid).map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => permission(pid),
            std::io::ErrorKind::NotFound => DumpError::Exited(pid),
            _ => DumpError::Other(format!("cannot read process {pid}'s executable: {e}")),
        })?;
        check_architecture(pid)?;
        let mut mem = Memory::new(Source::Live(platform::MemReader::new(pid)), opts.max_memory);
        // The images are read before the threads are stopped (it takes the longest), and
        // again if the map changed by the time they are (a library came or went).
        let maps = read_maps(pid)?;
        let files = live_files(pid);
        let mut images = Images::read(&maps, &files, &mut mem)?;
        let mut stopped = None;
        let mut stopped_at = None;
        if opts.mode == Mode::Consistent {
            // Held by another dump (two taken at once): its turn first, then ours (a process
            // has one tracer at a time; the second failed).
            // (A dump seen holding it that is gone at the next look let go just now: tried
            // again at once.)
            let mut waited = false;
            let all = loop {
                stopped_at = Some(Instant::now());
                match platform::Stopped::all(pid) {
                    Err(platform::StopError::Permission)
                        if Instant::now() < turn_until
                            && (held_by_a_dump(pid)
                                || (waited && platform::tracer(pid).is_none())) =>
                    {
                        waited = true;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    r => break r,
                }
            };
            stopped = Some(all.map_err(|e| match e {
                platform::StopError::Permission => permission(pid),
                platform::StopError::Gone => DumpError::Exited(pid),
                platform::StopError::Other(e) => {
                    DumpError::Other(format!("cannot stop process {pid}: {e}"))
                }
            })?);
            let now = read_maps(pid)?;
            if now != maps {
                mem.forget();
                images = Images::read(&now, &files, &mut mem)?;
            }
        }
        Ok(Session {
            pid,
            exe: exe.display().to_string(),
            opts: *opts,
            mem,
            images,
            stopped,
            stopped_at,
            paused: None,
            ended: None,
            core: None,
            cache: UnwindCache::new_in(),
        })
    }

    /// Opens a core file as the process it was: its threads' registers, its map and its
    /// memory (what the core holds, the mapped files for what it left out). `exe` stands for
    /// the executable the core names (moved since, or read on another machine), `root` is
    /// prefixed to the other files' paths (a copy of the machine's files).
    pub fn open_core(
        core: &std::path::Path,
        exe: Option<&std::path::Path>,
        root: Option<&std::path::Path>,
        opts: &DumpOptions,
    ) -> Result<Session, DumpError> {
        let c = Arc::new(corefile::Core::open(core, exe, root).map_err(DumpError::Other)?);
        let mut mem = Memory::new(Source::Core(c.clone()), opts.max_memory);
        let cc = c.clone();
        let files = move |m: &platform::Mapping| cc.file_for(&m.path);
        let images = Images::read(&c.maps, &files, &mut mem)?;
        let pid = c.threads[0].tid;
        // The program as the core names it (a file given for it, `exe`, is named where its
        // frames are unnamed, if it is not the one mapped).
        let exe_name = c
            .maps
            .first()
            .map(|m| m.path.clone())
            .or_else(|| exe.map(|e| e.display().to_string()))
            .unwrap_or_default();
        Ok(Session {
            pid,
            exe: exe_name,
            opts: DumpOptions {
                mode: Mode::Consistent,
                ..*opts
            },
            mem,
            images,
            stopped: None,
            stopped_at: None,
            paused: None,
            ended: Some(false),
            core: Some((core.display().to_string(), c)),
            cache: UnwindCache::new_in(),
        })
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// How it is read.
    pub fn mode(&self) -> Mode {
        self.opts.mode
    }

    /// Whether its threads are stopped now.
    pub fn is_stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// Walks every thread (stopped ones from their registers; in the non-blocking mode, the
    /// ones waiting in the kernel from where they wait).
    pub fn threads(&mut self) -> Vec<RawThread> {
        let max = self.opts.max_frames;
        let mut out = Vec::new();
        if let Some((_, c)) = &self.core {
            for t in &c.threads {
                let (frames, note) = walk(
                    &self.images,
                    &mut self.mem,
                    &mut self.cache,
                    t.regs,
                    None,
                    max,
                );
                out.push(RawThread {
                    tid: t.tid,
                    frames,
                    note,
                });
            }
            return out;
        }
        match &self.stopped {
            Some(st) => {
                for tid in st.threads() {
                    let (frames, note) = match platform::registers(tid) {
                        Ok(regs) => walk(
                            &self.images,
                            &mut self.mem,
                            &mut self.cache,
                            regs,
                            None,
                            max,
                        ),
                        Err(e) => (Vec::new(), Some(format!("registers not read: {e}"))),
                    };
                    out.push(RawThread { tid, frames, note });
                }
            }
            None => {
                for tid in platform::threads(self.pid).unwrap_or_default() {
                    let (frames, note) = match platform::syscall_registers(self.pid, tid) {
                        Some(regs) => {
                            let (f, n) = walk(
                                &self.images,
                                &mut self.mem,
                                &mut self.cache,
                                regs,
                                None,
                                max,
                            );
                            let n = n.map(|n| format!("{n}; ")).unwrap_or_default();
                            (
                                f,
                                Some(format!(
                                    "{n}read without stopping it, from where it waits in the \
                                     kernel: frames may be torn if it moved meanwhile"
                                )),
                            )
                        }
                        None => (
                            Vec::new(),
                            Some(
                                "running: its stack is not read without stopping it (the \
                                 consistent mode does)"
                                    .to_string(),
                            ),
                        ),
                    };
                    out.push(RawThread { tid, frames, note });
                }
            }
        }
        out
    }

    /// Reads the target's memory at `addr` into `out`; false if some of it is not mapped
    /// (or past the memory bound).
    pub fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        self.mem.read(addr, out)
    }

    /// Reads the target's memory in the ranges `[lo, hi)` ahead of its use (at most 1 MiB
    /// of each), in as few system calls as possible: the control blocks, stacks and states
    /// about to be read, of many fibers at once. What cannot be read is left to the reads
    /// that need it (which say so).
    pub fn prefetch(&mut self, ranges: &[(u64, u64)]) {
        let bounded: Vec<(u64, u64)> = ranges
            .iter()
            .map(|&(lo, hi)| (lo, hi.min(lo.saturating_add(1 << 20))))
            .collect();
        self.mem.prefetch(&bounded);
    }

    /// Reads one little-endian word of the target's memory.
    pub fn read_u64(&mut self, addr: u64) -> Option<u64> {
        self.mem.read_u64(addr)
    }

    /// Where the section `name` of one of the target's files is in its memory (address and
    /// size), from the first image that has one.
    pub fn section(&self, name: &str) -> Option<(u64, u64)> {
        self.images.images.iter().find_map(|i| {
            i.sections
                .iter()
                .find(|(n, _, _)| n == name)
                .map(|&(_, a, l)| (a.wrapping_add(i.bias), l))
        })
    }

    /// The target's images whose files could not be used, with why (`path: why`): not
    /// readable here, or not the ones the process mapped.
    pub fn unusable_images(&self) -> Vec<String> {
        self.images
            .images
            .iter()
            .filter_map(|i| match &i.symbols {
                ImageSymbols::None(why) => Some(format!("{}: {why}", i.path)),
                _ => None,
            })
            .collect()
    }

    /// The target's files that could be opened, with their load bias: `(file, bias)`, the
    /// file as this process opens it (through `/proc/PID/root`, or the core's `--root`).
    pub fn image_files(&self) -> Vec<(std::path::PathBuf, u64)> {
        self.images
            .images
            .iter()
            .filter_map(|i| match &i.symbols {
                ImageSymbols::File { file, .. } => Some((file.clone(), i.bias)),
                _ => None,
            })
            .collect()
    }

    /// Walks a stack from `regs` (a suspended coroutine's saved registers), ending before a
    /// frame whose stack pointer passes `stop_sp` (its entry) when given.
    pub fn walk(&mut self, regs: Registers, stop_sp: Option<u64>) -> (Vec<Frame>, Option<String>) {
        walk(
            &self.images,
            &mut self.mem,
            &mut self.cache,
            regs,
            stop_sp,
            self.opts.max_frames,
        )
    }

    /// The registers of thread `tid`: from the core file, or of a thread held stopped;
    /// `None` in the non-blocking mode (a running thread's change as they are read), after
    /// [`Session::resume`], or for a thread not known.
    pub fn thread_registers(&self, tid: i32) -> Option<Registers> {
        if let Some((_, c)) = &self.core {
            return c.threads.iter().find(|t| t.tid == tid).map(|t| t.regs);
        }
        let st = self.stopped.as_ref()?;
        if !st.threads().contains(&tid) {
            return None;
        }
        platform::registers(tid).ok()
    }

    /// DWARF register `n` of thread `tid` (x86-64: 0 `rax`, 1 `rdx`, 3 `rbx`, …; see
    /// [`Session::thread_registers`] for when a thread's registers can be read).
    pub fn thread_register(&self, tid: i32, n: u16) -> Option<u64> {
        if let Some((_, c)) = &self.core {
            let t = c.threads.iter().find(|t| t.tid == tid)?;
            return crate::arch::general_register(&t.general, n);
        }
        let st = self.stopped.as_ref()?;
        if !st.threads().contains(&tid) {
            return None;
        }
        let g = platform::general_registers(tid).ok()?;
        crate::arch::general_register(&g, n)
    }

    /// Whether `addr` is in the code of one of the target's images (not JIT code, not a bad
    /// address).
    pub fn knows_code(&self, addr: u64) -> bool {
        self.images.unwinder_knows(addr)
    }

    /// Lets the stopped threads go (if they were); the time they were held. The first call
    /// also looks whether the live process is still there: a held process ends only when
    /// killed (SIGKILL goes through a stop), and one not held may have exited; either way
    /// what was read after that is missing or wrong, and the dump says so
    /// ([`ProcessDump::ended`]). (Looked at before the threads go, not after: a process that
    /// ends once let go ended after the reading.)
    pub fn resume(&mut self) -> Option<Duration> {
        if self.ended.is_none() {
            // (Held threads that are not in their tracing stop any more were killed: the
            // process may not look a zombie yet while the kernel takes it down.)
            let pid = self.pid;
            let killed = self.stopped.as_ref().is_some_and(|st| {
                st.threads()
                    .iter()
                    .any(|&t| !platform::trace_stopped(pid, t))
            });
            self.ended = Some(killed || !platform::exists(pid) || lone_zombie(pid));
        }
        if self.stopped.take().is_some() {
            self.paused = self.stopped_at.map(|t| t.elapsed());
        }
        self.paused
    }

    /// Names frames from the target's files.
    pub fn resolve_all(&self, frames: &[Frame]) -> Vec<ResolvedFrame> {
        self.images.resolve_all(frames)
    }

    /// The dump of the threads walked (naming their frames), once the threads are let go.
    pub fn finish(&mut self, raw: Vec<RawThread>) -> ProcessDump {
        self.resume();
        let exact = self.opts.mode == Mode::Consistent;
        let threads: Vec<ThreadDump> = raw
            .into_iter()
            .map(|t| ThreadDump {
                tid: t.tid,
                name: match &self.core {
                    // (A core keeps the process's name only.)
                    Some((_, c)) if t.tid == self.pid => c.name.clone(),
                    Some(_) => String::new(),
                    None => platform::thread_name(self.pid, t.tid),
                },
                frames: self.images.resolve_all(&t.frames),
                exact,
                note: t.note,
            })
            .collect();
        let unnamed = self.images.unnamed(&threads);
        let without_lines = self.images.without_lines(&threads);
        ProcessDump {
            pid: self.pid,
            exe: self.exe.clone(),
            mode: self.opts.mode,
            paused_us: self.paused.map(|d| d.as_micros() as u64),
            core: self.core.as_ref().map(|(p, _)| p.clone()),
            threads,
            unnamed,
            without_lines,
            ended: self.ended == Some(true),
            warnings: self.warnings(),
        }
    }

    /// What makes a dump of this session incomplete besides the process's end (see
    /// [`ProcessDump::warnings`]).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if let Some((_, c)) = &self.core {
            if let Some((claimed, len)) = c.truncated {
                w.push(format!(
                    "the core file is truncated: its segments reach byte {claimed}, it ends at \
                     byte {len}; what lay past its end is missing (stacks cut short, fibers or \
                     their Lua frames not read)"
                ));
            }
        }
        w
    }
}

/// Where a live process's mapped file is readable from here: through `/proc/PID/root` (its
/// own mount namespace), or `/proc/PID/map_files` for a file deleted since it was mapped.
fn live_files(pid: i32) -> impl Fn(&platform::Mapping) -> Option<std::path::PathBuf> {
    move |m: &platform::Mapping| {
        Some(if m.path.ends_with(" (deleted)") {
            std::path::PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
        } else {
            platform::in_root(pid, &m.path)
        })
    }
}

/// Whether process `pid` is a zombie with no thread left running.
fn lone_zombie(pid: i32) -> bool {
    matches!(platform::kind(pid), Some(('Z', _)))
        && platform::threads(pid).map_or(true, |t| t.len() <= 1)
}

fn read_maps(pid: i32) -> Result<Vec<platform::Mapping>, DumpError> {
    platform::maps(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => permission(pid),
        _ => DumpError::Exited(pid),
    })
}

fn check_architecture(pid: i32) -> Result<(), DumpError> {
    let head = platform::exe_head(pid).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => permission(pid),
        _ => DumpError::Exited(pid),
    })?;
    program_kind(&head).map_err(|found| DumpError::Architecture { pid, found })
}

/// Whether an executable's first bytes are a program of this architecture; otherwise what
/// it is.
fn program_kind(head: &[u8; 64]) -> Result<(), String> {
    if &head[..4] != b"\x7fELF" {
        return Err("not an ELF program".into());
    }
    let class64 = head[4] == 2;
    let machine = u16::from_le_bytes([head[18], head[19]]);
    if class64 && machine == crate::arch::ELF_MACHINE.0 {
        return Ok(());
    }
    Err(match (class64, machine) {
        (false, 3) => "a 32-bit x86 program".to_string(),
        (false, 40) => "a 32-bit ARM program".to_string(),
        (true, 183) => "an aarch64 program".to_string(),
        (true, 62) => "an x86_64 program".to_string(),
        (c, m) => format!(
            "a {}-bit program for ELF machine {m}",
            if c { 64 } else { 32 }
        ),
    })
}

/// The target's memory, read a page at a time and kept (bounded).
/// Where memory comes from: a live process, or a core file.
enum Source {
    Live(platform::MemReader),
    Core(Arc<corefile::Core>),
}

impl Source {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Source::Live(r) => r.read(addr, buf),
            Source::Core(c) => c.read(addr, buf),
        }
    }
}

/// The target's memory, through a direct-mapped cache of its 1 KiB lines: each line has one
/// slot (a hash of its address), a miss reads the line into its slot (replacing what was
/// there), and a line that cannot be read is remembered as such. The cache's memory is allocated
/// once and reused: no allocation per page, a bound on this process's memory, and a read
/// never fails because the cache is full.
struct Memory {
    reader: Source,
    /// Per slot: the line's address, with bit 0 set when it holds the line, bit 1 when the
    /// line cannot be read; 0: empty.
    tags: Vec<u64>,
    data: Vec<u8>,
    /// log2 of the slot count.
    bits: u32,
}

const PAGE: usize = 4096;
/// The cache's unit: 1 KiB, aligned (a line never crosses a page, so a line is readable
/// exactly when its page is), a quarter of the bytes a page copies where a walk needs a few
/// words of each.
const LINE: usize = 1024;
/// Lines read in one system call at most (`IOV_MAX` is 1024).
const BATCH: usize = 256;

impl Memory {
    fn new(reader: Source, max_bytes: usize) -> Memory {
        let slots = (max_bytes / LINE).clamp(16, 1 << 20).next_power_of_two();
        Memory {
            reader,
            tags: vec![0; slots],
            // Zeroed memory comes from the kernel untouched: a slot costs only when used.
            data: vec![0; slots * LINE],
            bits: slots.trailing_zeros(),
        }
    }

    /// Drops every page read (the map changed).
    fn forget(&mut self) {
        self.tags.fill(0);
    }

    fn slot(&self, base: u64) -> usize {
        ((base >> 10).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - self.bits)) as usize
    }

    /// Whether the page at `base` is in its slot (read, or known unreadable).
    fn cached(&self, base: u64) -> bool {
        let t = self.tags[self.slot(base)];
        t & !3 == base && t & 3 != 0
    }

    fn page(&mut self, base: u64) -> Option<&[u8]> {
        let i = self.slot(base);
        if !self.cached(base) {
            let buf = &mut self.data[i * LINE..(i + 1) * LINE];
            let ok = matches!(self.reader.read(base, buf), Ok(n) if n == LINE);
            self.tags[i] = base | if ok { 1 } else { 2 };
        }
        (self.tags[i] & 1 != 0).then(|| &self.data[i * LINE..(i + 1) * LINE])
    }

    /// Reads the pages of `[lo, hi)` that are not cached yet in as few system calls as it
    /// can (what cannot be read is left to be read, and found unreadable, one by one).
    fn prefetch(&mut self, ranges: &[(u64, u64)]) {
        let mut want: Vec<u64> = Vec::new();
        let mut slots: std::collections::HashSet<usize> = std::collections::HashSet::new();
        for &(lo, hi) in ranges {
            let mut base = lo & !(LINE as u64 - 1);
            while base < hi {
                if !self.cached(base) && slots.insert(self.slot(base)) {
                    want.push(base);
                }
                let Some(next) = base.checked_add(LINE as u64) else {
                    break;
                };
                base = next;
            }
        }
        self.fetch(&want);
    }

    /// Reads the pages at `bases` (not cached, distinct slots) in batches.
    fn fetch(&mut self, bases: &[u64]) {
        if !matches!(self.reader, Source::Live(_)) {
            return;
        }
        for chunk in bases.chunks(BATCH) {
            let slots: Vec<usize> = chunk.iter().map(|&b| self.slot(b)).collect();
            let Source::Live(reader) = &mut self.reader else {
                return;
            };
            // Disjoint slices of the arena, one per page, in the order of `chunk`.
            let mut order: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
            order.sort_unstable_by_key(|&(_, s)| s);
            let mut bufs: Vec<Option<&mut [u8]>> = (0..chunk.len()).map(|_| None).collect();
            let mut rest: &mut [u8] = &mut self.data;
            let mut at = 0usize;
            for &(k, s) in &order {
                if s < at {
                    // Two pages of one slot: the second is read when needed.
                    continue;
                }
                let (_, tail) = std::mem::take(&mut rest).split_at_mut((s - at) * LINE);
                let (page, tail) = tail.split_at_mut(LINE);
                bufs[k] = Some(page);
                rest = tail;
                at = s + 1;
            }
            let mut meta: Vec<(u64, usize)> = Vec::with_capacity(chunk.len());
            let mut reqs: Vec<(u64, &mut [u8])> = Vec::with_capacity(chunk.len());
            for (k, p) in bufs.into_iter().enumerate() {
                if let Some(p) = p {
                    meta.push((chunk[k], slots[k]));
                    reqs.push((chunk[k], p));
                }
            }
            // The slots change hands: empty until read whole.
            for &(_, slot) in &meta {
                self.tags[slot] = 0;
            }
            let whole = reader.read_many(&mut reqs);
            for &(b, slot) in meta.iter().take(whole) {
                self.tags[slot] = b | 1;
            }
        }
    }

    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool {
        let mut done = 0;
        while done < out.len() {
            let a = addr.wrapping_add(done as u64);
            let base = a & !(LINE as u64 - 1);
            let off = (a - base) as usize;
            let Some(p) = self.page(base) else {
                return false;
            };
            let n = (LINE - off).min(out.len() - done);
            out[done..done + n].copy_from_slice(&p[off..off + n]);
            done += n;
        }
        true
    }

    fn read_u64(&mut self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// Reads `len` bytes that need not be cached (a vDSO image): straight from the target.
    /// `None` past [`MAX_READ_BYTES`] or when the memory cannot be had: a length comes from
    /// the target's maps or a core's headers, which may be garbage (a damaged core asked for
    /// exabytes: an abort).
    fn read_bytes(&mut self, addr: u64, len: usize) -> Option<Vec<u8>> {
        if len > MAX_READ_BYTES {
            return None;
        }
        let mut v = Vec::new();
        v.try_reserve_exact(len).ok()?;
        v.resize(len, 0u8);
        matches!(self.reader.read(addr, &mut v), Ok(n) if n == len).then_some(v)
    }
}

/// The most one uncached read takes (a vDSO is a few pages; its notes less).
const MAX_READ_BYTES: usize = 64 << 20;

/// One image of the target.
struct Image {
    /// Its path as the target names it (`[vdso]` for the vDSO).
    path: String,
    bias: u64,
    start: u64,
    end: u64,
    /// Its executable mappings.
    exec: Vec<(u64, u64)>,
    /// Its `.fibertrace*` sections, which a layer above looks for (name, SVMA, size).
    sections: Vec<(String, u64, u64)>,
    build_id: Option<Vec<u8>>,
    /// Where its symbols come from.
    symbols: ImageSymbols,
}

enum ImageSymbols {
    /// The file, opened on first need (`None`: unusable, with why).
    File {
        file: std::path::PathBuf,
        open: OnceLock<Result<Box<ElfSymbols>, String>>,
    },
    /// Function symbols read from memory (the vDSO): (start SVMA, size, name), sorted.
    Table(Vec<(u64, u64, String)>),
    /// None (with why).
    None(String),
}

/// The target's images and an unwinder over them.
struct Images {
    images: Vec<Image>,
    unwinder: DwarfUnwinder<Arc<[u8]>, MayAllocateDuringUnwind>,
    /// Rows the unwinder cannot step, stepped by the walk (see [`cfa`]), sorted.
    deref: Vec<cfa::DerefRow>,
}

impl Images {
    fn read(
        maps: &[platform::Mapping],
        files: &dyn Fn(&platform::Mapping) -> Option<std::path::PathBuf>,
        mem: &mut Memory,
    ) -> Result<Images, DumpError> {
        // Each file's mappings together: the executable ones give its bias.
        let mut order: Vec<String> = Vec::new();
        let mut by_path: HashMap<String, Vec<platform::Mapping>> = HashMap::new();
        for m in maps.iter().cloned() {
            if m.path.is_empty() || (m.path.starts_with('[') && m.path != "[vdso]") {
                continue;
            }
            if !by_path.contains_key(&m.path) {
                order.push(m.path.clone());
            }
            by_path.entry(m.path.clone()).or_default().push(m);
        }
        let mut images = Vec::new();
        let mut unwinder = DwarfUnwinder::new();
        let mut deref = Vec::new();
        for path in order {
            let maps = &by_path[&path];
            let Some(exec) = maps.iter().find(|m| m.exec) else {
                continue;
            };
            let exec_ranges: Vec<(u64, u64)> = maps
                .iter()
                .filter(|m| m.exec)
                .map(|m| (m.start, m.end))
                .collect();
            let start = maps.iter().map(|m| m.start).min().unwrap_or(exec.start);
            let end = maps.iter().map(|m| m.end).max().unwrap_or(exec.end);
            let loaded = if path == "[vdso]" {
                mem.read_bytes(exec.start, (exec.end - exec.start) as usize)
                    .map(|b| (Bytes::Owned(b), None))
            } else {
                files(exec).and_then(|file| map_file(&file).map(|b| (b, Some(file))))
            };
            let Some((bytes, file)) = loaded else {
                images.push(Image {
                    path: path.clone(),
                    bias: exec.start.wrapping_sub(exec.offset),
                    start,
                    end,
                    exec: exec_ranges,
                    sections: Vec::new(),
                    build_id: None,
                    symbols: ImageSymbols::None("its file could not be read".into()),
                });
                continue;
            };
            let Ok(obj) = object::File::parse(&bytes[..]) else {
                continue;
            };
            // The load bias: where the segment holding the executable mapping's file offset
            // was put, minus its address in the file.
            let bias = if path == "[vdso]" {
                obj.segments()
                    .find(|s| s.file_range().0 == 0)
                    .map(|s| exec.start.wrapping_sub(s.address()))
                    .unwrap_or(exec.start)
            } else {
                // The segment the mapping was made for starts in the mapping's first page
                // (segments need not start on a page: the loader maps from the page down).
                let starts_here = |s: &object::Segment<'_, '_>| {
                    let (off, _) = s.file_range();
                    off & !(PAGE as u64 - 1) == exec.offset
                };
                let exec_flag = |s: &object::Segment<'_, '_>| matches!(s.flags(), object::SegmentFlags::Elf { p_flags, .. } if p_flags.contains(object::elf::PF_X));
                let seg = obj
                    .segments()
                    .filter(starts_here)
                    .max_by_key(|s| exec_flag(s));
                match seg {
                    // Its address at the mapping's start: its own, less the bytes before it
                    // in that first page.
                    Some(s) => exec
                        .start
                        .wrapping_sub(s.address().wrapping_sub(s.file_range().0 - exec.offset)),
                    None => exec.start.wrapping_sub(exec.offset),
                }
            };
            let build_id = obj.build_id().ok().flatten().map(<[u8]>::to_vec);
            let mut symbols = match file {
                Some(f) => ImageSymbols::File {
                    file: f,
                    open: OnceLock::new(),
                },
                None => ImageSymbols::Table(symbol_table(&obj)),
            };
            // The file on disk must be what is mapped: its build id against the target's
            // memory (the note lies in the first loaded segment); where the memory does not
            // hold it (a core file leaves read-only pages out: gdb's does), its segments must
            // lie where the process mapped the file. Another file's tables would name and
            // unwind the frames wrong (another build's functions, walks that go astray).
            let mut mismatch = None;
            if let ImageSymbols::File { file: f, .. } = &symbols {
                let f = f.clone();
                match build_id_in_memory(&obj, bias, mem) {
                    Some(in_mem) if build_id.as_ref().is_some_and(|id| *id != in_mem) => {
                        mismatch = Some("another build id");
                    }
                    None if !layout_matches(&obj, bias, maps) => {
                        mismatch = Some("its segments are not where the process mapped them");
                    }
                    _ => {}
                }
                if let Some(why) = mismatch {
                    let what = if f.as_os_str() == path.as_str() {
                        "the file on disk".to_string()
                    } else {
                        format!("the file read for it ({})", f.display())
                    };
                    symbols = ImageSymbols::None(format!("{what} is not the one mapped ({why})"));
                }
            }
            if mismatch.is_none() {
                if let Some(m) = module(&path, &obj, start..end, bias) {
                    unwinder.add_module(m);
                    deref.extend(cfa::deref_rows(&obj, bias));
                }
            }
            images.push(Image {
                path,
                bias,
                start,
                end,
                exec: exec_ranges,
                sections: obj
                    .sections()
                    .filter(|_| mismatch.is_none())
                    .filter_map(|sec| {
                        let name = sec.name().ok()?;
                        name.starts_with(".fibertrace")
                            .then(|| (name.to_string(), sec.address(), sec.size()))
                    })
                    .collect(),
                build_id,
                symbols,
            });
        }
        deref.sort_unstable_by_key(|r| r.start);
        Ok(Images {
            images,
            unwinder,
            deref,
        })
    }

    /// The row of [`Images::deref`] holding `pc`.
    fn deref_row(&self, pc: u64) -> Option<&cfa::DerefRow> {
        let i = self.deref.partition_point(|r| r.start <= pc);
        self.deref[..i].last().filter(|r| pc < r.end)
    }

    /// The images some thread's frames fall in whose symbols could not be used, with why.
    fn unnamed(&self, threads: &[ThreadDump]) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for img in &self.images {
            let why = match &img.symbols {
                ImageSymbols::None(why) => why.clone(),
                ImageSymbols::File { open, .. } => match open.get() {
                    Some(Err(e)) => e.clone(),
                    _ => continue,
                },
                ImageSymbols::Table(_) => continue,
            };
            let used = threads.iter().flat_map(|t| &t.frames).any(|f| {
                f.frame
                    .lookup_address()
                    .is_some_and(|a| a >= img.start && a < img.end)
            });
            if used {
                out.push(format!("{}: {why}", img.path));
            }
        }
        out
    }

    /// The images some thread's frames fall in whose DWARF could not be read, with why.
    fn without_lines(&self, threads: &[ThreadDump]) -> Vec<String> {
        self.images
            .iter()
            .filter_map(|img| match &img.symbols {
                ImageSymbols::File { open, .. } => match open.get() {
                    Some(Ok(elf)) => elf.lines_unavailable().map(|why| (img, why)),
                    _ => None,
                },
                _ => None,
            })
            .filter(|(img, _)| {
                threads.iter().flat_map(|t| &t.frames).any(|f| {
                    f.frame
                        .lookup_address()
                        .is_some_and(|a| a >= img.start && a < img.end)
                })
            })
            .map(|(img, why)| format!("{}: {why}", img.path))
            .collect()
    }

    /// Whether `addr` is in the executable part of an image.
    fn unwinder_knows(&self, addr: u64) -> bool {
        self.images
            .iter()
            .any(|i| i.exec.iter().any(|&(s, e)| addr >= s && addr < e))
    }

    fn image_of(&self, addr: u64) -> Option<&Image> {
        self.images.iter().find(|i| addr >= i.start && addr < i.end)
    }

    fn resolve_all(&self, frames: &[Frame]) -> Vec<ResolvedFrame> {
        frames
            .iter()
            .map(|f| ResolvedFrame {
                frame: *f,
                resolved: f.lookup_address().map(|a| self.resolve(a)),
            })
            .collect()
    }

    fn resolve(&self, addr: u64) -> Resolved {
        let mut out = Resolved {
            lookup_address: addr,
            ..Resolved::default()
        };
        let Some(img) = self.image_of(addr) else {
            return out;
        };
        out.image = Some(ImageRef {
            path: img.path.clone(),
            base: img.bias,
            build_id: img.build_id.as_deref().map(crate::image::hex),
        });
        let svma = addr.wrapping_sub(img.bias);
        match &img.symbols {
            ImageSymbols::File { file, open } => {
                if let Ok(elf) = open.get_or_init(|| {
                    ElfSymbols::open(file)
                        .map(Box::new)
                        .map_err(|e| e.to_string())
                }) {
                    let l = elf.lookup(svma);
                    out.symbols = l.symbols;
                    out.function_start = l.function_start.map(|s| s.wrapping_add(img.bias));
                }
            }
            ImageSymbols::Table(t) => {
                let i = t.partition_point(|&(s, _, _)| s <= svma);
                if let Some((s, size, name)) = i.checked_sub(1).map(|i| &t[i]) {
                    if svma < s + (*size).max(1) {
                        out.symbols.push(Symbol {
                            name: Some(name.clone()),
                            ..Symbol::default()
                        });
                        out.function_start = Some(s.wrapping_add(img.bias));
                    }
                }
            }
            ImageSymbols::None(_) => {}
        }
        out
    }
}

/// An image's bytes: a file mapped, or memory read from the target (the vDSO).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// Maps a file read-only (a large binary is not copied: only its unwind sections are).
fn map_file(path: &std::path::Path) -> Option<Bytes> {
    let f = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping of a file; if another process truncates the file
    // while it is mapped, reading it faults — the hazard every ELF reader that maps files
    // accepts (and the symbolizer's own). The mapping lives while the image is read.
    unsafe { memmap2::Mmap::map(&f) }.ok().map(Bytes::Mapped)
}

/// Function symbols of an in-memory image (the vDSO), sorted by address.
fn symbol_table(obj: &object::File<'_>) -> Vec<(u64, u64, String)> {
    let mut v: Vec<(u64, u64, String)> = obj
        .dynamic_symbols()
        .chain(obj.symbols())
        .filter(|s| s.kind() == object::SymbolKind::Text && s.address() != 0)
        .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
        .collect();
    v.sort();
    v.dedup_by_key(|e| e.0);
    v
}

/// The build id in the target's memory, from the file's note segment.
/// Whether every mapping of an image (`maps`) lies where the file's segments say, with load
/// bias `bias`: each mapping's file offset in a loaded segment's pages, at that segment's
/// address. (A mapping split by `mprotect`, RELRO's, starts inside its segment.)
fn layout_matches(obj: &object::File<'_>, bias: u64, maps: &[platform::Mapping]) -> bool {
    let page = PAGE as u64;
    maps.iter().all(|m| {
        obj.segments().any(|s| {
            let (off, len) = s.file_range();
            let first = off & !(page - 1);
            let end = off.saturating_add(len).saturating_add(page - 1) & !(page - 1);
            m.offset >= first
                && m.offset < end
                && bias
                    .wrapping_add(s.address() & !(page - 1))
                    .wrapping_add(m.offset - first)
                    == m.start
        })
    })
}

fn build_id_in_memory(obj: &object::File<'_>, bias: u64, mem: &mut Memory) -> Option<Vec<u8>> {
    use object::read::elf::ProgramHeader as _;
    let object::File::Elf64(elf) = obj else {
        return None;
    };
    let endian = elf.endian();
    for ph in elf.elf_program_headers() {
        if ph.p_type(endian) != object::elf::PT_NOTE {
            continue;
        }
        let size = ph.p_filesz(endian) as usize;
        if size > 64 << 10 {
            continue;
        }
        let bytes = mem.read_bytes(bias.wrapping_add(ph.p_vaddr(endian)), size)?;
        if let Some(id) = crate::image::parse_build_id_notes(&bytes) {
            return Some(id);
        }
    }
    None
}

/// framehop's module for an image: its call-frame information and text.
fn module(
    path: &str,
    obj: &object::File<'_>,
    avma: std::ops::Range<u64>,
    bias: u64,
) -> Option<framehop::Module<Arc<[u8]>>> {
    let section = |name: &str| {
        let s = obj.section_by_name(name)?;
        let data: Arc<[u8]> = Arc::from(s.uncompressed_data().ok()?.as_ref());
        Some((s.address()..s.address() + s.size(), data))
    };
    let eh_frame = section(".eh_frame");
    let eh_frame_hdr = section(".eh_frame_hdr");
    let debug_frame = section(".debug_frame");
    if eh_frame.is_none() && debug_frame.is_none() {
        return None;
    }
    let text = obj
        .section_by_name(".text")
        .map(|s| s.address()..s.address() + s.size());
    let (eh_frame_svma, eh_frame) = eh_frame.map_or((None, None), |(r, d)| (Some(r), Some(d)));
    let (eh_frame_hdr_svma, eh_frame_hdr) =
        eh_frame_hdr.map_or((None, None), |(r, d)| (Some(r), Some(d)));
    let info = ExplicitModuleSectionInfo::<Arc<[u8]>> {
        base_svma: 0,
        text_svma: text,
        eh_frame_svma,
        eh_frame,
        eh_frame_hdr_svma,
        eh_frame_hdr,
        debug_frame: debug_frame.map(|(_, d)| d),
        ..Default::default()
    };
    Some(framehop::Module::new(path.to_string(), avma, bias, info))
}

/// Walks one thread from its registers over the target's memory.
fn walk(
    images: &Images,
    mem: &mut Memory,
    cache: &mut UnwindCache<MayAllocateDuringUnwind>,
    regs: Registers,
    stop_sp: Option<u64>,
    max_frames: usize,
) -> (Vec<Frame>, Option<String>) {
    let mut frames = vec![Frame::Pc(regs.ip)];
    // Without the frame pointer (a thread read where it waits in the kernel): the innermost
    // frame record on the stack stands for it.
    let fp = if regs.fp == 0 {
        scan_frame_record(images, mem, regs.sp).unwrap_or(0)
    } else {
        regs.fp
    };
    let mut r = unwind_regs(regs.ip, regs.sp, fp);
    let mut addr = FrameAddress::from_instruction_pointer(regs.ip);
    let mut read = |a: u64| mem.read_u64(a).ok_or(());
    let t0 = Instant::now();
    let note = loop {
        if frames.len() >= max_frames {
            break Some(format!("walk cut at {max_frames} frames"));
        }
        if t0.elapsed() > Duration::from_secs(2) {
            break Some("walk cut after 2 s".to_string());
        }
        // A row framehop cannot step (corosensei's trampoline): stepped here.
        let step = match images.deref_row(addr.address_for_lookup()) {
            Some(row) => match row.step(crate::arch::regs_fp(&r), &mut |a| read(a).ok()) {
                Some((ra, sp, fp)) => {
                    r = unwind_regs(ra, sp, fp);
                    Ok(Some(ra))
                }
                None => Ok(None),
            },
            None => images.unwinder.unwind_frame(addr, &mut r, cache, &mut read),
        };
        match step {
            Ok(Some(ra)) if ra != 0 => {
                if stop_sp.is_some_and(|stop| crate::arch::regs_sp(&r) >= stop) {
                    // Past the coroutine's entry: the rest is the runtime's.
                    break None;
                }
                frames.push(Frame::Ra(ra));
                match FrameAddress::from_return_address(ra) {
                    Some(a) => addr = a,
                    None => break None,
                }
            }
            Ok(_) => break None,
            Err(e) => {
                // framehop ends every walk that reaches the stack's root with an error it
                // cannot tell from a failure: say so only when it stopped inside code.
                let last = frames.last().and_then(Frame::lookup_address);
                let known = last.is_some_and(|a| images.image_of(a).is_some());
                break (!known).then(|| format!("walk stopped: {e}"));
            }
        }
    };
    (frames, note)
}

/// The first frame record at or above `sp`: a slot holding the address of a higher slot of
/// the same stack (the caller's saved frame pointer), followed by a return address into
/// known code. Where the innermost functions keep no frame of their own (a system call's C
/// wrapper), that record is the one the frame pointer names. A guess: only for threads read
/// without stopping them, whose frames are marked not exact anyway.
fn scan_frame_record(images: &Images, mem: &mut Memory, sp: u64) -> Option<u64> {
    const SCAN: u64 = 4096;
    const STACK_SPAN: u64 = 8 << 20;
    let mut at = sp & !7;
    while at < sp.saturating_add(SCAN) {
        let saved = mem.read_u64(at)?;
        if saved > at && saved - at < STACK_SPAN && saved & 7 == 0 {
            if let Some(ra) = mem.read_u64(at + 8) {
                if images.image_of(ra).is_some() && images.unwinder_knows(ra) {
                    return Some(at);
                }
            }
        }
        at += 8;
    }
    None
}

/// The dump as text: a header, then each thread and its frames (`format`'s default lines).
impl ProcessDump {
    /// The dump as text.
    pub fn to_text(&self) -> String {
        self.to_text_with(&crate::format::TextOptions::default())
    }

    /// The dump as text, its frames written with `opts` (a glue filter, for one).
    pub fn to_text_with(&self, opts: &crate::format::TextOptions<'_>) -> String {
        let mut out = String::new();
        let name = self.exe.rsplit('/').next().unwrap_or(&self.exe);
        let how = match (self.mode, self.paused_us, &self.core) {
            (_, _, Some(core)) => format!("from the core file {}", crate::format::Escaped(core)),
            (Mode::Consistent, Some(us), _) => format!("stopped {}", human_us(us)),
            (Mode::Consistent, None, _) => "stopped".to_string(),
            (Mode::NonBlocking, _, _) => "not stopped: frames not exact".to_string(),
        };
        out.push_str(&format!(
            "process {} {} ({}): {} threads, {}\n",
            self.pid,
            crate::format::Quoted(name),
            crate::format::Escaped(&self.exe),
            self.threads.len(),
            how
        ));
        if self.ended {
            out.push_str(ENDED_NOTE);
        }
        for w in &self.warnings {
            out.push_str(&format!("({w})\n"));
        }
        out.push('\n');
        for t in &self.threads {
            out.push_str(&format!(
                "thread {} {}:\n",
                t.tid,
                crate::format::Quoted(&t.name)
            ));
            out.push_str(&crate::format::text_resolved(&t.frames, opts));
            if let Some(n) = &t.note {
                out.push_str(&format!("    ({n})\n"));
            }
            out.push('\n');
        }
        for u in &self.unnamed {
            out.push_str(&format!(
                "(frames unnamed in {})\n",
                crate::format::Escaped(u)
            ));
        }
        for u in &self.without_lines {
            out.push_str(&format!(
                "(frames without file:line in {})\n",
                crate::format::Escaped(u)
            ));
        }
        out
    }
}

/// The line under a dump's heading when the process ended while it was read.
pub const ENDED_NOTE: &str = "(the process ended while it was read (killed, or it exited): what \
                              was read after that is missing or wrong, the dump is incomplete)\n";

fn human_us(us: u64) -> String {
    if us < 1000 {
        format!("{us} µs")
    } else if us < 10_000_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        format!("{:.1} s", us as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(class: u8, machine: u16) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = class;
        h[5] = 1;
        h[18..20].copy_from_slice(&machine.to_le_bytes());
        h
    }

    #[test]
    fn programs_of_other_architectures_are_named() {
        assert_eq!(program_kind(&header(2, crate::arch::ELF_MACHINE.0)), Ok(()));
        assert_eq!(
            program_kind(&header(1, 3)),
            Err("a 32-bit x86 program".into())
        );
        assert_eq!(
            program_kind(&header(1, 40)),
            Err("a 32-bit ARM program".into())
        );
        assert_eq!(
            program_kind(&header(2, 243)),
            Err("a 64-bit program for ELF machine 243".into())
        );
        assert_eq!(program_kind(&[b'#'; 64]), Err("not an ELF program".into()));
        let e = DumpError::Architecture {
            pid: 7,
            found: "a 32-bit x86 program".into(),
        };
        assert_eq!(
            e.to_string(),
            "process 7 is a 32-bit x86 program; this fibertrace reads x86_64 processes"
        );
    }

    #[test]
    fn map_lines_parse_and_bad_ones_are_skipped() {
        let m =
            linux::parse_map_line("7f00a000-7f00b000 r-xp 00001000 08:01 42    /usr/lib/libc.so.6")
                .unwrap();
        assert_eq!(
            (m.start, m.end, m.exec, m.offset),
            (0x7f00a000, 0x7f00b000, true, 0x1000)
        );
        assert_eq!(m.path, "/usr/lib/libc.so.6");
        let anon = linux::parse_map_line("7f00a000-7f00b000 rw-p 00000000 00:00 0").unwrap();
        assert_eq!((anon.exec, anon.path.as_str()), (false, ""));
        let spaced =
            linux::parse_map_line("1000-2000 r-xp 00000000 08:01 42 /tmp/a b (deleted)").unwrap();
        assert_eq!(spaced.path, "/tmp/a b (deleted)");
        for bad in ["", "zz-1 r-xp 0 0 0", "1000 r-xp 0 0 0 /x", "1000-2000"] {
            assert!(linux::parse_map_line(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_line_cache_reads_what_is_there_whatever_collides_or_fails() {
        // This process's own memory, read as another's, through a cache of 16 lines.
        let data: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        let mut m = Memory::new(
            Source::Live(linux::MemReader::new(std::process::id() as i32)),
            16 * LINE,
        );
        let at = data.as_ptr() as u64;
        // Ahead: more lines than slots, so most collide.
        m.prefetch(&[(at, at + data.len() as u64), (at + 3, at + 5000)]);
        for (off, len) in [(0, 64 * 1024), (5, 3000), (1023, 2), (60_000, 5536)] {
            let mut out = vec![0u8; len];
            assert!(m.read(at + off as u64, &mut out), "{off}");
            assert_eq!(out, data[off..off + len], "{off}");
        }
        // An unmapped page: its lines fail, and keep failing, the mapped ones still read.
        let gap = 4096u64; // the zero page is never mapped
        m.prefetch(&[(gap, gap + 4096), (at, at + 4096)]);
        let mut b = [0u8; 8];
        assert!(!m.read(gap + 8, &mut b));
        assert!(!m.read(gap + 8, &mut b));
        assert!(m.read(at + 8, &mut b));
        assert_eq!(b, data[8..16]);
        // A read of several lines fails whole when one cannot be read.
        let mut big = vec![0u8; 2 * LINE];
        assert!(!m.read(gap + 4096 - LINE as u64, &mut big));
        std::hint::black_box(&data);
    }
}
