//! Fiber creation (`fiber.create`, `fiber.new`) and the body every Lua fiber runs: its Lua
//! thread (pooled), its protected call with the message handler, and its end.

use std::ffi::c_int;
use std::io::Write;

use fibertrace_fiber::{Builder, FiberId, ParentTrace};
use mlua::ffi;

use super::call::lua_fn;
use super::call::Call;
use super::objects::*;
use super::raw::{self, LErr, LResult};
use super::{with_host, HostState, LuaFiber, ScriptError};

// ---- fiber creation and the fiber body ----

/// The message handler of every fiber's `lua_pcall`: records the interleaved trace at the
/// point of the error, and returns the error unchanged.
pub(super) fn msgh_body(c: &mut Call) -> LResult {
    let l = c.state();
    let root = with_host(|h| {
        h.recs
            .get(&fibertrace_fiber::current_id())
            .map(|r| r.thread)
    })
    .flatten()
    .unwrap_or(l);
    // SAFETY: `root` is the running fiber's own thread (or `l`), on this thread.
    let frames = unsafe { super::info::current_frames(root, l, "f_msgh") };
    // The handler itself (its native frame and its Lua level) is not part of the error.
    let from = frames
        .iter()
        .position(|f| matches!(f, fibertrace_core::Frame::Lua(_)))
        .map_or(0, |i| i + 1);
    super::set_last_trace(Some(crate::render::tarantool_report(&frames[from..])));
    super::set_last_frames(frames[from..].to_vec());
    Ok(1)
}
lua_fn!(f_msgh, msgh_body);

/// The host's glue in reports (see `fibertrace_fiber::glue`): the wrapper [`lua_fn!`] makes
/// around each function the host gives Lua (its code is the macro's, in `call.rs`, and so is
/// its line information, and the raw helpers in `raw.rs` it calls), the calls that start a fiber's Lua function, and mlua's shims.
pub(crate) fn is_glue(name: &str, file: Option<&str>) -> bool {
    // mlua's inline shims of the C API (`lua_pcall` over `lua_pcallk` under Lua 5.4).
    if name.starts_with("mlua_sys::") {
        return true;
    }
    let Some(rest) = name.strip_prefix("fibertrace_lua::host::") else {
        return false;
    };
    file.is_some_and(|f| f.ends_with("src/host/call.rs") || f.ends_with("src/host/raw.rs"))
        || matches!(
            rest,
            "spawn::call_in_thread"
                | "spawn::lua_fiber_main"
                | "spawn::LuaBody::run"
                | "spawn::spawn_lua::{{closure}}"
                | "spawn::run_main_fiber"
                | "LuaHost::run_main::{{closure}}"
        )
}

/// Calls the function at index 2 of `t` with `nargs` arguments under the message handler at
/// [`MSGH_SLOT`]. Returns whether it succeeded; results (or the error) are left from index 2.
///
/// # Safety
/// `t` is a Lua thread of this host laid out as said, run only by the current fiber.
#[inline(never)]
pub(super) unsafe fn call_in_thread(t: *mut ffi::lua_State, nargs: c_int) -> bool {
    // SAFETY: per the contract; lua_pcall catches every Lua error.
    let st = unsafe { ffi::lua_pcall(t, nargs, ffi::LUA_MULTRET, MSGH_SLOT) };
    std::hint::black_box(());
    st == ffi::LUA_OK
}

