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
# kept side by side take several GB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
targets="${FT_USER_BUILD_TARGET:-$repo/target/user-build}"
outside="$(mktemp -d)"
trap 'rm -rf "$outside"' EXIT

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

failed=()
passed=0
for cell in "${cells[@]}"; do
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
        *) echo "unknown cell $cell" >&2; exit 2 ;;
      esac
      case "$dbg" in
        debug0) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=0") ;;
        lines) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=line-tables-only"); lines=1 ;;
        debug2) envs+=("CARGO_PROFILE_${PROF_UP}_DEBUG=2"); lines=1 ;;
        *) echo "unknown cell $cell" >&2; exit 2 ;;
      esac ;;
    *) echo "unknown cell $cell" >&2; exit 2 ;;
  esac
  case "$prof" in
    dev) profdir=debug; relflag=() ;;
    release) profdir=release; relflag=(--release) ;;
    *) echo "unknown cell $cell" >&2; exit 2 ;;
  esac
  echo "== user build: $cell"
  # Built from $outside: cargo reads .cargo/config.toml from the current directory upwards.
  (cd "$outside" && env "${envs[@]}" cargo build -q "${relflag[@]}" \
      --manifest-path "$manifest" --target-dir "$targets/$cell")
  bin="$targets/$cell/$profdir/$binname"
  # FT_FRAME_POINTERS: the binary checks that its own code was built as the cell says (the
  # repository's frame-pointer flag must not leak into a user's build).
  if (cd "$outside" && env FT_EXPECT_LINES="$lines" FT_FRAME_POINTERS="$fpflag" "$bin"); then
    passed=$((passed + 1))
  else
    failed+=("$cell")
  fi
  if [ "${FT_USER_BUILD_CLEAN:-0}" = 1 ]; then rm -rf "${targets:?}/$cell"; fi
done
echo "user build cells: ${passed} passed, ${#failed[@]} failed${failed:+ (${failed[*]})}"
[ "${#failed[@]}" -eq 0 ]
