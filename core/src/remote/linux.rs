//! Linux leaf: another process through `/proc`, `ptrace` and `process_vm_readv`.
//!
//! Stopping: every thread is *seized* (`PTRACE_SEIZE`, which sends no signal) and interrupted
//! (`PTRACE_INTERRUPT`); the thread list is read again until it holds no thread not yet
//! stopped (a stopped thread cannot make new ones). [`Stopped`] detaches every thread when
//! dropped (on success, on error, on a panic), giving back any signal that arrived while the
//! thread was held; if this process dies meanwhile (SIGINT, a crash), the kernel detaches its
//! tracees itself, and a seized thread is then resumed (the interrupt stop is not a group
//! stop) — the target is never left stopped. A held thread that dies meanwhile (the process
//! killed, or an exec killing its other threads) is reaped rather than detached: an exec
//! waits for that, holding a lock the next seize waits for, and both processes hung there
//! (see [`Stopped::all`]). A thread that exits refuses a seize with EPERM as a missing
//! permission does: the two are told apart by the thread's state.

use std::io::{self, Read as _};
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::arch::Registers;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Mapping {
    pub start: u64,
    pub end: u64,
    pub exec: bool,
    pub offset: u64,
    /// The file (or `[vdso]`, `[stack]`, ...; empty for anonymous memory). A file deleted
    /// since it was mapped ends in ` (deleted)`.
    pub path: String,
}

fn proc(pid: i32) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}"))
}

/// Whether process `pid` exists (and is not a thread of another process).
/// What process `pid` is, from `/proc/PID/stat`: its state letter (`Z`: a zombie) and
/// whether it is a kernel thread (the `PF_KTHREAD` flag). `None` when unreadable.
pub(super) fn kind(pid: i32) -> Option<(char, bool)> {
    parse_stat(&std::fs::read_to_string(proc(pid).join("stat")).ok()?)
}

/// The parent of process `pid` (`None` for a thread other than a main one, or unreadable).
fn parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(proc(pid).join("stat")).ok()?;
    stat[stat.rfind(')')? + 1..]
        .split_ascii_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// [`kind`] from the text of a `/proc/PID/stat`.
fn parse_stat(stat: &str) -> Option<(char, bool)> {
    const PF_KTHREAD: u64 = 0x0020_0000;
    // The command name is in parentheses and may hold any byte but NUL: the fields are
    // after the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    let flags: u64 = f.nth(5)?.parse().ok()?;
    Some((state, flags & PF_KTHREAD != 0))
}

/// Whether thread `tid` of process `pid` is in a tracing stop (`t`): a thread this process
/// holds stays so until let go, unless it was killed meanwhile (SIGKILL goes through a
/// stop); false when it is gone.
pub(super) fn trace_stopped(pid: i32, tid: i32) -> bool {
    std::fs::read_to_string(proc(pid).join(format!("task/{tid}/stat")))
        .ok()
        .and_then(|s| parse_stat(&s))
        .is_some_and(|(state, _)| state == 't')
}

/// The process tracing process `pid` (`TracerPid` in `/proc/PID/status`), if any: a
/// second tracer is refused with the same EPERM as a missing permission.
pub(super) fn tracer(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(proc(pid).join("status")).ok()?;
    let t: i32 = s
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))?
        .trim()
        .parse()
        .ok()?;
    (t != 0).then_some(t)
}

pub(super) fn exists(pid: i32) -> bool {
    std::fs::read_to_string(proc(pid).join("status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .map(|v| v.trim().parse::<i32>() == Ok(pid))
        })
        .unwrap_or(false)
}

/// The process's memory map.
pub(super) fn maps(pid: i32) -> io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(proc(pid).join("maps"))?;
    Ok(text.lines().filter_map(parse_map_line).collect())
}

/// One line of `/proc/PID/maps` (`None`: not one).
pub(super) fn parse_map_line(line: &str) -> Option<Mapping> {
    // start-end perms offset dev inode path
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?;
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let _dev = it.next()?;
    let _inode = it.next()?;
    let path = it.next().unwrap_or("").trim_start().to_string();
    let (s, e) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        exec: perms.as_bytes().get(2) == Some(&b'x'),
        offset,
        path,
    })
}

