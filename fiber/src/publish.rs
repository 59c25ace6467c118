//! The fiber registry as another process reads it: `fibertrace dump PID` finds every fiber
//! of a process that uses this runtime without running its code.
//!
//! The process carries one [`Header`] in an ELF section of its own, `.fibertrace.registry`
//! (kept by `#[used]` and found by a reader in the executable's section table — no symbol,
//! no debug info needed, so a stripped build is read too). The header has a magic, a version,
//! the size of each structure and the offset of every field a reader needs, computed by the
//! compiler (`offset_of!`), and the address of the scheduler table. A reader walks:
//!
//! ```text
//! Header.schedulers ─→ [*SchedShared; SCHED_SLOTS]      (null: a free slot)
//!   SchedShared ─→ id, name, thread, running fiber, slab (chunk directory, length)
//!     chunk directory ─→ [*chunk; n] ─→ [*ControlBlock; CHUNK]   (null: a free slot)
//!       ControlBlock ─→ id, name, parent, run state, status, what it waits on and since
//!                       when (counter ticks), switch count, saved registers, stack bounds,
//!                       its entry's stack pointer, the layer's word (a Lua thread)
//! ```
//!
//! Version 1's meanings: run state `0` new, `1` running, `2` suspended, `3` being inspected,
//! `4` dead; status as `Status::to_u8`; the wait word as `WaitOn::pack` (kind in the low 3
//! bits: 1 sleep, 2 channel receive, 3 channel send, 4 condition, 5 join, 6 wake-up; the
//! object's id above); times in ticks of the CPU's counter (shared by every process of the
//! machine), `ps_per_tick` picoseconds each. A change of meaning raises the version; fields
//! only added leave it (the sizes say where they end).
//!
//! Torn records: the registers of a suspended fiber are written before its run state says
//! suspended (release), and its switch count moves at every switch: a reader that does not
//! stop the process reads the switch count and the run state before and after the record,
//! and keeps it only when both are unchanged and the state is suspended. With the process
//! stopped (the default), a thread stopped in the middle of a switch leaves its fiber
//! `running`: the thread's own stack shows it.
//!
//! Cost: nothing on a switch; a scheduler's creation and end write one slot of the table;
//! a fiber's name and parent are kept as plain words beside Rust's own layouts (24 bytes per
//! fiber). More schedulers than the table has slots are not published (counted).

use std::mem::offset_of;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use crate::registry::{FiberSlab, SchedPublished, SchedShared};
use crate::running::OnThread;
use crate::task::{ControlBlock, Published, RunCell};

/// The magic at the start of the header.
pub const MAGIC: [u8; 16] = *b"fibertrace-reg\0\0";
/// The version of the layout's meanings (see the module doc).
pub const VERSION: u32 = 1;
/// Schedulers published at once.
pub const SCHED_SLOTS: usize = 256;

/// Where a scheduler's published fields are, from its `SchedShared`.
#[repr(C)]
#[derive(Debug)]
pub struct SchedOffsets {
    /// `size_of::<SchedShared>()`.
    pub size: u32,
    /// `u64` id.
    pub id: u32,
    /// `u64` pointer to its name's bytes, and `u64` length.
    pub name_ptr: u32,
    pub name_len: u32,
    /// `i32` kernel id of its thread (0 before it ran).
    pub tid: u32,
    /// `u64` id of the fiber running now (0: none).
    pub running: u32,
    /// `u64` pointer to its slab's chunk directory (`u64` pointers to chunks of
    /// [`Header::chunk_slots`] `u64` pointers to control blocks), and `u64` length of the
    /// directory.
    pub chunk_dir: u32,
    pub chunk_count: u32,
    /// `u64` slots handed out (a reader scans `[0, len)`).
    pub len: u32,
}

/// Where a fiber's published fields are, from its control block.
#[repr(C)]
#[derive(Debug)]
pub struct FiberOffsets {
    /// `size_of::<ControlBlock>()`.
    pub size: u32,
    /// `u64` id.
    pub id: u32,
    /// `u64` pointer to the name's bytes, `u64` length.
    pub name_ptr: u32,
    pub name_len: u32,
    /// `u64` creator's fiber id (0: none).
    pub parent: u32,
    /// `u8` run state.
    pub run: u32,
    /// `u8` status.
    pub status: u32,
    /// `u64` packed wait.
    pub wait_on: u32,
    /// `u64` ticks when the status began.
    pub since: u32,
    /// `u64` switch count.
    pub csw: u32,
    /// `u64` saved instruction, stack and frame pointers (valid while suspended).
    pub ip: u32,
    pub sp: u32,
    pub fp: u32,
    /// `u64` lowest and highest address of its stack.
    pub stack_lo: u32,
    pub stack_hi: u32,
    /// `u64` stack pointer of the runtime's entry frame (walks end below it; 0 before it
    /// started).
    pub entry_sp: u32,
    /// `u64` the layer's word (a Lua host: the fiber's `lua_State`).
    pub layer_word: u32,
    /// `u64` ticks at its creation.
    pub created: u32,
}

