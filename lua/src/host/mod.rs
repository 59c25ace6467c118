//! The Lua host: one Lua state whose fibers are fibertrace fibers, with Tarantool's `fiber`
//! and `clock` modules, `fiber.info()` with interleaved native and Lua backtraces, and the
//! script runner behind `fibertrace run`.
//!
//! Model: every Lua fiber is a [`fibertrace_fiber`] fiber (a corosensei coroutine with its own
//! native stack) that runs its own Lua *thread* with `lua_pcall`. A switch is native: the Lua
//! thread simply stays inside the C function that switched (`fiber.sleep`, `channel:get`, …),
//! so a fiber may switch anywhere — in a `table.sort` comparator, a metamethod, under `pcall`,
//! inside a Lua coroutine. Lua's `coroutine.yield` at a fiber's top level is an error, as in
//! Tarantool (the fiber's function is called, not resumed).
//!
//! Invariants:
//! * one host per OS thread (its state is thread-local); every Lua-visible function is a raw
//!   `lua_CFunction` (`raw`) that never raises from a frame owning Rust values;
//! * the module's functions never go through mlua's callback machinery, so mlua's notion of
//!   the "current state" is not disturbed by switches made by the module;
//! * a fiber's Lua thread is anchored in the registry while the fiber lives (and, for a
//!   joinable fiber, until it is joined), and is only read from other fibers through the
//!   debug API while it is suspended (same OS thread, so it cannot run meanwhile);
//! * a `__gc` finalizer never switches fibers: inside one, the fiber functions that would
//!   switch raise an error, and `fiber.create` starts its fiber at the next switch
//!   (`finalize`); no host state is borrowed across a Lua allocation (which can run
//!   finalizers that use the host);
//! * suspended fibers are never dropped with Lua frames on their stacks: dropping the host
//!   cancels them and runs them to their end first (pitfall 2 of `notes/lua.md`); a fiber that
//!   refuses to end is leaked with the Lua state.
//!
//! How results can be wrong or surprising:
//! * an mlua callback (a Rust function made with `Lua::create_function`) that calls Lua code
//!   which switches fibers sees, after the call returns, mlua's "current state" as the
//!   fiber that switched last left it. This is harmless unless another fiber is itself
//!   switched out inside such a callback at the same time; then mlua reads the call's results
//!   from the wrong Lua thread. Raw C functions (as this module's) have no such problem;
//! * traces are as exact as [`crate::interleave`](mod@crate::interleave) makes them.

use std::cell::RefCell;
use std::ffi::c_int;

use fibertrace_fiber::{FiberId, Scheduler, SchedulerOptions};
use mlua::ffi;

mod call;
mod channel;
mod clock;
mod cond;
#[cfg(feature = "luajit")]
mod cstack;
mod execute;
mod export;
mod fiber_fns;
mod finalize;
mod hog;
pub use hog::{exempt_from_halt, halt};
mod holds;
mod info;
#[doc(hidden)]
pub use info::{set_lua_level_memo, with_failed_main};
mod install;
mod objects;
mod prelude;
mod raw;
mod recs;
mod slice;
mod spawn;

/// A fiber slice (Tarantool's `{warn = seconds, err = seconds}`): a fiber that runs longer
/// than `warn` without yielding is warned about when it calls `fiber.check_slice()`, and
/// longer than `err` fails there. [`Slice::INFINITE`] parts never trigger.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Slice {
    pub warn: f64,
    pub err: f64,
}

impl Slice {
    /// Tarantool's `TIMEOUT_INFINITY` (100 years): a part this long or longer never triggers.
    pub const INFINITE: f64 = 100.0 * 365.0 * 86400.0;
    /// No limit.
    pub const NONE: Slice = Slice {
        warn: Slice::INFINITE,
        err: Slice::INFINITE,
    };
}

