//! `os.execute`, as the Lua library's own (the C library's `system()`: `/bin/sh -c`, the
//! caller ignoring SIGINT and blocking SIGCHLD until the command ends, the same results) with
//! one difference: while the command runs, a process that *handles* SIGQUIT keeps handling it.
//! `system()` ignores SIGQUIT in the caller until the command ends, so the dump a user asked
//! for with SIGQUIT while a fiber waited in `os.execute` — the very fiber that is stuck — was
//! lost (a signal ignored is discarded, not delayed). A process that does not handle SIGQUIT
//! (its default action, or ignored) runs the C library's `system()` itself: nothing changes
//! for it.
//!
//! Results, as each flavour's own: LuaJIT (Lua 5.1) gives the wait status as a number
//! (`os.execute("exit 3")` is 768; a command killed by signal 9 gives 9); Lua 5.4 gives
//! `true|nil, "exit"|"signal", code`. With no command: whether a shell is there (LuaJIT: the
//! C library's nonzero number; 5.4: a boolean). A command that cannot be started gives what
//! `system()` gives then (127 as the exit code of a shell that could not run).
//!
//! How it can differ from `system()`: nothing else is changed in the child (its signal mask is
//! the caller's, SIGINT and SIGQUIT at their default action, as `system()` makes them); two
//! commands run at once from two threads share one SIGINT disposition, saved by the first
//! and restored by the last (as glibc does).

use std::ffi::{c_char, c_int, CStr, CString};

use super::call::lua_fn;
use super::call::Call;
use super::raw::LResult;

/// `os.execute([command])` (see the module doc).
pub(super) fn execute_body(c: &mut Call) -> LResult {
    let cmd: Option<Vec<u8>> = match c.type_of(1) {
        t if t <= mlua::ffi::LUA_TNIL => None,
        mlua::ffi::LUA_TSTRING => c.string_bytes(1),
        // A number is taken as Lua writes it (as `luaL_optstring` converts it).
        mlua::ffi::LUA_TNUMBER => Some(c.value_bytes(1)),
        _ => return Err(c.type_error(1, "string")),
    };
    let Some(cmd) = cmd else {
        let shell = system(None);
        #[cfg(feature = "luajit")]
        c.push_int(shell as i64)?;
        #[cfg(not(feature = "luajit"))]
        c.push_bool(shell != 0)?;
        return Ok(1);
    };
    // The C string stops at the first NUL, as the C function's argument does.
    let end = cmd.iter().position(|&b| b == 0).unwrap_or(cmd.len());
    let cmd = CString::new(&cmd[..end]).unwrap_or_default();
    let stat = system(Some(&cmd));
    #[cfg(feature = "luajit")]
    {
        c.push_int(stat as i64)?;
        Ok(1)
    }
    #[cfg(not(feature = "luajit"))]
    {
        // Lua 5.4's `luaL_execresult`.
        if stat == -1 {
            let e = std::io::Error::last_os_error();
            c.push_nil()?;
            c.push_str(&e.to_string())?;
            c.push_int(e.raw_os_error().unwrap_or(0) as i64)?;
            return Ok(3);
        }
        let (what, code) = if libc::WIFEXITED(stat) {
            ("exit", libc::WEXITSTATUS(stat))
        } else if libc::WIFSIGNALED(stat) {
            ("signal", libc::WTERMSIG(stat))
        } else {
            ("exit", stat)
        };
        if what == "exit" && code == 0 {
            c.push_bool(true)?;
        } else {
            c.push_nil()?;
        }
        c.push_str(what)?;
        c.push_int(code as i64)?;
        Ok(3)
    }
}
lua_fn!(f_execute, execute_body);

/// Whether this process handles SIGQUIT (a handler, not the default action or ignored).
fn handles_sigquit() -> bool {
    // SAFETY: a query of the disposition (no new action); `old` is written by the call.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGQUIT, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction != libc::SIG_DFL
            && old.sa_sigaction != libc::SIG_IGN
    }
}