/// The body of a fiber made by `fiber.create`/`fiber.new`.
#[inline(never)]
pub(super) fn lua_fiber_main(t: *mut ffi::lua_State, nargs: c_int) {
    // SAFETY: `t` was set up by `spawn_lua` and belongs to this fiber.
    let ok = unsafe { call_in_thread(t, nargs) };
    let fid = fibertrace_fiber::current_id();
    // (Both the text and the frames: frames left behind would be taken by the next failing
    // fiber whose error the handler did not see — out of memory raises without it — as its
    // own.)
    let trace = if ok {
        None
    } else {
        drop(super::take_last_frames());
        super::take_last_trace()
    };
    // SAFETY: the thread is ours and idle now.
    let msg = (!ok).then(|| unsafe { raw::error_bytes(t, -1) });
    let report = with_host(|h| {
        // One lookup: a joinable fiber's record stays for its joiner. Its storage goes now.
        let main_l = h.main_l;
        let mut rec = h.recs.take_if(fid, |r| {
            if !r.joinable {
                return true;
            }
            r.done = Some(ok);
            r.ended_top = fibertrace_fiber::embed::top_at_end().map(Box::new);
            let storage = std::mem::take(&mut r.storage_ref);
            if storage > 0 {
                // SAFETY: the reference was made by `storage` in this host's registry.
                unsafe { ffi::luaL_unref(main_l, REG, storage) };
            }
            false
        })?;
        // (Not joinable now: it was made so while a join waited.)
        note_lost_joins(h, fid, &rec, UNJOINABLE_WAITED);
        free_obj_slot(h, &rec);
        release_storage(h, &mut rec);
        release_thread(h, rec.thread, rec.thread_ref);
        // A cancelled fiber's error is not a failure to report (Tarantool's rule).
        let report = h.report_errors && !ok && !rec.fiber.control_block().is_cancelled();
        report.then(|| rec.fiber.name())
    })
    .flatten();
    if let (Some(name), Some(msg)) = (report, msg) {
        // (A closed stderr is no reason to fail: the write's error is dropped.) The name is
        // written as its bytes.
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "fibertrace: fiber {fid} \"")
            .and_then(|()| err.write_all(&fibertrace_fiber::embed::name_to_bytes(&name)))
            .and_then(|()| err.write_all(b"\" failed: "))
            .and_then(|()| err.write_all(&msg))
            .and_then(|()| writeln!(err, "\nstack traceback:\n{}", trace.unwrap_or_default()));
    }
}

/// A Lua fiber's body as handed to the scheduler. Run, it calls the function on the fiber's
/// thread ([`lua_fiber_main`]). Dropped unrun — the fiber was cancelled before it started —
/// it settles the fiber's record as the end of its function would: the record, its object's
/// slot and its thread are released, except that a joinable fiber's record stays, with no
/// outcome, for its joiner (who is told the fiber was cancelled).
pub(super) struct LuaBody {
    t: *mut ffi::lua_State,
    nargs: c_int,
}

impl LuaBody {
    fn run(self) {
        let me = std::mem::ManuallyDrop::new(self);
        lua_fiber_main(me.t, me.nargs);
    }
}

impl Drop for LuaBody {
    fn drop(&mut self) {
        let t = self.t;
        if SPAWNING.with(|s| s.0.get()) == t as usize {
            // Its spawn failed: the spawner takes the thread back.
            return;
        }
        // Dropped inside the fiber (cancelled before it started) the fiber is current; while
        // a scheduler is dropped it is not, and the record is found by its thread — a dead
        // fiber's (the scheduler marks a fiber dead before dropping its body): a thread that
        // went back to the pool may run a live fiber now.
        let fid = fibertrace_fiber::current_id();
        with_host(|h| {
            let fid = if h.recs.get(&fid).is_some_and(|r| r.thread == t) {
                fid
            } else {
                let dead = |r: &LuaFiber| r.thread == t && r.fiber.control_block().is_dead();
                match h.recs.iter().find(|(_, r)| dead(r)) {
                    Some((&id, _)) => id,
                    None => return,
                }
            };
            if h.recs.get(&fid).is_some_and(|r| r.joinable) {
                return;
            }
            if let Some(rec) = remove_rec(h, fid, UNJOINABLE_WAITED) {
                release_thread(h, rec.thread, rec.thread_ref);
            }
        });
    }
}

/// Gives a finished fiber's Lua thread back to the pool (or drops its reference).
pub(super) fn release_thread(h: &mut HostState, t: *mut ffi::lua_State, r: c_int) {
    // SAFETY: `t` is a thread of this host that no fiber runs any more: all above the
    // message handler is dropped.
    unsafe {
        ffi::lua_settop(t, MSGH_SLOT);
        if h.pool.len() < POOL_MAX {
            // (The pool's growth is the runtime's, not the fiber's that ended; what it holds
            // is let go by `release_kept`.)
            let _outside = (h.pool.len() == h.pool.capacity())
                .then(fibertrace_core::heap::OutsideFibers::enter);
            h.pool.push((t, r));
        } else {
            ffi::luaL_unref(h.main_l, REG, r);
        }
    }
}