/// The Lua side of a fiber: what the host keeps for each fiber that runs Lua (the fiber
/// itself is `fibertrace_fiber::Fiber`; its control block, `ControlBlock`).
pub(crate) struct LuaFiber {
    pub fiber: fibertrace_fiber::Fiber,
    /// The fiber's own Lua thread (the root of its Lua activity).
    pub thread: *mut ffi::lua_State,
    pub thread_ref: c_int,
    pub joinable: bool,
    /// Joins waiting for it now.
    pub joiners: u32,
    /// Set when its function returned: `Some(true)` success, `Some(false)` error; results (or
    /// the error) stay on the thread's stack from index 2 until joined. A joinable fiber with
    /// an outcome is "ended": still found (as Tarantool finds a dead fiber nobody joined yet)
    /// until joined.
    pub done: Option<bool>,
    /// The fiber's last interleaved trace and its context-switch count then: a fiber that
    /// has not run since has the same trace (see [`info`]).
    pub trace_cache: Option<(u64, std::rc::Rc<[fibertrace_core::Frame]>)>,
    /// Whether the fiber keeps its creator's trace (it was made with parent backtraces on):
    /// a listing reads it from the control block only then (a line of its own there).
    pub parent_bt: bool,
    /// Slot of the fiber's Lua object in the host's object table once made (0 before).
    pub obj_slot: c_int,
    /// Registry reference of its `storage` table (0: none yet); released when its function
    /// ends.
    pub storage_ref: c_int,
    /// Its own max slice (`fiber_object:set_max_slice`), if set.
    pub max_slice: Option<Slice>,
    /// Its `fiber.top()` figures when it ended joinable with accounting on: its row while it
    /// waits for its join (boxed: most records never have one).
    pub ended_top: Option<Box<fibertrace_fiber::embed::EndedTop>>,
}

/// The host's per-thread state.
pub(crate) struct HostState {
    pub main_l: *mut ffi::lua_State,
    pub recs: recs::Recs,
    pub parent_backtrace: bool,
    /// Finished Lua threads, ready for reuse (only the message handler on the stack), with
    /// their registry refs.
    pub pool: Vec<(*mut ffi::lua_State, c_int)>,
    /// Registry ref: the table of Lua functions that make `fiber.info()`'s entries.
    pub info_ctor_ref: c_int,
    /// Their identities (`lua_topointer`) when the host made them: a listing calls only
    /// these (a script reaches the table through `debug.getregistry()`).
    pub info_ctor_ids: Vec<usize>,
    /// Registry ref: the metatable of `fiber.info()`'s result (`{__serialize = 'mapping'}`).
    pub info_mt_ref: c_int,
    /// Registry ref: `make_error(type, value)`, the constructor of error objects (see
    /// [`prelude`]).
    pub error_ctor_ref: c_int,
    /// Registry ref: live fibers' objects by slot (and the objects made ahead for the next
    /// fibers, see `obj_ready`); free slots; the highest slot used.
    pub objs_ref: c_int,
    /// Registry ref: objects of fibers without a record, by id (weak values).
    pub weak_objs_ref: c_int,
    pub obj_free: Vec<c_int>,
    pub obj_next: c_int,
    /// Slots of the object table that hold an object made ahead for the next fibers made by
    /// `fiber.create`/`fiber.new` (id 0, never given to Lua: see
    /// `spawn::take_ready_object`).
    pub obj_ready: Vec<c_int>,
    /// Fibers whose record was removed while joins waited for them: how many of those joins
    /// have yet to wake, and why the record went (what each is told).
    pub lost_joins: std::collections::HashMap<FiberId, (u32, &'static str)>,
    /// Registry refs: metatables.
    pub fiber_mt_ref: c_int,
    pub channel_mt_ref: c_int,
    pub cond_mt_ref: c_int,
    /// The identities (`lua_topointer`) of the fiber, channel and condition metatables,
    /// anchored by the references above for the host's life.
    pub mt_tables: [usize; 3],
    /// Print errors of fibers nobody joins (to stderr).
    pub report_errors: bool,
    /// The name of fibers made by `fiber.create`/`fiber.new` ("lua", as Tarantool's), shared.
    pub fiber_name: std::sync::Arc<str>,
    /// The default max slice (`fiber.set_max_slice(slice)`).
    pub default_slice: Slice,
    /// The slice of the current run of a fiber, once set or checked in that run: the run
    /// (fiber id, switch count when it began) and its slice. A slice of another run is stale:
    /// a new run starts with the fiber's max slice (no work per switch).
    pub run_slice: Option<((FiberId, u64), Slice)>,
    /// The stall detector was started by `fiber.set_max_slice` (not by the program).
    pub watchdog_by_slice: bool,
    /// `channel:close()` keeps queued values (compat `fiber_channel_close_mode = 'new'`).
    pub graceful_close: bool,
}

impl HostState {
    /// Releases the registry reference `r` of this host (a message's value, a storage table).
    pub(crate) fn unref(&self, r: c_int) {
        // SAFETY: `main_l` is this host's main state, open while the `HostState` exists (the
        // host closes it only after taking the state out of `HOST`); luaL_unref stores into
        // the registry's free-list slot made at install (`install_protect`), so it neither
        // allocates nor raises, and runs no Lua code.
        unsafe { ffi::luaL_unref(self.main_l, ffi::LUA_REGISTRYINDEX, r) };
    }