/// The wait status of `/bin/sh -c cmd` (see the module doc); `None`: whether a shell is there.
fn system(cmd: Option<&CStr>) -> c_int {
    match cmd {
        // SAFETY: `system(NULL)` asks whether a shell is there; no pointer is kept.
        None => unsafe { libc::system(std::ptr::null()) },
        // SAFETY: a NUL-terminated command, read during the call only.
        Some(cmd) if !handles_sigquit() => unsafe { libc::system(cmd.as_ptr()) },
        Some(cmd) => spawn_and_wait(cmd),
    }
}

/// Threads running a command now, and the SIGINT disposition the first one found.
static RUNNING: std::sync::Mutex<(usize, Option<libc::sigaction>)> =
    std::sync::Mutex::new((0, None));

// The C library's environment of this process (POSIX `environ`): the spawned shell gets it,
// as `system()`'s does. Read only as the spawn's argument, never through Rust's `std::env`
// (whose writers take a lock the C library does not know of: a `set_var` on another thread
// during a spawn is the same race `system()` has).
unsafe extern "C" {
    static environ: *const *mut c_char;
}

/// `system(cmd)` with SIGQUIT left as it is (see the module doc).
fn spawn_and_wait(cmd: &CStr) -> c_int {
    // SIGINT ignored while any command runs (the first saves its disposition, the last puts it
    // back).
    let old_int = {
        let mut r = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
        if r.0 == 0 {
            // SAFETY: a new disposition (ignore) for SIGINT and the old one written to `old`;
            // both structures are plain data.
            unsafe {
                let mut ign: libc::sigaction = std::mem::zeroed();
                ign.sa_sigaction = libc::SIG_IGN;
                libc::sigemptyset(&mut ign.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                libc::sigaction(libc::SIGINT, &ign, &mut old);
                r.1 = Some(old);
            }
        }
        r.0 += 1;
        r.1
    };
    // SAFETY: signal sets and spawn attributes are initialized by their functions before
    // use and destroyed after; the argument vector holds NUL-terminated strings that outlive
    // the spawn; `environ` is the process's environment, read by the spawn only.
    let status = unsafe {
        let mut chld: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut chld);
        libc::sigaddset(&mut chld, libc::SIGCHLD);
        let mut mask: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &chld, &mut mask);
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        libc::posix_spawnattr_init(&mut attr);
        let mut def: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut def);
        if old_int.is_some_and(|o| o.sa_sigaction != libc::SIG_IGN) {
            libc::sigaddset(&mut def, libc::SIGINT);
        }
        libc::sigaddset(&mut def, libc::SIGQUIT);
        libc::posix_spawnattr_setsigdefault(&mut attr, &def);
        libc::posix_spawnattr_setsigmask(&mut attr, &mask);
        libc::posix_spawnattr_setflags(
            &mut attr,
            (libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK) as libc::c_short,
        );
        let argv: [*mut c_char; 4] = [
            c"sh".as_ptr().cast_mut(),
            c"-c".as_ptr().cast_mut(),
            cmd.as_ptr().cast_mut(),
            std::ptr::null_mut(),
        ];
        let mut pid: libc::pid_t = 0;
        let rc = libc::posix_spawn(
            &mut pid,
            c"/bin/sh".as_ptr(),
            std::ptr::null(),
            &attr,
            argv.as_ptr(),
            environ,
        );
        libc::posix_spawnattr_destroy(&mut attr);
        let status = if rc != 0 {
            // As `system()`: a shell that could not run exits with 127.
            127 << 8
        } else {
            let mut st: c_int = 0;
            loop {
                if libc::waitpid(pid, &mut st, 0) != -1 {
                    break st;
                }
                if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    break -1;
                }
                // A signal this process handles (a SIGQUIT dump) interrupted the wait.
            }
        };
        libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut());
        status
    };
    let mut r = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
    r.0 -= 1;
    if r.0 == 0 {
        if let Some(old) = r.1.take() {
            // SAFETY: puts back the disposition saved by the first command.
            unsafe { libc::sigaction(libc::SIGINT, &old, std::ptr::null_mut()) };
        }
    }
    status
}