/// The process's threads (kernel ids), sorted.
pub(super) fn threads(pid: i32) -> io::Result<Vec<i32>> {
    let mut v: Vec<i32> = std::fs::read_dir(proc(pid).join("task"))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    v.sort_unstable();
    Ok(v)
}

/// A thread's name (`comm`).
pub(super) fn thread_name(pid: i32, tid: i32) -> String {
    // (A name is any bytes the thread set: not UTF-8 reads lossily, not as no name.)
    std::fs::read(proc(pid).join(format!("task/{tid}/comm")))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches('\n')
                .to_string()
        })
        .unwrap_or_default()
}

/// The process's executable, as its own mount namespace names it.
pub(super) fn exe(pid: i32) -> io::Result<PathBuf> {
    std::fs::read_link(proc(pid).join("exe"))
}

/// A file of the process's own mount namespace (a container's), through `/proc/PID/root`.
pub(super) fn in_root(pid: i32, path: &str) -> PathBuf {
    proc(pid).join("root").join(path.trim_start_matches('/'))
}

/// The first bytes of the process's executable (to check its architecture).
pub(super) fn exe_head(pid: i32) -> io::Result<[u8; 64]> {
    let mut f = std::fs::File::open(proc(pid).join("exe"))?;
    let mut b = [0u8; 64];
    f.read_exact(&mut b)?;
    Ok(b)
}

/// What `kernel.yama.ptrace_scope` is set to, if the kernel has Yama.
pub(super) fn ptrace_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// A capability set of process `pid` (`CapEff`, `CapPrm`... of `/proc/PID/status`), if
/// readable.
pub(super) fn capabilities(pid: i32, which: &str) -> Option<u64> {
    let s = std::fs::read_to_string(proc(pid).join("status")).ok()?;
    let v = s
        .lines()
        .find_map(|l| l.strip_prefix(which)?.strip_prefix(':'))?;
    u64::from_str_radix(v.trim(), 16).ok()
}

/// Reads the process's memory: `process_vm_readv`, or `/proc/PID/mem` where that is refused
/// (a kernel without it). Returns how many bytes were read (fewer at an unmapped page).
pub(super) struct MemReader {
    pid: i32,
    mem_file: Option<std::fs::File>,
    vm_readv_works: bool,
}

impl MemReader {
    pub(super) fn new(pid: i32) -> MemReader {
        MemReader {
            pid,
            mem_file: None,
            vm_readv_works: true,
        }
    }

    pub(super) fn read(&mut self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        if self.vm_readv_works {
            let local = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            let remote = libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: buf.len(),
            };
            // SAFETY: `local` describes `buf`, which we own mutably for the call; the remote
            // range is only read by the kernel, which checks it.
            let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOSYS) {
                return Err(e);
            }
            self.vm_readv_works = false;
        }
        if self.mem_file.is_none() {
            self.mem_file = Some(std::fs::File::open(proc(self.pid).join("mem"))?);
        }
        let f = self.mem_file.as_ref().expect("opened above");
        f.read_at(buf, addr)
    }

    /// Reads pages `(address, buffer)` in one system call where it can: returns how many of
    /// them, from the first, were read whole (the kernel stops at the first that cannot be).
    pub(super) fn read_many(&mut self, reqs: &mut [(u64, &mut [u8])]) -> usize {
        if reqs.is_empty() {
            return 0;
        }
        if !self.vm_readv_works || reqs.len() == 1 {
            let mut n = 0;
            for (a, b) in reqs.iter_mut() {
                if !matches!(self.read(*a, b), Ok(k) if k == b.len()) {
                    break;
                }
                n += 1;
            }
            return n;
        }
        let mut local = Vec::with_capacity(reqs.len());
        let mut remote = Vec::with_capacity(reqs.len());
        for (a, b) in reqs.iter_mut() {
            local.push(libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            });
            remote.push(libc::iovec {
                iov_base: *a as *mut libc::c_void,
                iov_len: b.len(),
            });
        }
        // SAFETY: each local iovec describes a buffer of `reqs`, which we own mutably for the
        // call; the remote ranges are only read by the kernel, which checks them; the counts
        // are the vectors' lengths (the callers pass at most IOV_MAX).
        let n = unsafe {
            libc::process_vm_readv(
                self.pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return 0;
        }
        let mut left = n as usize;
        let mut whole = 0;
        for (_, b) in reqs.iter() {
            if left < b.len() {
                break;
            }
            left -= b.len();
            whole += 1;
        }
        whole
    }
}

