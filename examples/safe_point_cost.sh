#!/bin/sh
# What the safe points cost compiled Lua code: examples/jit_loops.lua under `fibertrace run`
# with them (the default) and without (FIBERTRACE_LUA_SAFE_POINTS=0), alternately, N runs
# each (default 7); prints the median CPU seconds of each loop and their ratio.
# Usage: sh examples/safe_point_cost.sh [N]   (after cargo build --release -p fibertrace-lua)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bin=${FIBERTRACE_BIN:-$here/../target/release/fibertrace}
n=${1:-7}
case $n in '' | *[!0-9]*) echo "N must be a number of runs, not '$n'" >&2; exit 2 ;; esac
[ "$n" -ge 1 ] || { echo "N must be at least 1" >&2; exit 2; }
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p fibertrace-lua" >&2; exit 1; }
on=$(mktemp) off=$(mktemp)
trap 'rm -f "$on" "$off"' EXIT
i=0
while [ "$i" -lt "$n" ]; do
    "$bin" run "$here/jit_loops.lua" >> "$on"
    FIBERTRACE_LUA_SAFE_POINTS=0 "$bin" run "$here/jit_loops.lua" >> "$off"
    i=$((i + 1))
done
median() { # column $2 of file $1
    sort -n -k"$2","$2" "$1" | awk -v c="$2" '{ v[NR] = $c } END { print v[int((NR + 1) / 2)] }'
}
printf '%-8s %12s %12s %8s\n' loop "with (s)" "without (s)" ratio
col=1
for name in sieve mandel calls total; do
    a=$(median "$on" $col) b=$(median "$off" $col)
    awk -v n="$name" -v a="$a" -v b="$b" 'BEGIN { printf "%-8s %12.4f %12.4f %8.3f\n", n, a, b, a / b }'
    col=$((col + 1))
done
