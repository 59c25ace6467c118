#!/bin/sh
# Every speed figure of issue #20 beside its peer, measured in the same run:
#  1. the Rust figures (criterion: `cargo bench -p fibertrace-fiber --bench speed`): precise
#     capture vs libunwind, suspended walk vs its pointer-chase floor, yield, codec vs CBF;
#  2. the Lua figures: examples/bench.lua under `fibertrace run` and `tarantool`, alternately,
#     N runs each at 1,000 / 10,000 / 30,000 sleeping fibers (default N = 3), medians.
# Usage: sh examples/speed.sh [N]      (from anywhere; builds the release binary first)
# Environment: SPEED_LUA_ONLY=1 skips the Rust figures; FIBERTRACE_BIN / TARANTOOL name other
# binaries; SPEED_SIZES (default "1000 10000 30000") the fiber counts; SPEED_COUNTS (default
# "100000 500000") the fibers created and the switches of each fiber per run.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$here/..
n=${1:-3}
case $n in '' | *[!0-9]*) echo "N must be a number of runs, not '$n'" >&2; exit 2 ;; esac
[ "$n" -ge 1 ] || { echo "N must be at least 1" >&2; exit 2; }
sizes=${SPEED_SIZES:-1000 10000 30000}
counts=${SPEED_COUNTS:-100000 500000}
for v in $sizes $counts; do
    case $v in *[!0-9]* | 0*) echo "SPEED_SIZES and SPEED_COUNTS take positive numbers, not '$v'" >&2; exit 2 ;; esac