/// The registers of a thread stopped in a system call, from `/proc/PID/task/TID/syscall`
/// (its stack pointer and program counter; no frame pointer): how a thread is read without
/// stopping it. `None` for a running thread.
pub(super) fn syscall_registers(pid: i32, tid: i32) -> Option<Registers> {
    let s = std::fs::read_to_string(proc(pid).join(format!("task/{tid}/syscall"))).ok()?;
    let f: Vec<&str> = s.split_whitespace().collect();
    if f.first() == Some(&"running") || f.len() < 3 {
        return None;
    }
    let hex = |v: &str| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok();
    let sp = hex(f[f.len() - 2])?;
    let pc = hex(f[f.len() - 1])?;
    Some(Registers { ip: pc, sp, fp: 0 })
}

/// Why stopping a process failed.
#[derive(Debug)]
pub(super) enum StopError {
    /// `ptrace` refused (EPERM).
    Permission,
    /// The process went away.
    Gone,
    /// Anything else.
    Other(io::Error),
}

/// The threads of a process, stopped (see the module doc); detached when dropped.
pub(super) struct Stopped {
    /// Each held thread, with the signal to give back at detach (0: none).
    held: Vec<(i32, i32)>,
}

/// How long one thread may take to report its stop.
const STOP_WAIT: Duration = Duration::from_secs(2);

impl Stopped {
    /// Stops every thread of `pid`.
    ///
    /// An exec in the process meanwhile kills its other threads and waits until each is
    /// reaped, holding a lock that `PTRACE_SEIZE` of any of its threads waits for: the
    /// threads already held die, and only their tracer (this process) reaps them. So while
    /// a seize waits, a second thread reaps the held threads that died (see [`Seizing`]):
    /// the exec goes on, and the seize ends (on the new program's thread, or `ESRCH`).
    /// Before, both processes hung, the target in state D. The main thread is seized first
    /// (after a thread-id wrap it sorts after others): a program that execs from it cannot
    /// start an exec once it is held.
    pub(super) fn all(pid: i32) -> Result<Stopped, StopError> {
        let s = Seizing {
            held: std::sync::Mutex::new(Vec::new()),
            since: AtomicU64::new(0),
            done: AtomicBool::new(false),
            t0: Instant::now(),
            pid,
            own_child: parent(pid) == Some(std::process::id() as i32),
        };
        let r = std::thread::scope(|scope| {
            // (Without the reaper, as before, if no thread can be made now.)
            let reaper = std::thread::Builder::new()
                .name("fibertrace-reap".into())
                .spawn_scoped(scope, || s.reap());
            let r = seize_all(pid, &s);
            s.done.store(true, Ordering::Release);
            if let Ok(h) = reaper {
                h.thread().unpark();
            }
            r
        });
        let held = std::mem::take(&mut *s.held.lock().unwrap_or_else(|e| e.into_inner()));
        let st = Stopped { held };
        r?;
        if st.held.is_empty() {
            return Err(StopError::Gone);
        }
        Ok(st)
    }

    /// The threads held, sorted.
    pub(super) fn threads(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self.held.iter().map(|(t, _)| *t).collect();
        v.sort_unstable();
        v
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &(tid, sig) in &self.held {
            release(tid, sig);
        }
    }
}