    /// Sets `t[n] = nil` for the host table at the registry reference `t` (an object slot).
    pub(crate) fn clear_index(&self, t: c_int, n: ffi::lua_Integer) {
        // SAFETY: the main state as in `unref`, with room for the 2 values pushed (asked
        // for; without it nothing is done) and popped; a raw store of nil into a slot of a
        // host table (checked to be one) allocates nothing.
        unsafe {
            let l = self.main_l;
            if ffi::lua_checkstack(l, 3) == 0 {
                return;
            }
            raw::rawgeti(l, ffi::LUA_REGISTRYINDEX, t as ffi::lua_Integer);
            if ffi::lua_type(l, -1) == ffi::LUA_TTABLE {
                ffi::lua_pushnil(l);
                raw::rawseti(l, -2, n);
            }
            ffi::lua_settop(l, -2);
        }
    }
}

thread_local! {
    static HOST: RefCell<Option<HostState>> = const { RefCell::new(None) };
    /// The interleaved trace of the last error caught by a fiber's message handler.
    static LAST_TRACE: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The frames of [`LAST_TRACE`], as the message handler took them.
    static LAST_FRAMES: RefCell<Vec<fibertrace_core::Frame>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with the host state of this thread (`None`: no host, or already borrowed).
pub(crate) fn with_host<R>(f: impl FnOnce(&mut HostState) -> R) -> Option<R> {
    HOST.with(|h| {
        let mut g = h.try_borrow_mut().ok()?;
        g.as_mut().map(f)
    })
}

/// A script's failure: its error message and the interleaved traceback at the error.
#[derive(Clone, Debug)]
pub struct ScriptError {
    /// The error value as text (as `lua` shows it: a value with `__tostring` as that
    /// returns; bytes that are not UTF-8 replaced, see `message_bytes`).
    pub message: String,
    /// The same message as its bytes, exactly.
    pub message_bytes: Vec<u8>,
    /// The trace at the point of the error, Tarantool's format, one frame a line.
    pub traceback: String,
}

impl std::fmt::Display for ScriptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.traceback.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}\nstack traceback:\n{}", self.message, self.traceback)
        }
    }
}

impl std::error::Error for ScriptError {}

impl ScriptError {
    /// An error of the host's own (no traceback).
    pub(crate) fn text(message: String) -> ScriptError {
        ScriptError {
            message_bytes: message.clone().into_bytes(),
            message,
            traceback: String::new(),
        }
    }

    /// The error as `lua` prints it, as bytes: the message exactly, then the traceback.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self.message_bytes.clone();
        if !self.traceback.is_empty() {
            v.extend_from_slice(b"\nstack traceback:\n");
            v.extend_from_slice(self.traceback.as_bytes());
        }
        v
    }
}

/// The chunk name of Lua code that a host program runs around the script (`fibertrace run`
/// wraps `os.exit` to write its exit dumps first): its levels at the top of the calling
/// fiber's trace in `fibertrace.dump()` are the program's, and are left out there.
pub const HOST_CHUNK: &str = "=fibertrace";

/// A Lua state whose fibers are fibertrace fibers, with the `fiber` and `clock` modules.
pub struct LuaHost {
    lua: Option<mlua::Lua>,
    sched: Option<Scheduler>,
    /// A state the host made itself (closed by the host, after `lua` is dropped).
    own_state: Option<*mut ffi::lua_State>,
}

