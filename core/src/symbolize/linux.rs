//! Linux/glibc leaf: `dladdr` for exported names of code without a usable file.

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