/// The header a reader finds in `.fibertrace.registry` (see the module doc).
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: [u8; 16],
    /// [`VERSION`].
    pub version: u32,
    /// `size_of::<Header>()`.
    pub header_size: u32,
    /// `size_of::<usize>()` of the writer.
    pub pointer_size: u32,
    /// Slots of the scheduler table.
    pub sched_slots: u32,
    /// Control-block pointers per chunk of a slab.
    pub chunk_slots: u32,
    /// (Padding, zero.)
    pub reserved: u32,
    /// The scheduler table: [`SCHED_SLOTS`] pointers to `SchedShared` (null: free).
    pub schedulers: &'static [AtomicPtr<SchedShared>; SCHED_SLOTS],
    /// Schedulers not published (the table was full).
    pub unpublished: &'static AtomicU64,
    /// Picoseconds per counter tick (0 until measured).
    pub ps_per_tick: &'static AtomicU64,
    /// The scheduler's fields.
    pub sched: SchedOffsets,
    /// A fiber's fields.
    pub fiber: FiberOffsets,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: AtomicPtr<SchedShared> = AtomicPtr::new(std::ptr::null_mut());
static TABLE: [AtomicPtr<SchedShared>; SCHED_SLOTS] = [EMPTY; SCHED_SLOTS];
static UNPUBLISHED: AtomicU64 = AtomicU64::new(0);

const fn o(v: usize) -> u32 {
    v as u32
}

/// The header, in a section of its own (see the module doc).
#[used]
#[link_section = ".fibertrace.registry"]
pub static HEADER: Header = Header {
    magic: MAGIC,
    version: VERSION,
    header_size: o(std::mem::size_of::<Header>()),
    pointer_size: o(std::mem::size_of::<usize>()),
    sched_slots: SCHED_SLOTS as u32,
    chunk_slots: crate::registry::CHUNK as u32,
    reserved: 0,
    schedulers: &TABLE,
    unpublished: &UNPUBLISHED,
    ps_per_tick: &crate::clock::PS_PER_TICK,
    sched: SchedOffsets {
        size: o(std::mem::size_of::<SchedShared>()),
        id: o(offset_of!(SchedShared, id)),
        name_ptr: o(offset_of!(SchedShared, published) + offset_of!(SchedPublished, name_ptr)),
        name_len: o(offset_of!(SchedShared, published) + offset_of!(SchedPublished, name_len)),
        tid: o(offset_of!(SchedShared, on_thread) + offset_of!(OnThread, tid)),
        running: o(offset_of!(SchedShared, on_thread) + offset_of!(OnThread, running)),
        chunk_dir: o(offset_of!(SchedShared, published) + offset_of!(SchedPublished, chunk_dir)),
        chunk_count: o(offset_of!(SchedShared, published) + offset_of!(SchedPublished, chunk_count)),
        len: o(offset_of!(SchedShared, fibers) + offset_of!(FiberSlab, len)),
    },
    fiber: FiberOffsets {
        size: o(std::mem::size_of::<ControlBlock>()),
        id: o(offset_of!(ControlBlock, id)),
        name_ptr: o(offset_of!(ControlBlock, published) + offset_of!(Published, name_ptr)),
        name_len: o(offset_of!(ControlBlock, published) + offset_of!(Published, name_len)),
        parent: o(offset_of!(ControlBlock, published) + offset_of!(Published, parent)),
        run: o(offset_of!(ControlBlock, run) + offset_of!(RunCell, state)),
        status: o(ControlBlock::STATUS_OFFSET),
        wait_on: o(ControlBlock::WAIT_ON_OFFSET),
        since: o(offset_of!(ControlBlock, since)),
        csw: o(offset_of!(ControlBlock, csw)),
        ip: o(ControlBlock::CTX_OFFSET
            + offset_of!(fibertrace_core::SavedContext, regs)
            + offset_of!(fibertrace_core::arch::Registers, ip)),
        sp: o(ControlBlock::CTX_OFFSET
            + offset_of!(fibertrace_core::SavedContext, regs)
            + offset_of!(fibertrace_core::arch::Registers, sp)),
        fp: o(ControlBlock::CTX_OFFSET
            + offset_of!(fibertrace_core::SavedContext, regs)
            + offset_of!(fibertrace_core::arch::Registers, fp)),
        stack_lo: o(offset_of!(ControlBlock, stack) + offset_of!(fibertrace_core::StackBounds, lo)),
        stack_hi: o(offset_of!(ControlBlock, stack) + offset_of!(fibertrace_core::StackBounds, hi)),
        entry_sp: o(offset_of!(ControlBlock, entry_sp)),
        layer_word: o(offset_of!(ControlBlock, layer_word)),
        created: o(offset_of!(ControlBlock, created)),
    },
};

/// Puts a new scheduler in the table (a free slot; counted as unpublished when full).
pub(crate) fn add(s: &SchedShared) {
    // A reference the linker sees: a section nothing refers to may be dropped by
    // `--gc-sections`, `#[used]` or not.
    std::hint::black_box(&HEADER);
    let p = s as *const SchedShared as *mut SchedShared;
    for slot in &TABLE {
        if slot
            .compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
    UNPUBLISHED.fetch_add(1, Ordering::Relaxed);
}

/// Takes a scheduler out of the table (it is being dropped).
pub(crate) fn remove(s: &SchedShared) {
    let p = s as *const SchedShared as *mut SchedShared;
    for slot in &TABLE {
        if slot
            .compare_exchange(p, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}
