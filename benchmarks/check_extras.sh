#!/usr/bin/env bash
# Install each extra alone into a fresh virtual environment and run what it is for. This proves that
# pyproject.toml's extras are enough for their packages as pip really installs them;
# tests/test_package_imports.py proves the same about imports, inside the development venv.
#
# Usage: benchmarks/check_extras.sh [EXTRA ...]     (default: sim serve emulate loadgen ray)
# Env:   PYTHON (default python3) builds the venvs; KEEP_VENVS=1 keeps them (their path is printed).
# Exit status: the number of failed steps (0 = all passed). Logs of failed steps are tailed inline.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/basin-extras.XXXXXX")"
if [[ "${KEEP_VENVS:-0}" == 1 ]]; then
    echo "venvs kept under $WORK"
else
    trap 'rm -rf "$WORK"' EXIT
fi

# extra|command, run from the repo root (the basin policy reads models/peak_predictor.onnx from there).
CHECKS=(
    "sim|basin-sim run --scenario surge-100 --deployment 1p3d-h100 --policy sglang --seed 1 --json --synthetic --quiet"
    "sim|basin-sim run --scenario surge-100 --deployment 1p3d-h100 --policy basin --seed 1 --json --synthetic --quiet"
    "serve|basin-gateway --help"
    "emulate|basin-emulate --help"
    "loadgen|python -m basin_loadgen.replay_client --help"
    # a local Ray instance started by the command itself; the rate given, so nothing is calibrated first
    "ray|basin-sim compare --scenarios surge-100 --deployments 1p3d-h100 --policies sglang --seeds 1 2 --synthetic --overload-rate 0.3 --executor ray"
)
if [[ $# -gt 0 ]]; then EXTRAS=("$@"); else EXTRAS=(sim serve emulate loadgen ray); fi

failures=0
SUMMARY=()

# step NAME LOG COMMAND...: run COMMAND with output to LOG; print PASS/FAIL with the wall time.
step() {
    local name="$1" log="$2"
    shift 2
    local start=$EPOCHREALTIME
    "$@" >"$log" 2>&1
    local rc=$?
    local took
    took=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    if [[ $rc -eq 0 ]]; then
        printf 'PASS  %6ss  %s\n' "$took" "$name"
        SUMMARY+=("PASS  ${took}s  $name")
    else
        printf 'FAIL  %6ss  %s  (exit %d; last lines of %s)\n' "$took" "$name" "$rc" "$log"
        tail -n 15 "$log" | sed 's/^/      | /'
        SUMMARY+=("FAIL  ${took}s  $name (exit $rc)")
        failures=$((failures + 1))
    fi
    return $rc
}

for extra in "${EXTRAS[@]}"; do
    venv="$WORK/$extra"
    echo "== [$extra]  $venv"
    if ! step "[$extra] create venv" "$WORK/$extra-venv.log" "$PYTHON" -m venv "$venv"; then continue; fi
    if ! step "[$extra] pip install -e .[$extra]" "$WORK/$extra-install.log" \
        "$venv/bin/python" -m pip install --quiet -e "$ROOT[$extra]"; then continue; fi
    found=0
    for check in "${CHECKS[@]}"; do
        [[ "${check%%|*}" == "$extra" ]] || continue
        found=1
        command="${check#*|}"
        log="$WORK/$extra-$(printf '%s' "$command" | tr -c 'A-Za-z0-9' '_' | cut -c1-80).log"
        if step "[$extra] $command" "$log" \
            env -C "$ROOT" PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" bash -c "$command"; then
            head -n 1 "$log" | cut -c1-240 | sed "s/^/      > /"
        fi
    done
    if [[ $found -eq 0 ]]; then
        echo "FAIL  no check is defined for extra '$extra'"
        failures=$((failures + 1))
    fi
done

echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
echo "$failures failed"
exit "$failures"