/// A Lua allocator over the process's (global) allocator that, unlike mlua's, answers a
/// failed allocation with null — Lua's `not enough memory`, which `pcall` catches — instead
/// of aborting the process.
///
/// # Safety
/// Called by Lua as its allocator: `ptr` is null or a block this function returned, of
/// `osize` bytes (when not null).
///
/// `ud`, when not null, is where the state's VM state is ([`vm_allocations_outside`]): what
/// LuaJIT allocates for itself — in its collector (its string table's resizes, shrunk
/// stacks), in its JIT compiler's optimiser and assembler (traces) — is charged to code
/// outside fibers, not to the fiber whose allocation or loop set it off.
unsafe extern "C" fn global_alloc(
    ud: *mut std::ffi::c_void,
    ptr: *mut std::ffi::c_void,
    osize: usize,
    nsize: usize,
) -> *mut std::ffi::c_void {
    // LuaJIT's VM states, stored as `~state`: the collector (2), the JIT compiler optimising
    // and assembling a trace (5, 6). Not recording (4): LuaJIT leaves that state set while
    // the interpreter runs the instruction just recorded, whose allocations are the
    // script's.
    const VM_OWN: [i32; 3] = [!2, !5, !6];
    // SAFETY: a non-null `ud` points at the VM state of the live global state whose
    // allocator this is (set with it, see `vm_allocations_outside`).
    if !ud.is_null() && VM_OWN.contains(&unsafe { std::ptr::read_volatile(ud as *const i32) }) {
        // SAFETY: per the contract, forwarded (`ud` null: no second check).
        return fibertrace_core::heap::outside_fibers(|| unsafe {
            global_alloc(std::ptr::null_mut(), ptr, osize, nsize)
        });
    }
    use std::alloc::Layout;
    const ALIGN: usize = ffi::SYS_MIN_ALIGN;
    // The size the block was allocated with: Lua's `osize`, unless a shrink of it was
    // refused and the block kept (below).
    let osize = if ptr.is_null() {
        osize
    } else {
        kept_size(ptr as usize).unwrap_or(osize)
    };
    // SAFETY: per the contract, a non-null `ptr` was allocated here with `osize` bytes (or the
    // kept size) and this alignment (a layout that was valid then); a new layout is checked.
    unsafe {
        if nsize == 0 {
            if !ptr.is_null() {
                forget_kept(ptr as usize);
                std::alloc::dealloc(ptr.cast(), Layout::from_size_align_unchecked(osize, ALIGN));
            }
            return std::ptr::null_mut();
        }
        let Ok(new) = Layout::from_size_align(nsize, ALIGN) else {
            return std::ptr::null_mut();
        };
        // Out of memory, Lua raises `not enough memory` itself: the process's emergency
        // reserve is kept for the reports, which a full Lua heap would otherwise hold —
        // except for the collection at exit (`release_kept`), which frees the heap and may
        // need a little to do it (the string table it shrinks).
        let kept = (!spawn::COLLECTING_AT_EXIT.with(std::cell::Cell::get))
            .then(fibertrace_core::heap::keep_reserve_out);
        let mut p = if ptr.is_null() {
            std::alloc::alloc(new)
        } else {
            // (Null on failure, the old block kept: as Lua expects.)
            let old = Layout::from_size_align_unchecked(osize, ALIGN);
            std::alloc::realloc(ptr.cast(), old, nsize)
        };
        drop(kept);
        if !ptr.is_null() && !p.is_null() {
            forget_kept(ptr as usize);
        }
        if p.is_null() && !ptr.is_null() && nsize <= osize {
            // Lua assumes a shrink never fails (LuaJIT's collector shrinks its buffers in a
            // trace exit, where an error it raises crashed the VM), but the tracker's
            // realloc is a new block: the old one, large enough, stays, and its size is
            // kept for its free (a layout other than its own would break the allocator's
            // contract); with no room to keep it, the reserve makes the smaller block, and
            // past the reserve the old block stays all the same.
            p = if keep_size(ptr as usize, osize) {
                ptr.cast()
            } else {
                let old = Layout::from_size_align_unchecked(osize, ALIGN);
                let q = std::alloc::realloc(ptr.cast(), old, nsize);
                if q.is_null() {
                    ptr.cast()
                } else {
                    q
                }
            };
        }
        // (Not a tail call: this frame stays on the stack a heap record captures, the same in
        // every build — the first frame of every Lua allocation's stack.)
        std::hint::black_box(p).cast()
    }
}

