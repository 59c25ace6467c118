//! fibertrace-lua: Lua frames interleaved with native frames, and the `fibertrace`
//! command-line program.
//!
//! The pipeline, one folder per stage:
//! * [`frames`] — capture the Lua stack of a `lua_State` (running or suspended), following the
//!   chain of Lua coroutines running inside it, and intern each level's description once in a
//!   process-wide table ([`frames::intern`]): a Lua level becomes a 16-byte
//!   [`Frame::Lua`](fibertrace_core::Frame::Lua).
//! * [`interleave`](mod@interleave) — classify native frames as Lua-VM code or not (address ranges built once
//!   from the ELF symbol tables), anchor each Lua "C" level at the native frame of its
//!   `lua_CFunction`, and put each run of Lua levels where the VM's frames were. Works with the
//!   frame-pointer walk (LuaJIT's interpreter is crossed with a registered frame-record hop,
//!   [`fibertrace_core::unwind::hop`]) and with the DWARF walk.
//! * [`render`] — names for Lua frames in core's formatters, and Tarantool's `{L = ...}` lines.
//!
//! The Lua flavour is chosen with cargo features: `luajit` (default, vendored LuaJIT 2.1) or
//! `lua54` (vendored Lua 5.4); exactly one must be enabled.
//!
//! ```
//! use fibertrace_lua::{capture_current, render, InterleaveOptions};
//! let lua = mlua::Lua::new();
//! let root = lua.current_thread();
//! let f = lua.create_function(move |_, ()| {
//!     let bt = capture_current(&root, &InterleaveOptions::default());
//!     Ok(render::tarantool(bt.frames()))
//! }).unwrap();
//! lua.globals().set("trace", f).unwrap();
//! let text: String = lua
//!     .load("local function leaf()\n  local t = trace()\n  return t\nend\nlocal s = leaf()\nreturn s")
//!     .set_name("@demo.lua")
//!     .eval()
//!     .unwrap();
//! assert!(text.contains(" leaf in @demo.lua:2\n"), "{text}");
//! assert!(text.contains(" main chunk in @demo.lua:5\n"), "{text}");
//! ```

#[cfg(all(feature = "luajit", feature = "lua54"))]
compile_error!("fibertrace-lua: enable exactly one Lua flavour: `luajit` or `lua54`, not both");
#[cfg(not(any(feature = "luajit", feature = "lua54")))]
compile_error!("fibertrace-lua: enable one Lua flavour: `luajit` (default) or `lua54`");

pub mod decode;
pub mod frames;
pub mod heap;
pub mod host;
pub mod interleave;
pub mod render;
pub mod symbols;

pub use frames::intern::{describe, LuaFrameInfo, LuaKind};
pub use frames::{capture_lua_stack, LuaLevel, LuaStack};
pub use heap::{heap_baseline, heap_groups, heap_text, heap_text_since, HeapBaseline};
pub use host::{LuaHost, ScriptError, HOST_CHUNK};
pub use interleave::{
    capture_current, capture_current_raw, capture_interleaved, capture_interleaved_with,
    interleave, prepare, InterleaveOptions,
};

/// The Lua API this crate is built against (mlua's raw bindings for the chosen flavour).
pub use mlua::ffi;