/// Takes a clean Lua thread (from the pool or new). Its stack holds only the message handler
/// ([`MSGH_SLOT`], made once per thread, not once per fiber: pushing a C function allocates a
/// closure); the fiber's function and arguments go above it. A new one is made on `l` (the
/// calling state, or the idle main state), in a protected call (`not enough memory` comes
/// back as the error), outside the host state's borrow: an allocation can run `__gc`
/// finalizers, which may use the host (`fiber.create`).
///
/// # Safety
/// `l` is a running Lua thread of this thread's host, or its idle main state.
pub(super) unsafe fn take_thread(
    l: *mut ffi::lua_State,
) -> Result<(*mut ffi::lua_State, c_int), LErr> {
    let pooled = with_host(|h| h.pool.pop()).ok_or_else(no_host)?;
    if let Some(p) = pooled {
        return Ok(p);
    }
    let mut made = (std::ptr::null_mut(), 0);
    // (Charged to code outside fibers, as the rest of the host's own: a thread is made for
    // the host's pool, to serve one fiber after another, and the registry grows with the
    // references.)
    // SAFETY: per the contract; the thread is made on `l` and anchored in the registry, and
    // its handler is made on `l` and moved to it (a fresh thread has room for it).
    fibertrace_core::heap::outside_fibers(|| unsafe {
        raw::protect(l, &[], &mut |l| {
            let t = ffi::lua_newthread(l);
            ffi::lua_pushcfunction(l, f_msgh);
            ffi::lua_xmove(l, t, 1);
            made = (t, ffi::luaL_ref(l, REG));
            0
        })
    })?;
    Ok(made)
}

