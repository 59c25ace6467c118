#!/usr/bin/env bash
# Builds and runs the user-build check (src/main.rs) the way a user's crate is built: from a
# directory outside this repository, so that the repository's .cargo/config.toml (which forces
# frame pointers) does not apply, with the profile settings of each cell of the matrix.
#
#   tests/user-build/run.sh            every cell
#   tests/user-build/run.sh CELL...    some cells (names as printed: dev-nofp-debug2, ...)
#
# Cells: {dev, release} x {nofp, fp} x {debug0, lines, debug2}, plus release-small (no frame
# pointers, panic = "abort", lto = "fat", opt-level = "s", debug = 0), plus lua-dev and
# lua-release (tests/user-build-lua: the Lua host embedded in a user's crate, no frame
# pointers, default debug info). Each cell has its own target directory under
# target/user-build/ (kept between runs: a second run is quick; FT_USER_BUILD_CLEAN=1 removes
# each cell's directory once the cell has run, for a machine short of disk: 15 full builds
# kept side by side take several GB). FT_USER_BUILD_JOBS cells are built at once (default 2: a
# cell's build leaves a core idle a third of the time, in its serial chain of crates); each
# cell's output is printed whole when it ends.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
targets="${FT_USER_BUILD_TARGET:-$repo/target/user-build}"
outside="$(mktemp -d)"
# (Cells still building when the script ends early are stopped with it.)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$outside"' EXIT

all_cells=()
for prof in dev release; do
  for fp in nofp fp; do
    for dbg in debug0 lines debug2; do
      all_cells+=("$prof-$fp-$dbg")
    done
  done
done
all_cells+=("release-small" "lua-dev" "lua-release")
cells=("$@")
[ "${#cells[@]}" -gt 0 ] || cells=("${all_cells[@]}")

# One cell: built, then run; its status is the run's (a failed build fails it too).
run_cell() {
  local cell="$1"
  prof="${cell%%-*}"
  envs=(-u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS -u CARGO_BUILD_RUSTFLAGS -u CFLAGS)
  manifest="$here/Cargo.toml"
  binname=user_build
  PROF_UP="$(echo "$prof" | tr a-z A-Z)"
  lines=0
  fpflag=0
  case "$cell" in
    release-small)
      envs+=(CARGO_PROFILE_RELEASE_PANIC=abort CARGO_PROFILE_RELEASE_LTO=fat
             CARGO_PROFILE_RELEASE_OPT_LEVEL=s CARGO_PROFILE_RELEASE_DEBUG=0) ;;
    lua-dev|lua-release)
      prof="${cell#lua-}"
      manifest="$here/../user-build-lua/Cargo.toml"
      binname=user_build_lua
      [ "$prof" = dev ] && lines=1 ;;
    *-*-*)
      fp="$(echo "$cell" | cut -d- -f2)"
      dbg="$(echo "$cell" | cut -d- -f3)"
      case "$fp" in
        fp) envs+=("RUSTFLAGS=-C force-frame-pointers=yes"); fpflag=1 ;;
        nofp) ;;
        *) echo "unknown cell $cell" >&2; return 2 ;;
      esac
      case "$dbg" in
        debug0) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=0") ;;
        lines) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=line-tables-only"); lines=1 ;;
        debug2) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=2"); lines=1 ;;
        *) echo "unknown cell $cell" >&2; return 2 ;;
      esac ;;
    *) echo "unknown cell $cell" >&2; return 2 ;;
  esac
  case "$prof" in
    dev) profdir=debug; relflag=() ;;
    release) profdir=release; relflag=(--release) ;;
    *) echo "unknown cell $cell" >&2; return 2 ;;
  esac
  echo "== user build: $cell"
  # Built from $outside: cargo reads .cargo/config.toml from the current directory upwards.
  (cd "$outside" && env "${envs[@]}" cargo build -q "${relflag[@]}" \
      --manifest-path "$manifest" --target-dir "$targets/$cell")
  bin="$targets/$cell/$profdir/$binname"
  # FT_FRAME_POINTERS: the binary checks that its own code was built as the cell says (the
  # repository's frame-pointer flag must not leak into a user's build).
  (cd "$outside" && env FT_EXPECT_LINES="$lines" FT_FRAME_POINTERS="$fpflag" "$bin")
}

for cell in "${cells[@]}"; do
  case " ${all_cells[*]} " in
    *" $cell "*) ;;
    *) echo "unknown cell $cell" >&2; exit 2 ;;
  esac
done

jobs_max="${FT_USER_BUILD_JOBS:-2}"
case "$jobs_max" in
  ''|*[!0-9]*|0) echo "FT_USER_BUILD_JOBS must be a positive whole number, not '$jobs_max'" >&2; exit 2 ;;
esac
logs="$outside/logs"
mkdir -p "$logs"
failed=()
passed=0
running=()
# Waits for the oldest running cell, prints its output and counts it.
finish_oldest() {
  local cell="${running[0]}" pid="${pids[0]}"
  running=("${running[@]:1}")
  pids=("${pids[@]:1}")
  if wait "$pid"; then
    passed=$((passed + 1))
  else
    failed+=("$cell")
  fi
  cat "$logs/$cell"
  if [ "${FT_USER_BUILD_CLEAN:-0}" = 1 ]; then rm -rf "${targets:?}/$cell"; fi
}
pids=()
for cell in "${cells[@]}"; do
  if [ "${#running[@]}" -ge "$jobs_max" ]; then finish_oldest; fi
  (set -e; run_cell "$cell") > "$logs/$cell" 2>&1 &
  pids+=("$!")
  running+=("$cell")
done
while [ "${#running[@]}" -gt 0 ]; do finish_oldest; done
echo "user build cells: ${passed} passed, ${#failed[@]} failed${failed:+ (${failed[*]})}"
[ "${#failed[@]}" -eq 0 ]
