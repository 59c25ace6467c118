//! Linux/glibc leaf: `dladdr` for exported names of code without a usable file, and the
//! address space left under a limit.

/// The exported symbol containing `addr` and its start address, from the dynamic loader.
pub(super) fn dladdr_name(addr: u64) -> Option<(String, u64)> {
    // SAFETY: Dl_info is plain data that dladdr fills in; dladdr accepts any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid out-pointer for the call.
    let ok = unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) };
    if ok == 0 || info.dli_sname.is_null() {
        return None;
    }
    // SAFETY: dli_sname is a NUL-terminated string owned by the loader, valid while the
    // object stays loaded; we copy it at once.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_sname) }
        .to_string_lossy()
        .into_owned();
    Some((name, info.dli_saddr as u64))
}

/// Whether `addr` lies in an object the dynamic loader knows (the program, a library, the
/// vDSO): not in code generated at run time (a JIT's).
pub(super) fn in_loaded_object(addr: u64) -> bool {
    // SAFETY: Dl_info is plain data that dladdr fills in; dladdr accepts any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid out-pointer for the call.
    unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) != 0 }
}

/// The limit on open files (`RLIMIT_NOFILE`, soft), if any.
pub(super) fn open_files_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a struct of ours.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Whether an address-space limit (`RLIMIT_AS`) is set.
fn address_space_limited() -> bool {
    // SAFETY: getrlimit fills a struct of ours.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_AS, &mut r) == 0 && r.rlim_cur != libc::RLIM_INFINITY
    }
}

/// Takes `bytes` of address space (inaccessible, nothing committed) to give back later
/// ([`give_back`]): its start, or `None` (no address-space limit, where nothing needs it,
/// or no room).
pub(super) fn take_room(bytes: usize) -> Option<usize> {
    if bytes == 0 || !address_space_limited() {
        return None;
    }
    // SAFETY: a fresh private anonymous mapping, inaccessible; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// Gives back a mapping [`take_room`] made.
pub(super) fn give_back(start: usize, bytes: usize) {
    // SAFETY: `start..start + bytes` is a mapping `take_room` made and nothing uses.
    unsafe { libc::munmap(start as *mut libc::c_void, bytes) };
}

/// Whether `bytes` more of address space can be had now: always under no limit
/// (`RLIMIT_AS` unlimited); under one, a mapping of that size is made and given back (it
/// counts against the limit whatever its protection).
pub(super) fn address_space_room(bytes: usize) -> bool {
    // SAFETY: getrlimit fills a struct of ours.
    let unlimited = unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_AS, &mut r) != 0 || r.rlim_cur == libc::RLIM_INFINITY
    };
    if unlimited {
        return true;
    }
    // SAFETY: a fresh private anonymous mapping, inaccessible, unmapped at once; nothing
    // else refers to it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return false;
        }
        libc::munmap(p, bytes);
    }
    true
}