/// Most Lua blocks [`global_alloc`] keeps at their size after a refused shrink.
const KEPT_MAX: usize = 256;

/// Those blocks: (address, the size they were allocated with); `(0, 0)` is a free entry.
/// Empty but while a Lua heap is out of memory.
static KEPT: std::sync::Mutex<[(usize, usize); KEPT_MAX]> =
    std::sync::Mutex::new([(0, 0); KEPT_MAX]);

/// How many entries of [`KEPT`] are taken (read without the lock: 0 almost always).
static KEPT_N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The size block `p` was kept at, if it was.
fn kept_size(p: usize) -> Option<usize> {
    if KEPT_N.load(std::sync::atomic::Ordering::Acquire) == 0 {
        return None;
    }
    let k = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    k.iter().find(|e| e.0 == p).map(|e| e.1)
}

/// Forgets block `p`'s kept size (freed, or moved by a reallocation).
fn forget_kept(p: usize) {
    if KEPT_N.load(std::sync::atomic::Ordering::Acquire) == 0 {
        return;
    }
    let mut k = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = k.iter_mut().find(|e| e.0 == p) {
        *e = (0, 0);
        KEPT_N.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Keeps block `p` at `size`: whether there was room.
fn keep_size(p: usize, size: usize) -> bool {
    let mut k = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = k.iter_mut().find(|e| e.0 == p) {
        e.1 = size;
        return true;
    }
    match k.iter_mut().find(|e| e.0 == 0) {
        Some(e) => {
            *e = (p, size);
            KEPT_N.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            true
        }
        None => false,
    }
}

/// With the heap tracked and LuaJIT's layout checked: `l`'s allocator ([`global_alloc`])
/// gets where the VM state is, and charges what LuaJIT allocates for itself to code outside
/// fibers. Otherwise nothing.
///
/// # Safety
/// `l` is the main state of a fresh Lua made with [`global_alloc`] or another allocator.
pub(crate) unsafe fn vm_allocations_outside(l: *mut ffi::lua_State) {
    // SAFETY: per the contract.
    unsafe {
        let mut ud = std::ptr::null_mut();
        let f = ffi::lua_getallocf(l, &mut ud);
        if f as usize != global_alloc as *const () as usize {
            return;
        }
        if let Some(st) = crate::frames::publish::vmstate_of(l) {
            ffi::lua_setallocf(l, global_alloc, st as *mut std::ffi::c_void);
        }
    }
}

/// The Lua state of a host: all standard libraries (including `debug`, and `ffi`/`jit` on
/// LuaJIT, as the `lua`/`luajit` interpreters have them).
///
/// With `own_allocator`, the state is made with the VM's own allocator (`luaL_newstate`),
/// or [`global_alloc`] with the heap tracked, and handed to mlua: mlua's allocator aborts
/// the process where an allocation fails, and on LuaJIT costs about a quarter more
/// instructions in `fiber.info` (and a little in `fiber.create`), where thousands of small
/// objects are made. The host then closes that state itself (the second value) — see
/// [`LuaHost::new_with_own_allocator`] for what that asks of the caller.
fn new_lua(own_allocator: bool) -> Result<(mlua::Lua, Option<*mut ffi::lua_State>), String> {
    // With the heap tracked, Lua allocates through the process's allocator, so that its own
    // allocations are counted too ([`global_alloc`]); else through the VM's own allocator
    // (LuaJIT's; Lua 5.4's `realloc`-based one). Either returns null where memory runs out
    // (Lua's `not enough memory`); mlua's (below) aborts the process there.
    let tracked = fibertrace_core::heap::tier() != fibertrace_core::heap::Tier::Off;
    if own_allocator {
        // SAFETY: a fresh state, opened and then owned by this host only; mlua keeps its
        // data in the state and frees it when the state is closed. `global_alloc` is a Lua
        // allocator (see there).
        unsafe {
            let l = if tracked {
                ffi::lua_newstate(global_alloc, std::ptr::null_mut())
            } else {
                ffi::luaL_newstate()
            };
            if l.is_null() {
                return Err("cannot create a Lua state (out of memory)".into());
            }
            ffi::luaL_openlibs(l);
            return Ok((mlua::Lua::get_or_init_from_ptr(l).clone(), Some(l)));
        }
    }
    // SAFETY: unsafe_new only allows loading the `debug` (and on LuaJIT `ffi`) libraries,
    // which a Lua interpreter (as `fibertrace run` is) offers to its scripts.
    Ok((unsafe { mlua::Lua::unsafe_new() }, None))
}

impl LuaHost {
    /// A host with the standard libraries (including `debug`, and `ffi`/`jit` on LuaJIT, as
    /// the `lua`/`luajit` interpreters have them) and the `fiber` and `clock` modules.
    ///
    /// # Errors
    /// When another host already runs on this thread, or Lua fails to initialise.
    pub fn new() -> Result<LuaHost, String> {
        Self::make(false)
    }

    /// As [`LuaHost::new`], but the Lua state uses the VM's own allocator instead of mlua's
    /// (on LuaJIT about a quarter fewer instructions in `fiber.info`), or, with the heap
    /// tracked, the process's allocator through a function of ours: either way an allocation
    /// that fails is Lua's `not enough memory` (mlua's allocator aborts the process then);
    /// `fibertrace run` uses it.
    ///
    /// # Safety
    /// The host closes that Lua state when it is dropped, whatever else refers to it: no
    /// `mlua::Lua` cloned from [`LuaHost::lua`] (nor any mlua value made from it) may be used
    /// after the host is gone.
    ///
    /// # Errors
    /// As [`LuaHost::new`].
    pub unsafe fn new_with_own_allocator() -> Result<LuaHost, String> {
        Self::make(true)
    }

    /// The stack size of every Lua fiber (reserved, not committed: an untouched page costs
    /// no memory). LuaJIT: 1 MiB, twice Tarantool's 512 KiB (its C functions nest deep: a
    /// `string.gsub` callback level takes over 8 KiB; past the stack, the fiber gets
    /// `C stack overflow`). Lua 5.4: 4 MiB, so that the 200 C levels after which Lua raises
    /// `C stack overflow` itself fit on every path, also when Lua's C code is built without
    /// optimization (a level then takes up to ~5.5 KiB).
    pub const FIBER_STACK: usize = if cfg!(feature = "luajit") {
        1 << 20
    } else {
        4 << 20
    };

    fn make(own_allocator: bool) -> Result<LuaHost, String> {
        crate::prepare();
        // With the heap tracked, recorded stacks get the running fiber's Lua frames (LuaJIT:
        // read from its memory, see `crate::heap`).
        if cfg!(feature = "luajit")
            && fibertrace_core::heap::tier() != fibertrace_core::heap::Tier::Off
        {
            // What the hook uses, made before it runs (their first use allocates).
            let _ = crate::frames::intern::interned_count();
            let _ =
                fibertrace_core::symbolize::resolve_address(new_lua as *const () as usize as u64);
            fibertrace_core::heap::set_stack_hook(Some(crate::heap::lua_stack_hook));
        }
        if HOST.with(|h| h.borrow().is_some()) {
            return Err("a Lua host already exists on this thread".into());
        }
        let (lua, own_state) = new_lua(own_allocator)?;
        let l = lua.state();
        let sched = Scheduler::with_options(SchedulerOptions {
            parent_traces: false,
            report_panics: false,
            name: "lua".into(),
            // Runs timed from their start (a counter read per switch): Tarantool's slices
            // (`fiber.check_slice`) count a run from its start even when the script sets its
            // first slice in the middle of it, and `fiber.info()` has each fiber's `time`.
            cpu_time: true,
            // Reserved, not committed: an untouched page costs no memory.
            stack_size: Self::FIBER_STACK,
            ..SchedulerOptions::default()
        });
        // SAFETY: `l` is the main state of a Lua just created on this thread, used by nothing
        // else now.
        let st = match unsafe { install::install(l) } {
            Ok(st) => st,
            Err(e) => {
                drop(lua);
                if let Some(l) = own_state {
                    // SAFETY: made by `new_lua` just above; nothing else refers to it.
                    unsafe { ffi::lua_close(l) };
                }
                return Err(e);
            }
        };
        HOST.with(|h| *h.borrow_mut() = Some(st));
        // SAFETY: the main state just made, running nothing.
        unsafe { finalize::install(l) };
        #[cfg(feature = "luajit")]
        cstack::install(l);
        // A running fiber's Lua frames, for dumps and stall reports asked from another
        // thread.
        // SAFETY: the main state just made, running nothing.
        unsafe { hog::start(l, &sched) };
        fibertrace_fiber::watchdog::set_annotator(hog::stall_note);
        register_glue();
        // The runtime's own reports built on this thread (the deadlock report) show the Lua
        // frames of Lua fibers.
        sched.set_frame_source(Some(std::rc::Rc::new(info::LuaFrames)));
        // And a dump asked from another thread while this one is away in native code (a
        // blocking call) reads them from memory, this thread held still (LuaJIT: its layout
        // was checked when the state was made; none otherwise).
        if let Ok(held) = crate::interleave::held::HeldLua::new() {
            sched.set_held_source(Some(std::sync::Arc::new(held)));
        }
        Ok(LuaHost {
            lua: Some(lua),
            sched: Some(sched),
            own_state,
        })
    }

    /// The Lua state (for registering more globals; mlua callbacks that switch fibers have
    /// the caveat of the module docs).
    pub fn lua(&self) -> &mlua::Lua {
        self.lua.as_ref().expect("host alive")
    }

    /// The scheduler.
    pub fn scheduler(&self) -> &Scheduler {
        self.sched.as_ref().expect("host alive")
    }

    /// Lets go of what the host and its scheduler keep made ahead for the next fibers, and
    /// collects the Lua heap in full: what is live after is what the script still holds
    /// (`fibertrace run --leaks` does this before its report at exit). Finalizers of what is
    /// freed run, as in any collection. Call it between runs (not from a fiber: Lua code
    /// there has [`LuaHost::release_kept_fn`]).
    pub fn release_kept(&self) {
        let Some(l) = with_host(|h| h.main_l) else {
            return;
        };
        // SAFETY: the idle main state of this thread's host (no fiber runs: the caller is
        // between runs).
        unsafe { spawn::release_kept(l) };
        self.scheduler().release_caches();
    }

    /// Whether [`LuaHost::release_kept`] (or its Lua function) ran in this process: a
    /// report taken at exit without it (the run ended by a signal) lists the Lua heap's
    /// garbage too.
    pub fn kept_released() -> bool {
        spawn::RELEASED.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`LuaHost::release_kept`]'s collection failed (out of memory: a collection
    /// allocates too), leaving the Lua heap's garbage in place.
    pub fn release_collect_failed() -> bool {
        spawn::COLLECT_FAILED.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`LuaHost::release_kept`] (or its Lua function) was called inside a `__gc`
    /// finalizer, where it lets the pools go but cannot collect (`os.exit` in a finalizer).
    pub fn release_in_finalizer() -> bool {
        spawn::IN_FINALIZER.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`LuaHost::release_kept`] as a Lua function (no arguments, no results) that Lua code
    /// may call from any fiber (a wrapper of `os.exit` does).
    pub fn release_kept_fn(&self) -> mlua::Result<mlua::Function> {
        // SAFETY: a C function of this host's, called by Lua on this host's states.
        unsafe { self.lua().create_c_function(spawn::f_release_kept) }
    }

    /// Runs Lua source as the main fiber (named `main`) until its chunk returns: `name` is
    /// the chunk name (`@file.lua` for a file), `args` become the chunk's `...`. Fibers still
    /// alive afterwards stay suspended (run them on with [`LuaHost::run_fibers`]).
    ///
    /// # Errors
    /// The script's error with its traceback; a syntax error; a deadlock (every fiber waits
    /// and no timer is set).
    pub fn run_main(
        &self,
        name: impl AsRef<[u8]>,
        source: &[u8],
        args: &[&[u8]],
    ) -> Result<(), ScriptError> {
        let name = name.as_ref().to_vec();
        let source = source.to_vec();
        let args: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
        let r = self
            .scheduler()
            .block_on(move || spawn::run_main_fiber(&name, &source, &args));
        match r {
            Ok(r) => r,
            Err(fibertrace_fiber::BlockOnError::Run(fibertrace_fiber::RunError::Deadlock {
                ..
            })) => {
                // The report names every fiber, what it waits on, and where.
                Err(ScriptError::text(self.scheduler().deadlock_report()))
            }
            Err(e) => Err(ScriptError::text(format!("fibertrace: {e}"))),
        }
    }

    /// Runs the scheduler until no fiber is left (or they all wait forever).
    ///
    /// # Errors
    /// On a deadlock, naming the fibers left waiting.
    pub fn run_fibers(&self) -> Result<(), String> {
        self.scheduler().run().map_err(|e| e.to_string())
    }

    /// Sets `arg` as the `lua` interpreter does: `arg[0]` the script, `arg[1..]` its
    /// arguments, `arg[-1]` the interpreter, each as its bytes (UTF-8 or not).
    pub fn set_arg(&self, interpreter: impl AsRef<[u8]>, script: impl AsRef<[u8]>, args: &[&[u8]]) {
        /// Pushes `b` as a Lua string (`l` is a live state with room on its stack).
        unsafe fn push(l: *mut ffi::lua_State, b: &[u8]) {
            // SAFETY: the pointer and length describe `b`; Lua copies the bytes.
            unsafe { ffi::lua_pushlstring(l, b.as_ptr().cast(), b.len()) };
        }
        let Some(l) = with_host(|h| h.main_l) else {
            return;
        };
        // SAFETY: main state of this thread's host, no Lua running on it from here.
        unsafe {
            ffi::lua_createtable(l, args.len() as c_int, 2);
            push(l, interpreter.as_ref());
            ffi::lua_rawseti(l, -2, -1);
            push(l, script.as_ref());
            ffi::lua_rawseti(l, -2, 0);
            for (i, a) in args.iter().enumerate() {
                push(l, a);
                ffi::lua_rawseti(l, -2, i as ffi::lua_Integer + 1);
            }
            ffi::lua_setglobal(l, c"arg".as_ptr());
        }
    }
}

impl Drop for LuaHost {
    fn drop(&mut self) {
        #[cfg(feature = "luajit")]
        cstack::uninstall();
        if let Some(lua) = &self.lua {
            // SAFETY: this thread's host's main state, not closed yet; dropping the host runs
            // no Lua code of its own here.
            unsafe { hog::stop(lua.state()) };
        }
        // Fibers still suspended hold Lua frames on their native stacks: cancel them and run
        // them to their end before anything is freed.
        let fibers: Vec<fibertrace_fiber::Fiber> = with_host(|h| {
            h.report_errors = false;
            h.recs.values().map(|r| r.fiber.clone()).collect()
        })
        .unwrap_or_default();
        for f in &fibers {
            f.cancel();
        }
        if let Some(s) = &self.sched {
            for _ in 0..3 {
                if s.fiber_count() == 0 {
                    break;
                }
                let _ = s.run();
            }
            if s.fiber_count() > 0 {
                // Leak rather than unwind through the Lua VM.
                std::mem::forget(self.sched.take());
                std::mem::forget(self.lua.take());
                HOST.with(|h| std::mem::forget(h.borrow_mut().take()));
                return;
            }
        }
        self.sched.take();
        HOST.with(|h| h.borrow_mut().take());
        self.lua.take();
        if let Some(l) = self.own_state.take() {
            // SAFETY: the state was made by `new_lua`, every fiber that ran Lua has ended,
            // and the last mlua handle is gone; mlua's data in it goes with it.
            unsafe { ffi::lua_close(l) };
        }
        // (After the close: finalizers run by it may still not switch.)
        finalize::uninstall();
    }
}

/// Tells the runtime's reports which native frames are the Lua host's own glue (its C
/// function wrappers, the fiber start), to leave them out as they leave out their own — also
/// in a dump of another process that runs a Lua host (`fibertrace dump PID`).
pub fn register_glue() {
    fibertrace_fiber::glue::add_host_glue(spawn::is_glue);
}

pub(crate) fn set_last_trace(t: Option<String>) {
    LAST_TRACE.with(|c| *c.borrow_mut() = t);
}

pub(crate) fn take_last_trace() -> Option<String> {
    LAST_TRACE.with(|c| c.borrow_mut().take())
}

pub(crate) fn set_last_frames(f: Vec<fibertrace_core::Frame>) {
    LAST_FRAMES.with(|c| *c.borrow_mut() = f);
}

pub(crate) fn take_last_frames() -> Vec<fibertrace_core::Frame> {
    LAST_FRAMES.with(|c| std::mem::take(&mut *c.borrow_mut()))
}