/// Lets go of thread `tid`, which this process traces, giving it back signal `sig` (0:
/// none). A thread that died meanwhile (the process was killed, or an exec killed it) cannot
/// be detached: it is reaped instead, or it would stay a zombie for as long as the thread
/// that seized it lives, and its process could not be waited for.
///
/// Except a process's main thread when this process is its parent (a test, a supervisor):
/// reaping it would take its exit status from this process's own `wait`, which reaps it.
fn release(tid: i32, sig: i32) {
    // SAFETY: detaching a thread we seized; `sig` is a signal that arrived while it was held.
    if unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, sig as libc::c_long) } == 0 {
        return;
    }
    if parent(tid) == Some(std::process::id() as i32) {
        return;
    }
    let t0 = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waiting, without blocking, on a thread this process traces.
        let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
        if r == tid && (libc::WIFEXITED(status) || libc::WIFSIGNALED(status)) {
            return;
        }
        // Not ours any more, or not dying after all (still stopped: it is detached then).
        if r < 0 || t0.elapsed() > Duration::from_millis(100) {
            // SAFETY: as above.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, sig as libc::c_long) };
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The stopping of a process under way (see [`Stopped::all`]).
struct Seizing {
    /// Each held thread, with the signal to give back at detach.
    held: std::sync::Mutex<Vec<(i32, i32)>>,
    /// When the seize under way began (ns since `t0`, at least 1), 0 while none is.
    since: AtomicU64,
    /// The stopping is over: the reaper ends.
    done: AtomicBool,
    t0: Instant,
    /// The process being stopped, and whether it is this process's child: its main thread's
    /// exit status is then this process's own `wait`'s to take (see [`release`]).
    pid: i32,
    own_child: bool,
}

/// How long a seize may wait before the held threads that died are reaped.
const SEIZE_PATIENCE: Duration = Duration::from_millis(20);

impl Seizing {
    fn now(&self) -> u64 {
        (self.t0.elapsed().as_nanos() as u64).max(1)
    }

    /// The reaper: while a seize has waited [`SEIZE_PATIENCE`], reaps the held threads that
    /// died (an exec killed them) and forgets them.
    fn reap(&self) {
        while !self.done.load(Ordering::Acquire) {
            std::thread::park_timeout(Duration::from_millis(5));
            let since = self.since.load(Ordering::Acquire);
            if since == 0 || self.now() - since < SEIZE_PATIENCE.as_nanos() as u64 {
                continue;
            }
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            held.retain(|&(tid, _)| {
                if self.own_child && tid == self.pid {
                    return true;
                }
                let mut status = 0;
                // SAFETY: waiting, without blocking, on a thread this process traces (a
                // stopped tracee reports nothing new but its death; `__WALL`: a thread).
                let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
                !(r == tid && (libc::WIFEXITED(status) || libc::WIFSIGNALED(status)))
            });
        }
    }
}

/// Seizes and stops every thread of `pid` into `s.held` (see [`Stopped::all`]).
fn seize_all(pid: i32, s: &Seizing) -> Result<(), StopError> {
    let held_any = || !s.held.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
    // Threads that could not be held (they ended, or were exiting): not tried again — an
    // exiting process's main thread stays listed until its parent waits for it.
    let mut passed: Vec<i32> = Vec::new();
    loop {
        let mut tids = match threads(pid) {
            Ok(t) => t,
            Err(_) if !held_any() => return Err(StopError::Gone),
            Err(_) => break,
        };
        // The main thread first.
        if let Some(i) = tids.iter().position(|&t| t == pid) {
            tids[..=i].rotate_right(1);
        }
        let new: Vec<i32> = {
            let held = s.held.lock().unwrap_or_else(|e| e.into_inner());
            tids.into_iter()
                .filter(|t| !held.iter().any(|(h, _)| h == t) && !passed.contains(t))
                .collect()
        };
        if new.is_empty() {
            break;
        }
        for tid in new {
            s.since.store(s.now(), Ordering::Release);
            // SAFETY: PTRACE_SEIZE with no options on a thread id; the kernel checks it.
            let rc = unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) };
            s.since.store(0, Ordering::Release);
            if rc != 0 {
                let e = io::Error::last_os_error();
                passed.push(tid);
                match e.raw_os_error() {
                    // It ended meanwhile.
                    Some(libc::ESRCH) => continue,
                    // An exiting thread refuses with EPERM too (the whole process exiting,
                    // or its threads killed by an exec): not a matter of permission.
                    Some(libc::EPERM) if exiting(pid, tid) => continue,
                    Some(libc::EPERM) if !held_any() => return Err(StopError::Permission),
                    _ if !held_any() => return Err(StopError::Other(e)),
                    _ => continue,
                }
            }
            // SAFETY: the thread is seized by us: PTRACE_INTERRUPT makes it stop.
            unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) };
            match wait_stop(pid, tid, s.own_child && tid == pid) {
                Some(sig) => s
                    .held
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((tid, sig)),
                None => {
                    // It exited (or did not stop in time): let it go.
                    passed.push(tid);
                    release(tid, 0);
                }
            }
        }
    }
    Ok(())
}