done
set -- $counts
[ $# -eq 2 ] || { echo "SPEED_COUNTS takes two numbers (fibers created, switches), not '$counts'" >&2; exit 2; }
creates=$1 switches=$2
if [ -z "${SPEED_LUA_ONLY:-}" ]; then
    rust=$(mktemp)
    if ! (cd "$root" && cargo bench -q -p fibertrace-fiber --bench speed) > "$rust" 2>&1; then
        cat "$rust" >&2
        rm -f "$rust"
        echo "the Rust figures failed: cargo bench -p fibertrace-fiber --bench speed" >&2
        exit 1
    fi
    grep -v '^Benchmarking\|^Found\|outlier\|^Warning\|^ *$\|change:\|Performance has\|hange within noise\|No change in\|^ *[0-9]* ([0-9.]*%) ' "$rust" || true
    rm -f "$rust"
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
out=$(mktemp) one=$(mktemp)
trap 'rm -f "$out" "$one"' EXIT
# One run of bench.lua: its figures become "prog size key value" records (ns, or us per
# fiber); a run that fails or lacks a figure ends the script with what it printed.
run() { # prog-name size command...
    p=$1 s=$2
    shift 2
    if ! "$@" "$here/bench.lua" "$creates" "$switches" "$s" > "$one" 2>&1; then
        cat "$one" >&2
        echo "$p failed on examples/bench.lua at $s fibers" >&2
        exit 1
    fi
    got=$(awk -v p="$p" -v s="$s" '
        /^first fiber.info\(\) of the process/ { print p, s, "first", $6; print p, s, "firstkb", $10 + 0 }
        /^fiber.create/ { print p, s, "create", $(NF - 3) }
        /^yield ping-pong/ { print p, s, "yield", $(NF - 3) }
        /^fiber.info\(\) over [0-9]+ fibers:/ { print p, s, "bt", $(NF - 1) * 1000 / $3 }
        /^fiber.info\(\) over [0-9]+ fibers, mean/ { print p, s, "btmean", $(NF - 1) * 1000 / $3 }
        /^fiber.info\(\{backtrace = false\}\) over [0-9]+ fibers:/ { print p, s, "nobt", $(NF - 1) * 1000 / $5 }
        /^fiber.info\(\{backtrace = false\}\) over [0-9]+ fibers, mean/ { print p, s, "nobtmean", $(NF - 1) * 1000 / $5 }
        /^fiber.info\(\) over [0-9]+ fibers, each moved/ { print p, s, "moved", $(NF - 1) * 1000 / $3 }
    ' "$one")
    if [ "$(printf '%s\n' "$got" | grep -c .)" -ne 9 ]; then
        cat "$one" >&2
        echo "$p: examples/bench.lua at $s fibers did not print its nine figures" >&2
        exit 1
    fi
    # (The memory the first listing added may be nothing.)
    if [ "$(printf '%s\n' "$got" | awk '$3 == "firstkb" || $4 > 0' | grep -c .)" -ne 9 ]; then
        cat "$one" >&2
        echo "$p: a figure at $s fibers is too small to measure (0): use more fibers" >&2
        exit 1
    fi
    printf '%s\n' "$got" >> "$out"
}
for size in $sizes; do
    i=0
    while [ "$i" -lt "$n" ]; do
        run fibertrace "$size" "$bin" run
        [ -z "$tt" ] || run tarantool "$size" "$tt"
        i=$((i + 1))
    done
done
median() { # prog size-or-* key
    awk -v p="$1" -v s="$2" -v k="$3" '$1 == p && (s == "*" || $2 == s) && $3 == k { print $4 }' "$out" |
        sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else exit 1 }'
}
# The spread behind a median: "min-max" of the runs of both programs, so that a verdict that
# rests on one lucky or unlucky run shows as such (this machine's kind has steal time).
spread() { # size-or-* key -> "fibertrace min-max, tarantool min-max"
    for p in fibertrace tarantool; do
        awk -v p="$p" -v s="$1" -v k="$2" '$1 == p && (s == "*" || $2 == s) && $3 == k { print $4 }' "$out" |
            sort -g | awk -v p="$p" 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%s%.4g-%.4g", (p == "fibertrace" ? "" : ", tarantool "), lo, hi }'
    done
}
verdict() { # holds? -> word
    if [ "$1" = 1 ]; then echo holds; else echo MISSED; fi
}
echo
echo "== speed goals (issue #20): Lua figures, medians of $n alternating runs per size =="
cpu=$(sed -n 's/^model name[[:space:]]*:[[:space:]]*//p' /proc/cpuinfo 2> /dev/null | head -n 1)
echo "on ${cpu:-an unknown CPU}, tarantool: $([ -n "$tt" ] && "$tt" --version 2> /dev/null | head -n 1 || echo none)"
if [ -z "$tt" ]; then
    for size in $sizes; do
        printf 'fiber.info({backtrace=false}) %5d fibers: %.3f us per fiber (mean %.3f); fiber.info(): %.3f (mean %.3f); each moved: %.3f\n' \
            "$size" "$(median fibertrace "$size" nobt)" "$(median fibertrace "$size" nobtmean)" \
            "$(median fibertrace "$size" bt)" "$(median fibertrace "$size" btmean)" \
            "$(median fibertrace "$size" moved)"
    done
    printf 'Lua yield: %s ns per switch; create+run: %s ns per fiber\n' \
        "$(median fibertrace '*' yield)" "$(median fibertrace '*' create)"
    printf 'first fiber.info() of a process: %s ms, +%s kB resident\n' \
        "$(median fibertrace '*' first)" "$(median fibertrace '*' firstkb)"
    exit 0
fi
for size in $sizes; do
    a=$(median fibertrace "$size" nobt) b=$(median tarantool "$size" nobt)
    ok=$(awk -v a="$a" -v b="$b" 'BEGIN { print (a / b <= 0.5) }')
    awk -v s="$size" -v a="$a" -v b="$b" -v v="$(verdict "$ok")" -v r="$(spread "$size" nobt)" 'BEGIN {
        printf "fiber.info({backtrace=false}), %5d fibers   %7.3f us/fiber vs tarantool %7.3f: %6.3fx  (goal <= 0.5)  %s  [runs %s]\n", s, a, b, a / b, v, r }'
