#!/usr/bin/env bash
# Runs the Tarantool-parity scripts of this directory under one program.
#
#   tests/tarantool/run.sh fibertrace [BINARY]   # default: target/release/fibertrace
#                                                 # of this repository, else `fibertrace`
#   tests/tarantool/run.sh tarantool [BINARY]    # default: `tarantool`
#
# Each script runs with a time limit (TIMEOUT seconds, 120 by default); its
# failing cases and its closing `N passed, N failed` line are shown. Exits 1
# if any case failed, any script timed out or crashed, or printed no summary.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
kind="${1:-}"
limit="${TIMEOUT:-120}"

case "$kind" in
fibertrace)
    bin="${2:-}"
    if [ -z "$bin" ]; then
        if [ -x "$root/target/release/fibertrace" ]; then
            bin="$root/target/release/fibertrace"
        else
            bin=fibertrace
        fi
    fi
    cmd=("$bin" run)
    ;;
tarantool)
    bin="${2:-tarantool}"
    cmd=("$bin")
    ;;
*)
    echo "usage: $0 fibertrace|tarantool [binary path]" >&2
    exit 2
    ;;
esac

if ! command -v "$bin" >/dev/null 2>&1; then
    echo "run.sh: $bin not found" >&2
    exit 2
fi

scripts=(fiber.lua fiber_channel.lua fiber_cond.lua clock.lua fiber_unit.lua post26.lua)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

status=0
total_passed=0
total_failed=0
for script in "${scripts[@]}"; do
    log="$out/$script.log"
    timeout -k 10 "$limit" "${cmd[@]}" "$here/$script" >"$log" 2>"$out/$script.err"
    rc=$?
    summary="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)"
    grep -E '^not ok ' "$log" | sed "s/^/  $script: /"
    if [ -z "$summary" ]; then
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            echo "$script: timed out after ${limit}s"
        else
            echo "$script: no summary line (exit code $rc)"
            tail -n 5 "$out/$script.err" | sed 's/^/    /'
        fi
        status=1
        continue
    fi
    echo "$script: $summary"
    read -r p _ f _ <<<"$summary"
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + ${f%,}))
    if [ "$rc" -ne 0 ] || [ "${f%,}" -ne 0 ]; then
        status=1
    fi
done

echo "total: $total_passed passed, $total_failed failed"
exit "$status"
