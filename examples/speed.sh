#!/bin/sh
# Every speed figure of issue #20 beside its peer, measured in the same run:
#  1. the Rust figures (criterion: `cargo bench -p fibertrace-fiber --bench speed`): precise
#     capture vs libunwind, suspended walk vs its pointer-chase floor, yield, codec vs CBF;
#  2. the Lua figures: examples/bench.lua under `fibertrace run` and `tarantool`, alternately,
#     N runs each at 1,000 / 10,000 / 30,000 sleeping fibers (default N = 3), medians.
# Usage: sh examples/speed.sh [N]      (from anywhere; builds the release binary first)
# SPEED_LUA_ONLY=1 skips the Rust figures; FIBERTRACE_BIN / TARANTOOL name other binaries.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$here/..
n=${1:-3}
case $n in '' | *[!0-9]*) echo "N must be a number of runs, not '$n'" >&2; exit 2 ;; esac
[ "$n" -ge 1 ] || { echo "N must be at least 1" >&2; exit 2; }
if [ -z "${SPEED_LUA_ONLY:-}" ]; then
    (cd "$root" && cargo bench -q -p fibertrace-fiber --bench speed 2>&1) |
        grep -v '^Benchmarking\|^Found\|outlier\|^Warning\|^ *$' || true
fi
bin=${FIBERTRACE_BIN:-$root/target/release/fibertrace}
if [ -z "${FIBERTRACE_BIN:-}" ]; then
    (cd "$root" && cargo build -q --release -p fibertrace-lua)
fi
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p fibertrace-lua" >&2; exit 1; }
tt=${TARANTOOL:-tarantool}
if ! command -v "$tt" > /dev/null 2>&1; then
    echo "tarantool is not installed (apt-get install tarantool): the Lua figures have no peer" >&2
    tt=
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# One run of bench.lua: its lines become "prog size key value" records (ns, or us per fiber).
run() { # prog-name size command...
    p=$1 s=$2
    shift 2
    "$@" "$here/bench.lua" 100000 500000 "$s" | awk -v p="$p" -v s="$s" '
        /^fiber.create/ { print p, s, "create", $(NF - 3) }
        /^yield ping-pong/ { print p, s, "yield", $(NF - 3) }
        /^fiber.info\(\) over/ { print p, s, "bt", $(NF - 1) * 1000 / $3 }
        /^fiber.info\(\{backtrace = false\}\) over/ { print p, s, "nobt", $(NF - 1) * 1000 / $5 }
    ' >> "$out"
}
for size in 1000 10000 30000; do
    i=0
    while [ "$i" -lt "$n" ]; do
        run fibertrace "$size" "$bin" run
        [ -z "$tt" ] || run tarantool "$size" "$tt"
        i=$((i + 1))
    done
done
median() { # prog size-or-* key
    awk -v p="$1" -v s="$2" -v k="$3" '$1 == p && (s == "*" || $2 == s) && $3 == k { print $4 }' "$out" |
        sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "nan" }'
}
verdict() { # holds? -> word
    if [ "$1" = 1 ]; then echo holds; else echo MISSED; fi
}
echo
echo "== speed goals (issue #20): Lua figures, medians of $n alternating runs per size =="
if [ -z "$tt" ]; then
    for size in 1000 10000 30000; do
        printf 'fiber.info({backtrace=false}) %5d fibers: %.3f us per fiber; fiber.info(): %.3f\n' \
            "$size" "$(median fibertrace $size nobt)" "$(median fibertrace $size bt)"
    done
    printf 'Lua yield: %s ns per switch; create+run: %s ns per fiber\n' \
        "$(median fibertrace '*' yield)" "$(median fibertrace '*' create)"
    exit 0
fi
for size in 1000 10000 30000; do
    a=$(median fibertrace $size nobt) b=$(median tarantool $size nobt)
    ok=$(awk -v a="$a" -v b="$b" 'BEGIN { print (a > 0 && b > 0 && a / b <= 0.5) }')
    awk -v s="$size" -v a="$a" -v b="$b" -v v="$(verdict "$ok")" 'BEGIN {
        printf "fiber.info({backtrace=false}), %5d fibers   %7.3f us/fiber vs tarantool %7.3f: %6.3fx  (goal <= 0.5)  %s\n", s, a, b, a / b, v }'
done
lo= hi=
for size in 1000 10000 30000; do
    a=$(median fibertrace $size bt) b=$(median tarantool $size bt)
    ok=$(awk -v a="$a" -v b="$b" 'BEGIN { print (a > 0 && b > 0 && b / a >= 40) }')
    awk -v s="$size" -v a="$a" -v b="$b" -v v="$(verdict "$ok")" 'BEGIN {
        printf "fiber.info() with backtraces, %5d fibers   %7.3f us/fiber vs tarantool %7.3f: %6.1fx faster  (goal >= 40)  %s\n", s, a, b, b / a, v }'
    lo=$(awk -v x="$a" -v m="${lo:-$a}" 'BEGIN { print (x < m ? x : m) }')
    hi=$(awk -v x="$a" -v m="${hi:-$a}" 'BEGIN { print (x > m ? x : m) }')
done
ok=$(awk -v l="$lo" -v h="$hi" 'BEGIN { print (l > 0 && h / l <= 1.3) }')
awk -v l="$lo" -v h="$hi" -v v="$(verdict "$ok")" 'BEGIN {
    printf "fiber.info() with backtraces, flatness        max/min over sizes %.3f  (goal <= 1.3)  %s\n", h / l, v }'
for k in yield create; do
    a=$(median fibertrace '*' $k) b=$(median tarantool '*' $k)
    case $k in yield) goal=0.33 what="Lua yield, ns per switch" ;; *) goal=0.4 what="Lua fiber.create (create + run), ns" ;; esac
    ok=$(awk -v a="$a" -v b="$b" -v g="$goal" 'BEGIN { print (a > 0 && b > 0 && a / b <= g) }')
    awk -v w="$what" -v a="$a" -v b="$b" -v g="$goal" -v v="$(verdict "$ok")" 'BEGIN {
        printf "%-44s %7.1f vs tarantool %7.1f: %6.3fx  (goal <= %s)  %s\n", w, a, b, a / b, g, v }'
done