done
lo= hi=
for key in bt moved; do
    for size in $sizes; do
        a=$(median fibertrace "$size" $key) b=$(median tarantool "$size" $key)
        ok=$(awk -v a="$a" -v b="$b" 'BEGIN { print (b / a >= 40) }')
        case $key in bt) what="fiber.info() with backtraces," ;; *) what="  the same, every fiber moved," ;; esac
        awk -v w="$what" -v s="$size" -v a="$a" -v b="$b" -v v="$(verdict "$ok")" -v r="$(spread "$size" $key)" 'BEGIN {
            printf "%s %5d fibers   %7.3f us/fiber vs tarantool %7.3f: %6.1fx faster  (goal >= 40)  %s  [runs %s]\n", w, s, a, b, b / a, v, r }'
        if [ $key = bt ]; then
            lo=$(awk -v x="$a" -v m="${lo:-$a}" 'BEGIN { print (x < m ? x : m) }')
            hi=$(awk -v x="$a" -v m="${hi:-$a}" 'BEGIN { print (x > m ? x : m) }')
        fi
    done
done
ok=$(awk -v l="$lo" -v h="$hi" 'BEGIN { print (h / l <= 1.3) }')
awk -v l="$lo" -v h="$hi" -v v="$(verdict "$ok")" 'BEGIN {
    printf "fiber.info() with backtraces, flatness        max/min over sizes %.3f  (goal <= 1.3)  %s\n", h / l, v }'
# The figures above are each run's best call; the mean of its calls also carries the
# collector's work on their garbage, which the best call mostly escapes: printed beside, with
# no goal, so that a figure that holds only at its best shows as such.
for size in $sizes; do
    a=$(median fibertrace "$size" nobtmean) b=$(median tarantool "$size" nobtmean)
    awk -v s="$size" -v a="$a" -v b="$b" 'BEGIN {
        printf "%-40s %5d fibers %7.3f us/fiber vs tarantool %7.3f: %6.3fx  (no goal)\n", "  without backtraces, mean of 11 calls,", s, a, b, a / b }'
done
for size in $sizes; do
    a=$(median fibertrace "$size" btmean) b=$(median tarantool "$size" btmean)
    awk -v s="$size" -v a="$a" -v b="$b" 'BEGIN {
        printf "%-40s %5d fibers %7.3f us/fiber vs tarantool %7.3f: %6.1fx faster  (no goal)\n", "  with backtraces, mean of 11 calls,", s, a, b, b / a }'
done
# The first listing of a process loads what listings need: no goal in #20's table, printed
# because a server's first fiber.info() (an admin console's, a monitor's) pays it at once.
a=$(median fibertrace '*' first) b=$(median tarantool '*' first)
ak=$(median fibertrace '*' firstkb) bk=$(median tarantool '*' firstkb)
awk -v a="$a" -v b="$b" -v ak="$ak" -v bk="$bk" -v r="$(spread '*' first)" 'BEGIN {
    printf "%-44s %7.2f ms, +%d kB resident vs tarantool %.2f ms, +%d kB: %.3fx  (no goal)  [runs %s]\n", "first fiber.info() of a process, 1 fiber", a, ak, b, bk, a / b, r }'
for k in yield create; do
    a=$(median fibertrace '*' $k) b=$(median tarantool '*' $k)
    case $k in yield) goal=0.33 what="Lua yield, ns per switch" ;; *) goal=0.4 what="Lua fiber.create (create + run), ns" ;; esac
    ok=$(awk -v a="$a" -v b="$b" -v g="$goal" 'BEGIN { print (a / b <= g) }')
    awk -v w="$what" -v a="$a" -v b="$b" -v g="$goal" -v v="$(verdict "$ok")" -v r="$(spread '*' $k)" 'BEGIN {
        printf "%-44s %7.1f vs tarantool %7.1f: %6.3fx  (goal <= %s)  %s  [runs %s]\n", w, a, b, a / b, g, v, r }'
done
