//! Linux/glibc leaf: the loaded objects, read from the dynamic loader with `dl_iterate_phdr`.
//!
//! Everything here reads program headers and memory the loader reports as mapped. A library
//! unloaded (`dlclose`) between the listing and a later read of its memory would make that read
//! fault; we copy what we keep (eh_frame bytes, build id) while we hold the loader's lock inside
//! the callback, so nothing is read from a library's memory after the listing returns.

use std::ffi::CStr;

use super::RawImage;

/// Lists every loaded object with its segments, build id and unwind tables, copying the
/// bytes it keeps. Also returns the loader's (adds, subs) counters.
pub(super) fn list_images() -> (Vec<RawImage>, (u64, u64)) {
    struct Acc {
        images: Vec<RawImage>,
        counters: (u64, u64),
    }
    unsafe extern "C" fn callback(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the `&mut Acc` passed to dl_iterate_phdr below, alive for the call;
        // `info` is valid for the duration of this callback as the loader documents.
        let acc = unsafe { &mut *(data as *mut Acc) };
        // SAFETY: as above; the loader hands a valid dl_phdr_info of at least `size` bytes.
        let info = unsafe { &*info };
        if size >= std::mem::size_of::<libc::dl_phdr_info>() {
            acc.counters = (info.dlpi_adds, info.dlpi_subs);
        }
        // SAFETY: dlpi_phdr points at dlpi_phnum program headers of a loaded object.
        let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        let name = if info.dlpi_name.is_null() {
            String::new()
        } else {
            // SAFETY: dlpi_name is a NUL-terminated string owned by the loader.
            unsafe { CStr::from_ptr(info.dlpi_name) }
                .to_string_lossy()
                .into_owned()
        };
        acc.images.push(read_image(info.dlpi_addr, name, phdrs));
        0
    }
    let mut acc = Acc {
        images: Vec::new(),
        counters: (0, 0),
    };
    // SAFETY: the callback only reads loader-provided structures and writes into `acc`.
    unsafe {
        libc::dl_iterate_phdr(Some(callback), &mut acc as *mut Acc as *mut libc::c_void);
    }
    (acc.images, acc.counters)
}

fn read_image(bias: u64, name: String, phdrs: &[libc::Elf64_Phdr]) -> RawImage {
    let mut img = RawImage {
        path: name,
        bias,
        start: u64::MAX,
        end: 0,
        exec: Vec::new(),
        build_id: None,
        eh_frame_hdr: None,
        eh_frame: None,
    };
    let mut loads: Vec<(u64, u64)> = Vec::new();
    for ph in phdrs {
        match ph.p_type {
            libc::PT_LOAD => {
                let s = bias.wrapping_add(ph.p_vaddr);
                let e = s.wrapping_add(ph.p_memsz);
                img.start = img.start.min(s);
                img.end = img.end.max(e);
                loads.push((s, e));
                if ph.p_flags & libc::PF_X != 0 {
                    img.exec.push((s, e));
                }
            }
            libc::PT_NOTE if img.build_id.is_none() => {
                let s = bias.wrapping_add(ph.p_vaddr);
                // SAFETY: a PT_NOTE segment of a loaded object lies inside a mapped PT_LOAD
                // segment (it is part of the loaded image), readable for p_filesz bytes.
                let notes =
                    unsafe { std::slice::from_raw_parts(s as *const u8, ph.p_filesz as usize) };
                img.build_id = super::parse_build_id_notes(notes);
            }
            _ => {}
        }
    }
    if img.start == u64::MAX {
        img.start = 0;
    }
    for ph in phdrs {
        if ph.p_type == libc::PT_GNU_EH_FRAME {
            let hdr = bias.wrapping_add(ph.p_vaddr);
            let len = ph.p_memsz as usize;
            if loads
                .iter()
                .any(|&(s, e)| hdr >= s && hdr + len as u64 <= e)
            {
                // SAFETY: the range was just checked to lie inside a loaded PT_LOAD segment.
                let bytes = unsafe { std::slice::from_raw_parts(hdr as *const u8, len) }.to_vec();
                img.eh_frame_hdr = Some((hdr, bytes));
            }
        }
    }
    if let Some((hdr_addr, hdr)) = &img.eh_frame_hdr {
        if let Some(eh) = super::eh_frame_start(*hdr_addr, hdr) {
            if let Some(&(_, seg_end)) = loads.iter().find(|&&(s, e)| eh >= s && eh < e) {
                // SAFETY: [eh, seg_end) lies inside one loaded PT_LOAD segment of the object.
                let mem =
                    unsafe { std::slice::from_raw_parts(eh as *const u8, (seg_end - eh) as usize) };
                let len = super::eh_frame_len(mem);
                img.eh_frame = Some((eh, mem[..len].to_vec()));
            }
        }
    }
    img
}

/// The path of the main executable (the loader reports it with an empty name).
pub(super) fn exe_path() -> Option<String> {
    std::fs::read_link("/proc/self/exe")
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// The loader's (adds, subs) counters, read from the first object only: a cheap way to learn
/// whether the list changed.
pub(super) fn loader_counters() -> (u64, u64) {
    unsafe extern "C" fn callback(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        if size >= std::mem::size_of::<libc::dl_phdr_info>() {
            // SAFETY: `info` is valid during the callback and large enough (checked);
            // `data` is the `&mut (u64, u64)` passed below.
            unsafe {
                let info = &*info;
                *(data as *mut (u64, u64)) = (info.dlpi_adds, info.dlpi_subs);
            }
        }
        1 // stop after the first object
    }
    let mut c = (0u64, 0u64);
    // SAFETY: the callback writes only into `c`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(
            Some(callback),
            &mut c as *mut (u64, u64) as *mut libc::c_void,
        );
    }
    c
}