/// Whether thread `tid` of `pid` is exiting or gone (a zombie, dead, or no longer listed):
/// what `PTRACE_SEIZE`'s EPERM means then.
fn exiting(pid: i32, tid: i32) -> bool {
    match std::fs::read_to_string(proc(pid).join(format!("task/{tid}/stat"))) {
        Ok(stat) => matches!(parse_stat(&stat), Some(('Z' | 'X' | 'x', _))),
        Err(_) => true,
    }
}

/// Waits for a seized thread's stop. `Some(signal)`: stopped, with the signal that stopped it
/// to give back at detach (0 for our interrupt); `None`: it exited or did not stop in time.
/// `keep_exit`: the thread is the main one of this process's own child, whose exit status is
/// this process's own `wait`'s to take: only stops are waited for then (`waitid` without
/// `WEXITED`), and an exit is seen in `/proc`.
fn wait_stop(pid: i32, tid: i32, keep_exit: bool) -> Option<i32> {
    let t0 = Instant::now();
    let exits = if keep_exit { 0 } else { libc::WEXITED };
    loop {
        // SAFETY: siginfo_t is plain data; zeroes are a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waiting, without blocking, on a thread we trace, into a local siginfo.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                tid as libc::id_t,
                &mut info,
                libc::WSTOPPED | libc::WNOHANG | libc::__WALL | exits,
            )
        };
        if r < 0 {
            return None;
        }
        // SAFETY: filled by waitid (zero when nothing was waited for).
        let (who, status) = unsafe { (info.si_pid(), info.si_status()) };
        if who == tid {
            match info.si_code {
                libc::CLD_TRAPPED | libc::CLD_STOPPED => {
                    // Our interrupt (an event stop), or a group stop: nothing to give back;
                    // a signal on its way to the thread (it is stopped for it): given back.
                    let (sig, event) = (status & 0xff, (status >> 8) & 0xff);
                    return Some(if event == libc::PTRACE_EVENT_STOP {
                        0
                    } else {
                        sig
                    });
                }
                libc::CLD_EXITED | libc::CLD_KILLED | libc::CLD_DUMPED => return None,
                _ => {}
            }
        }
        if (keep_exit && exiting(pid, tid)) || t0.elapsed() > STOP_WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The registers of a thread we hold stopped.
pub(super) fn registers(tid: i32) -> io::Result<Registers> {
    user_regs(tid).map(|r| crate::arch::registers_from_user_regs(&r))
}

/// The general registers of thread `tid`, held stopped (see [`crate::arch::general_register`]).
pub(super) fn general_registers(tid: i32) -> io::Result<crate::arch::GeneralRegs> {
    user_regs(tid).map(|r| crate::arch::general_from_user_regs(&r))
}

fn user_regs(tid: i32) -> io::Result<libc::user_regs_struct> {
    // SAFETY: user_regs_struct is plain integers; zeroes are a valid value.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: (&mut regs as *mut libc::user_regs_struct).cast(),
        iov_len: std::mem::size_of::<libc::user_regs_struct>(),
    };
    // SAFETY: PTRACE_GETREGSET with NT_PRSTATUS fills at most `iov_len` bytes of `regs`, a
    // thread we hold stopped.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            tid,
            libc::NT_PRSTATUS as libc::c_long,
            &mut iov as *mut libc::iovec,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(regs)
}

#[cfg(test)]
mod tests {
    use super::parse_stat;

    #[test]
    fn stat_lines_give_the_state_and_the_kernel_thread_flag() {
        // kthreadd; a zombie whose name holds ") Z 1 (" (a name may hold any byte); a plain
        // sleeping process; a line cut short.
        let k = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 10";
        assert_eq!(parse_stat(k), Some(('S', true)));
        let z = "77 (a) Z 1 (b) Z 1 1 1 0 -1 4194316 0 0 0 0";
        assert_eq!(parse_stat(z), Some(('Z', false)));
        let s = "100 (sleep) S 99 100 99 34816 100 4194304 95 0 0 0 0";
        assert_eq!(parse_stat(s), Some(('S', false)));
        assert_eq!(parse_stat("5 (x) R 1 2"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
    }
}
