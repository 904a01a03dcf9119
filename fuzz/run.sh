#!/usr/bin/env bash
# Builds the fuzz targets and runs each for FUZZ_SECONDS (`make fuzz`, `make fuzz-ci`; see
# docs/fuzzing.md). Fails on the first target that finds a crash, a panic, a timeout or an
# allocation past the limits; its input is then in fuzz/artifacts/<target>/.
#
#   FUZZ_SECONDS   seconds per target (default 25)
#   FUZZ_TARGETS   targets to run (default: all)
#   FUZZ_FLAGS     extra libFuzzer flags (default: the memory limits and a per-input timeout)
#
# New inputs go to fuzz/target/corpus/<target>/ (not committed), so a longer `make fuzz` starts
# from where the last one ended; the committed seeds in fuzz/corpus/<target>/ and the inputs that
# once failed, fuzz/regressions/<target>/, are only read.
set -euo pipefail

cd "$(dirname "$0")"
SECONDS_PER_TARGET=${FUZZ_SECONDS:-25}
TARGETS=${FUZZ_TARGETS:-"manifest metadata_arrow cache_resigned state_json ring_attach"}
FLAGS=${FUZZ_FLAGS:-"-rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10"}

# cargo-fuzz passes nightly -Z flags; the stable toolchain accepts them with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
# CI keeps the instrumented build in one place across runs (FUZZ_TARGET_DIR); by default it is
# fuzz/target. It is never the main build's directory: the sanitizer flags would rebuild it.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
cargo fuzz build --codegen-units 16

scratch=$(mktemp -d "${TMPDIR:-/tmp}/drt-fuzz.XXXXXX")
cleanup() {
    rm -rf "$scratch"
    # Segments of ring_attach left by an aborted run (a clean run removes its own).
    rm -f /dev/shm/dataset-rt-*-fuzz*-ctl /dev/shm/dataset-rt-*-fuzz*-ring
}
trap cleanup EXIT
export DRT_FUZZ_SCRATCH=$scratch

summary=()
for t in $TARGETS; do
    mkdir -p "target/corpus/$t" "artifacts/$t"
    log="$scratch/$t.log"
    echo "== fuzz $t for ${SECONDS_PER_TARGET}s"
    # Inputs that once crashed a target are replayed first, every run.
    dirs=("target/corpus/$t" "corpus/$t")
    [ -d "regressions/$t" ] && dirs+=("regressions/$t")
    extra=""
    # Structured inputs need their full length from the start.
    [ "$t" = cache_resigned ] && extra="-len_control=0"
    # shellcheck disable=SC2086  # FLAGS and extra are lists of flags
    if ! cargo fuzz run --codegen-units 16 "$t" "${dirs[@]}" -- \
        -max_total_time="$SECONDS_PER_TARGET" -artifact_prefix="artifacts/$t/" \
        -print_final_stats=1 $FLAGS $extra >"$log" 2>&1; then
        tail -n 60 "$log"
        echo "fuzz: target $t FAILED; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
    summary+=("$t: ${runs:-?} executions clean in ${SECONDS_PER_TARGET}s (${cov:-cov: ?})")
done
echo "== fuzz summary"
printf '%s\n' "${summary[@]}"