/// Lets go of what the host and the running scheduler keep made ahead for the next fibers
/// (finished fibers' Lua threads, fiber objects made ahead, slot boxes and stacks), then
/// collects the Lua heap in full, twice (what a finalizer kept alive the first time goes in
/// the second): what is live after is what the script still holds. For the heap report at
/// exit (`fibertrace run --leaks`); the next fibers, if any, are made anew. A collection
/// runs the `__gc` finalizers of what it frees, as any collection does; inside a finalizer
/// (where a collection is not begun again) the host's pools are let go and nothing is
/// collected.
///
/// # Safety
/// `l` is a Lua thread of this thread's host at a call boundary: the state of a running C
/// function, or the idle main state.
pub(crate) unsafe fn release_kept(l: *mut ffi::lua_State) {
    // (What this does is the runtime's work, not the calling fiber's heap; the finalizers
    // the collection runs are charged as usual.)
    let outside = fibertrace_core::heap::OutsideFibers::enter();
    let Some((pool, ready, objs)) = with_host(|h| {
        (
            std::mem::take(&mut h.pool),
            std::mem::take(&mut h.obj_ready),
            h.objs_ref,
        )
    }) else {
        return;
    };
    // SAFETY: per the contract; room for the two values pushed at a time is asked first.
    // Unreferencing a registry entry and storing nil at an existing key of the object table
    // allocate nothing and raise nothing. Objects made ahead were never given to Lua; their
    // slots are free again.
    unsafe {
        if ffi::lua_checkstack(l, 3) == 0 {
            with_host(|h| {
                h.pool = pool;
                h.obj_ready = ready;
            });
            return;
        }
        for &(_, r) in &pool {
            ffi::luaL_unref(l, REG, r);
        }
        raw::rawgeti(l, REG, objs as ffi::lua_Integer);
        if ffi::lua_type(l, -1) == ffi::LUA_TTABLE {
            for &slot in &ready {
                ffi::lua_pushnil(l);
                raw::rawseti(l, -2, slot as ffi::lua_Integer);
            }
            with_host(|h| h.obj_free.extend_from_slice(&ready));
        } else {
            // (A script changed the registry: the next create says so.)
            with_host(|h| h.obj_ready = ready);
        }
        ffi::lua_settop(l, -2);
    }
    fibertrace_fiber::release_caches();
    drop(outside);
    // SAFETY: per the contract (a state of this host, at a call boundary).
    let in_finalizer = unsafe { super::finalize::in_finalizer(l) };
    IN_FINALIZER.store(in_finalizer, std::sync::atomic::Ordering::Relaxed);
    if in_finalizer {
        return;
    }
    // SAFETY: as above: a full collection from a call boundary, as `collectgarbage()`, in a
    // protected call (a collection allocates — the string table shrinks — and out of memory
    // that raises: through this Rust frame it aborted the process); then the VM's own tables
    // read (room for the probe's one value was checked above).
    unsafe {
        let top = ffi::lua_gettop(l);
        COLLECTING_AT_EXIT.with(|c| c.set(true));
        let collected = super::raw::protect(l, &[], &mut |l| {
            ffi::lua_gc(l, ffi::LUA_GCCOLLECT, 0);
            ffi::lua_gc(l, ffi::LUA_GCCOLLECT, 0);
            0
        });
        COLLECTING_AT_EXIT.with(|c| c.set(false));
        if collected.is_err() {
            // (Its error value dropped. Not collected: the report lists the garbage too, and
            // says so.)
            ffi::lua_settop(l, top);
            COLLECT_FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        RELEASED.store(true, std::sync::atomic::Ordering::Relaxed);
        let _outside = fibertrace_core::heap::OutsideFibers::enter();
        crate::heap::set_vm_own(crate::frames::foreign::vm_tables_of(l));
    }
}

/// Whether [`release_kept`] collected the Lua heap in this process.
pub(crate) static RELEASED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

thread_local! {
    /// Set on this thread during [`release_kept`]'s collection: the Lua allocator may use
    /// the process's emergency reserve then (see `global_alloc`).
    pub(crate) static COLLECTING_AT_EXIT: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

/// Whether [`release_kept`]'s collection raised an error (out of memory: a collection
/// allocates), so that the heap was not collected.
pub(crate) static COLLECT_FAILED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether [`release_kept`] was called inside a `__gc` finalizer (where no collection can
/// run), and so did not collect.
pub(crate) static IN_FINALIZER: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// [`release_kept`] as a Lua function of no arguments and no results (for a wrapper of
/// `os.exit`: `fibertrace run --leaks`).
///
/// # Safety
/// Called by Lua, on a state of this thread's host.
pub(crate) unsafe extern "C-unwind" fn f_release_kept(l: *mut ffi::lua_State) -> c_int {
    // SAFETY: the state of this running C function.
    unsafe { release_kept(l) };
    0
}

/// How many fiber objects one refill of the ready objects makes.
const READY_BATCH: usize = 32;

/// Pushes onto `l` a fiber object made ahead, and returns its slot in the host's object
/// table (`objs`, a registry reference), where it stays, and its block (id 0: the caller
/// writes the fiber's id before Lua can see the object). When none is left, a batch is made
/// first, in one protected call ([`refill_ready`]): making an object allocates, which can
/// raise, and a protected call per object was a tenth of a `fiber.create`. A slot given back
/// unused (the fiber could not be made) goes to `obj_ready` again, its object unchanged.
///
/// The table and the object are checked before use (a table, and a userdata whose metatable
/// is the host's fiber metatable): a script can reach the registry through the debug library
/// and put anything there; then this is [`tampered`]'s error, never a write into another
/// object's block.
///
/// # Safety
/// `l` is a running Lua thread of this thread's host; `objs` and `mt` are the host's object
/// table and fiber metatable references.
unsafe fn take_ready_object(
    l: *mut ffi::lua_State,
    objs: c_int,
    mt: c_int,
) -> Result<(c_int, *mut FiberUd), LErr> {
    // SAFETY: per the contract; lua_checkstack never raises. (Two at most are pushed at a
    // time: a C function's stack holds 8,000 values under LuaJIT, which a caller's arguments
    // may nearly fill.)
    if unsafe { ffi::lua_checkstack(l, 2) } == 0 {
        return Err(LErr::plain("stack overflow"));
    }
    let (ready, mt_id) = with_host(|h| (h.obj_ready.pop(), h.mt_tables[0])).ok_or_else(no_host)?;
    let slot = match ready {
        Some(slot) => slot,
        // (Charged to code outside fibers, as the rest of the host's own: objects made for
        // whichever fibers come next, and the object table's growth, are not the calling
        // fiber's heap.)
        None => fibertrace_core::heap::outside_fibers(|| {
            // SAFETY: per the contract.
            unsafe { refill_ready(l, objs, mt, mt_id) }
        })?,
    };
    // Room for two values was asked above (the table and the value, then the value and its
    // metatable). The block is written (by the caller) only when the value is a userdata of
    // at least a `FiberUd`'s size with the fiber metatable: the write stays in its block
    // whatever the script did, and a block made by `refill_ready` is a `FiberUd`.
    // SAFETY: raw reads of the registry, of a table checked to be one, and of the value's
    // size and metatable, which allocate nothing, within the room checked above.
    unsafe {
        super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
        if ffi::lua_type(l, -1) != ffi::LUA_TTABLE {
            ffi::lua_settop(l, -2);
            return Err(tampered());
        }
        super::raw::rawgeti(l, -1, slot as ffi::lua_Integer);
        ffi::lua_remove(l, -2);
        // (As `Call::ud`: the metatable by identity, and a fiber block by size and tag, since
        // `debug.setmetatable` can put the fiber metatable on another userdata.)
        let ud = super::call::tagged_body::<FiberUd>(l, -1);
        let ours = ud.is_some() && ffi::lua_getmetatable(l, -1) != 0 && {
            let p = ffi::lua_topointer(l, -1) as usize;
            ffi::lua_settop(l, -2);
            p == mt_id
        };
        let (true, Some(ud)) = (ours, ud) else {
            ffi::lua_settop(l, -2);
            // (The next refill stores a new object there.)
            with_host(|h| h.obj_free.push(slot));
            return Err(tampered());
        };
        Ok((slot, ud))
    }
}

/// The error of a create that finds the host's fiber objects changed by the script (through
/// `debug.getregistry()`).
fn tampered() -> LErr {
    LErr::plain("fibertrace: the host's table of fiber objects was changed by the script")
}

/// Makes up to [`READY_BATCH`] fiber objects (id 0, the fiber metatable, whose identity is
/// `mt_id`) into free slots of the object table in one protected call, keeps all but one in
/// `obj_ready`, and returns that one's slot. When an allocation fails part way, the objects
/// made so far are kept (the error is dropped) and the slots not filled go back to
/// `obj_free`; when none was made, the error is returned, its value left on top of `l` (as
/// [`super::raw::protect`] leaves it). A registry entry that is no longer the host's table or
/// metatable makes nothing: [`tampered`]'s error.
///
/// # Safety
/// As [`take_ready_object`].
unsafe fn refill_ready(
    l: *mut ffi::lua_State,
    objs: c_int,
    mt: c_int,
    mt_id: usize,
) -> Result<c_int, LErr> {
    let slots: Vec<c_int> = with_host(|h| {
        (0..READY_BATCH)
            .map(|_| {
                h.obj_free.pop().unwrap_or_else(|| {
                    h.obj_next += 1;
                    h.obj_next
                })
            })
            .collect()
    })
    .ok_or_else(no_host)?;
    let mut made = 0;
    // The object table and the metatable are checked first (a table, and the host's
    // metatable by identity); an error part way leaves `made` counting the objects stored.
    // SAFETY: per the contract; each userdata's block is written before its metatable is
    // set, then it is stored (popped) into its slot of the checked object table.
    let res = unsafe {
        super::raw::protect(l, &[], &mut |l| {
            super::raw::rawgeti(l, REG, objs as ffi::lua_Integer);
            super::raw::rawgeti(l, REG, mt as ffi::lua_Integer);
            if ffi::lua_type(l, -2) != ffi::LUA_TTABLE
                || ffi::lua_type(l, -1) != ffi::LUA_TTABLE
                || ffi::lua_topointer(l, -1) as usize != mt_id
            {
                ffi::lua_settop(l, -3);
                return 0;
            }
            for &slot in &slots {
                let ud = ffi::lua_newuserdata(l, std::mem::size_of::<FiberUd>()).cast::<FiberUd>();
                ud.write(FiberUd::new(0));
                ffi::lua_pushvalue(l, -2);
                ffi::lua_setmetatable(l, -2);
                super::raw::rawseti(l, -3, slot as ffi::lua_Integer);
                made += 1;
            }
            ffi::lua_settop(l, -3);
            0
        })
    };
    match res {
        Err(e) if made == 0 => {
            with_host(|h| h.obj_free.extend_from_slice(&slots));
            return Err(e);
        }
        // SAFETY: the failed call left its error value on top of `l`.
        Err(_) => unsafe { ffi::lua_settop(l, -2) },
        Ok(_) if made == 0 => {
            with_host(|h| h.obj_free.extend_from_slice(&slots));
            return Err(tampered());
        }
        Ok(_) => {}
    }
    with_host(|h| {
        h.obj_free.extend_from_slice(&slots[made..]);
        // Taken from the back: the first slot made goes first.
        h.obj_ready.extend(slots[1..made].iter().rev());
    })
    .ok_or_else(no_host)?;
    Ok(slots[0])
}

/// Set while a fiber for the thread in it is being spawned: if the spawn fails, the body
/// dropped unrun is not a fiber cancelled before it started (the caller takes the thread
/// back).
#[derive(Default)]
pub(super) struct Spawning(std::cell::Cell<usize>);

thread_local! {
    static SPAWNING: Spawning = Spawning::default();
}

/// `fiber.create(fn, ...)` / `fiber.new(fn, ...)`: the function and its arguments are the
/// whole stack of `l`; they move to the new fiber, and its object is left in their place.
/// `starts_now`: the caller starts it right after (`fiber.create`), which dates it.
///
fn spawn_lua(c: &mut Call, what: &str, starts_now: bool) -> Result<FiberId, LErr> {
    let l = c.state();
    if c.type_of(1) != ffi::LUA_TFUNCTION {
        return Err(format!("fiber.{what}(function, ...): bad arguments").into());
    }
    if fibertrace_fiber::current_id() == 0 {
        return Err(format!("fiber.{what}: not in a fiber").into());
    }
    let n = c.top();
    // SAFETY: `l` is the state of the running call `c`, a running thread of this host.
    let (t, tref) = unsafe { take_thread(l) }?;
    let (parent_bt, creator_root, name, objs, mt) = with_host(|h| {
        let root = if h.parent_backtrace {
            h.recs
                .get(&fibertrace_fiber::current_id())
                .map(|r| r.thread)
        } else {
            None
        };
        (
            h.parent_backtrace,
            root,
            h.fiber_name.clone(),
            h.objs_ref,
            h.fiber_mt_ref,
        )
    })
    .ok_or_else(no_host)?;
    // Undoes the above when the fiber cannot be made.
    let give_back = |err: LErr| {
        with_host(|h| release_thread(h, t, tref));
        err
    };
    // The new thread takes the function and its arguments (the message handler is below
    // them): room for them, or an error as Tarantool's `lua_checkstack` would give.
    // SAFETY: `t` is a clean thread of this host.
    if unsafe { ffi::lua_checkstack(t, n) } == 0 {
        return Err(give_back(LErr::At(format!(
            "fiber.{what}: too many arguments ({}) for the fiber's Lua stack",
            n - 1
        ))));
    }
    // The fiber's object first (its allocations are what can fail): one made ahead, in its
    // slot of the host's object table (which holds it as long as the fiber lives), left on
    // top of `l` above the function and its arguments; its id is written once known.
    // SAFETY: `l` is the running call's state; the references are the host's.
    let (slot, ud) = match unsafe { take_ready_object(l, objs, mt) } {
        Ok(made) => made,
        // (The error value stays on top for the wrapper.)
        Err(e) => return Err(give_back(e)),
    };
    let parent = if parent_bt {
        // From the Lua call of the C function that creates it: the host's own frames above
        // are not the creator's.
        let upto = if starts_now { "f_create" } else { "f_new" };
        // SAFETY: the creator's root thread runs on this OS thread (it is calling us).
        let frames = unsafe { super::info::current_frames(creator_root.unwrap_or(l), l, upto) };
        let me = fibertrace_fiber::current();
        Some(ParentTrace::new(me.as_ref(), &frames))
    } else {
        None
    };
    // The outcome is the record's `done` (see `lua_fiber_main`): the handle's result slot is
    // not needed, and its fiber moves into the record.
    let parent_bt = parent.is_some();
    let mut b = Builder::new().shared_name(name).parent_trace(parent);
    if starts_now {
        // Started as soon as its record and object exist: the start dates it.
        b = b.created_at_start();
    }
    let body = LuaBody { t, nargs: n - 1 };
    SPAWNING.with(|s| s.0.set(t as usize));
    let spawned = b.try_spawn(move || body.run());
    SPAWNING.with(|s| s.0.set(0));
    let fiber = match spawned {
        Ok(h) => h.into_fiber(),
        Err(e) => {
            // The object, still unseen (id 0), is popped and stays ready in its slot for
            // the next fiber.
            // SAFETY: the object is on top of `l` (pushed above).
            unsafe { ffi::lua_settop(l, -2) };
            with_host(|h| h.obj_ready.push(slot));
            return Err(give_back(LErr::plain(format!("fiber.{what}: {e}"))));
        }
    };
    let fid = fiber.id();
    // For the signal that brings a running fiber to a safe point (Lua 5.4: see `hog`).
    fiber.set_layer_word(t as u64);
    with_host(|h| {
        h.recs.insert(
            fid,
            LuaFiber {
                fiber,
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                parent_bt,
                obj_slot: slot,
                storage_ref: 0,
                max_slice: None,
                joiners: 0,
                ended_top: None,
            },
        );
    })
    .ok_or_else(no_host)?;
    // SAFETY: the object is on top, its block ours; the function and its arguments move to
    // `t` (room checked above), leaving the object alone on `l`'s stack.
    unsafe {
        ud.write(FiberUd::new(fid));
        ffi::lua_insert(l, 1);
        ffi::lua_xmove(l, t, n);
    }
    Ok(fid)
}

/// Moves the outcome of a joined fiber's function to the joiner's call: `true` and its
/// results, or `false` and its error value; how many values were pushed. `rec` is the
/// record of a fiber whose function ended (`done` is set), just removed by the joiner.
pub(super) fn move_outcome(c: &mut Call, rec: &LuaFiber) -> Result<c_int, LErr> {
    let (l, t) = (c.state(), rec.thread);
    // SAFETY: `t` is the fiber's Lua thread, anchored by the record's reference until the
    // caller releases it; the fiber ended (`done`), so the thread is idle and holds its
    // message handler at `MSGH_SLOT` with its results (or its error) above; `l` is the
    // running call's state, given room for what moves (lua_checkstack never raises);
    // lua_xmove moves values between threads of one state without allocating.
    unsafe {
        let ok = rec.done == Some(true);
        let n = if ok {
            (ffi::lua_gettop(t) - MSGH_SLOT).max(0)
        } else {
            1
        };
        if ffi::lua_checkstack(l, n + 1) == 0 {
            return Err(LErr::plain(format!(
                "fiber:join: too many results ({n}) for the joiner's Lua stack"
            )));
        }
        ffi::lua_pushboolean(l, ok as c_int);
        ffi::lua_xmove(t, l, n);
        Ok(n + 1)
    }
}

pub(super) fn create_body(c: &mut Call) -> LResult {
    let fid = spawn_lua(c, "create", true)?;
    // Inside a finalizer it starts at this fiber's next switch (see `finalize`).
    if !super::finalize::may_switch(c) {
        return Ok(1);
    }
    // Start it now: it runs, and this fiber continues as soon as it yields. Not a
    // cancellation point (Tarantool's `fiber_start`): a cancellation of this fiber meanwhile
    // is raised at its next one.
    let quiet = fibertrace_fiber::embed::CancelQuiet::new();
    fibertrace_fiber::yield_to_id(fid);
    drop(quiet);
    Ok(1)
}
lua_fn!(f_create, create_body);

pub(super) fn new_body(c: &mut Call) -> LResult {
    spawn_lua(c, "new", false)?;
    Ok(1)
}
lua_fn!(f_new, new_body);

/// Runs the main chunk in the current fiber (the scheduler's main fiber).
pub(crate) fn run_main_fiber(
    name: &[u8],
    source: &[u8],
    args: &[Vec<u8>],
) -> Result<(), ScriptError> {
    let err = ScriptError::text;
    let Some(main_l) = with_host(|h| h.main_l) else {
        return Err(err("fibertrace: no Lua host on this thread".into()));
    };
    super::info::clear_failed_main();
    // SAFETY: the host's main state, idle (no Lua runs on it).
    let (t, tref) = match unsafe { take_thread(main_l) } {
        Ok(t) => t,
        Err(e) => {
            let m = match e {
                // SAFETY: the idle main state, where the failed protected call of `take_thread`
                // left its error value on top: read, then popped.
                LErr::Raised => unsafe {
                    let m = raw::error_text(main_l, -1);
                    ffi::lua_settop(main_l, -2);
                    m
                },
                LErr::At(m) | LErr::Plain(m) => m,
            };
            return Err(err(format!("fibertrace: cannot start the script: {m}")));
        }
    };
    let Some(me) = fibertrace_fiber::current() else {
        with_host(|h| release_thread(h, t, tref));
        return Err(err("fibertrace: not in a fiber".into()));
    };
    let fid = me.id();
    // The script's code and arguments are loaded by the runtime, not made by the script:
    // charged to code outside fibers (a heap report of what the script made since it
    // started leaves them out).
    let prev = fibertrace_core::heap::switch_to(None);
    let chunkname = std::ffi::CString::new(
        name.iter()
            .map(|&b| if b == 0 { b'?' } else { b })
            .collect::<Vec<u8>>(),
    )
    .unwrap_or_default();
    // SAFETY: `t` is a clean thread of this host, idle; the source bytes outlive the load.
    // The arguments are pushed in a protected call (as many as the stack takes: past it, or
    // out of memory, the script does not start, with the error said).
    let loaded = unsafe {
        let st = ffi::luaL_loadbuffer(t, source.as_ptr().cast(), source.len(), chunkname.as_ptr());
        if st != ffi::LUA_OK {
            Err(raw::error_text(t, -1))
        } else {
            let pushed = raw::protect(t, &[], &mut |t| {
                #[cfg(not(feature = "luajit"))]
                if ffi::lua_checkstack(t, args.len() as c_int + 1) == 0 {
                    raw::push_str(t, "stack overflow");
                    ffi::lua_error(t);
                }
                // (LuaJIT grows the stack at each push, or raises `stack overflow`.)
                for a in args {
                    ffi::lua_pushlstring(t, a.as_ptr().cast(), a.len());
                }
                args.len() as c_int
            });
            match pushed {
                Ok(_) => Ok(()),
                Err(_) => Err(format!(
                    "fibertrace: cannot pass {} arguments to the script as its `...` (more \
                     than a Lua stack holds): {}; the script was not run",
                    args.len(),
                    raw::error_text(t, -1)
                )),
            }
        }
    };
    fibertrace_core::heap::restore(prev);
    if let Err(m) = loaded {
        with_host(|h| release_thread(h, t, tref));
        return Err(err(m));
    }
    // For the signal that brings a running fiber to a safe point (Lua 5.4: see `hog`).
    me.set_layer_word(t as u64);
    let parent_bt = me.parent_trace().is_some();
    with_host(|h| {
        h.recs.insert(
            fid,
            LuaFiber {
                fiber: me,
                thread: t,
                thread_ref: tref,
                joinable: false,
                done: None,
                trace_cache: None,
                parent_bt,
                obj_slot: 0,
                storage_ref: 0,
                max_slice: None,
                joiners: 0,
                ended_top: None,
            },
        )
    });
    // SAFETY: `t` holds the handler, the chunk and its arguments, and is ours.
    let ok = unsafe { call_in_thread(t, args.len() as c_int) };
    let r = if ok {
        Ok(())
    } else {
        // The message first: an error object's `__tostring` may switch fibers (a sleep),
        // which the end of the run would turn into this fiber's cancellation (the error
        // was lost: only "fiber was cancelled" was said).
        // SAFETY: the error is on top of our idle thread.
        let b = unsafe { raw::error_bytes(t, -1) };
        // The script failed: it ends now (as in Tarantool), not once the other fibers are
        // done — one that only yields would hold its error back forever.
        fibertrace_fiber::end_run_after_turn();
        // Kept for the exit dumps, written after this fiber has ended.
        super::info::record_failed_main(fid, &super::take_last_frames(), &b);
        Err(ScriptError {
            message: String::from_utf8_lossy(&b).into_owned(),
            message_bytes: b,
            traceback: super::take_last_trace().unwrap_or_default(),
        })
    };
    with_host(|h| {
        remove_rec(h, fid, MAIN_ENDED);
        release_thread(h, t, tref);
    });
    r
}
