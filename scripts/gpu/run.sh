#!/usr/bin/env bash
# GPU checks of adag-cuda, for a machine with an NVIDIA GPU and its driver.
#
#   scripts/gpu/run.sh                      # build here with cargo, then test and bench
#   scripts/gpu/run.sh --prebuilt DIR       # run binaries made by scripts/gpu/bundle.sh
#   options: --quick (bench up to 16 MiB)  --no-bench  --no-tests
#
# What it does, printing each step and a summary at the end:
#   1. shows the GPU (nvidia-smi) and picks the cudarc CUDA feature from the driver's CUDA
#      version (nvidia-smi), else nvcc, else cuda-12060; ADAG_CUDA_FEATURE=cuda-XXXXX overrides;
#   2. finds NCCL: ADAG_NCCL_LIB_DIR, a pip wheel (python3 -c 'import nvidia.nccl'), ldconfig,
#      the usual directories, then a bounded search of /. cudarc 0.19 opens "libnccl.so" (or
#      libnccl.so.<CUDA major>, .so.12, .so.11, ...) but never "libnccl.so.2", the only name
#      the runtime packages install, so when only libnccl.so.2 exists the script makes
#      target/nccl-shim/libnccl.so -> .../libnccl.so.2 and puts both directories first on
#      LD_LIBRARY_PATH. Without NCCL: `pip install nvidia-nccl-cu12` (nvidia-nccl-cu13 for
#      CUDA 13) and rerun, or point ADAG_NCCL_LIB_DIR at a directory holding libnccl.so.2;
#      the CUDA-only tests still run and the NCCL ones are reported as NOT RUN;
#   3. runs every test of adag-cuda, the #[ignore]d GPU ones included, one at a time
#      (cargo test -p adag-cuda -- --include-ignored --test-threads=1);
#   4. runs the 1F1B pipeline graph of tests/collectives.rs (2 stages, 4 micro-batches) on the
#      NCCL communicator (cuda/tests/gpu_pipeline.rs, gpu_nccl_1f1b_pipeline): the compiler must
#      order every receive to meet its send, as NCCL sends are rendezvous; reported on its own
#      line (NOT RUN without a GPU or NCCL; SKIPPED with one GPU if NCCL refuses two ranks on it);
#   4b. runs an NCCL tensor edge between actors on two hosts (cuda/tests/gpu_pipeline.rs,
#      gpu_nccl_across_hosts): the unique id reaches the remote rank through the driver
#      (SKIPPED with one GPU once NCCL, its ranks met, refuses to share the device);
#   5. runs the bench (cuda/src/bin/nccl-bench.rs): copies, then allreduce and send/recv with
#      two ranks (two GPUs, or two ranks on one GPU if NCCL allows it), and one-rank NCCL.
# Every step has a timeout; the whole script stays under about 8 minutes. Logs and a summary
# go to $OUT (the device tool's output folder) or target/gpu-out.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$(date +%s)
PREBUILT=""
BENCH_ARGS=(--max 256M)
RUN_BENCH=1
RUN_TESTS=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prebuilt) PREBUILT="$(cd "$2" && pwd)"; shift 2 ;;
        --quick) BENCH_ARGS=(--max 16M --max-iters 100); shift ;;
        --no-bench) RUN_BENCH=0; shift ;;
        --no-tests) RUN_TESTS=0; shift ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)"; exit 64 ;;
    esac
done
LOG_DIR="${OUT:-$ROOT/target/gpu-out}"
mkdir -p "$LOG_DIR"
SUMMARY=()
FAILED=0
elapsed() { echo "$(( $(date +%s) - START ))s"; }
section() { echo; echo "=================== $* [$(elapsed)]"; }
result() { SUMMARY+=("$1: $2"); echo ">>> $1: $2"; case "$2" in FAIL*) FAILED=1 ;; esac; }

section "1. machine"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi 2>&1 | head -25
    timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
    SMI_CUDA="$(timeout 30 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\.[0-9]*\).*/\1/p' | head -1)"
else
    echo "nvidia-smi: not found"
    SMI_CUDA=""
fi
NVCC_CUDA=""
if command -v nvcc >/dev/null 2>&1; then
    NVCC_CUDA="$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -1)"
    echo "nvcc: CUDA $NVCC_CUDA"
else
    echo "nvcc: not found (not needed: adag-cuda compiles no kernels)"
fi
echo "glibc: $(ldd --version 2>/dev/null | head -1)"

section "2. CUDA version -> cargo feature"
# The feature fixes cudarc's bindings; the driver must be at least that version.
SUPPORTED=(13020 13010 13000 12090 12080 12060 12050 12040 12030 12020 12010 12000 11080)
pick_feature() { # "12.8" -> the newest supported feature not newer than it
    local v="$1" major minor want f
    major="${v%%.*}"; minor="${v#*.}"; minor="${minor%%.*}"
    want=$(( major * 1000 + minor * 10 ))
    for f in "${SUPPORTED[@]}"; do
        if [ "$f" -le "$want" ]; then echo "cuda-$f"; return; fi
    done
    echo "cuda-11080"
}
if [ -n "${ADAG_CUDA_FEATURE:-}" ]; then
    FEATURE="$ADAG_CUDA_FEATURE"; WHY="ADAG_CUDA_FEATURE"
elif [ -n "$SMI_CUDA" ]; then
    FEATURE="$(pick_feature "$SMI_CUDA")"; WHY="driver supports CUDA $SMI_CUDA (nvidia-smi)"
elif [ -n "$NVCC_CUDA" ]; then
    FEATURE="$(pick_feature "$NVCC_CUDA")"; WHY="nvcc reports CUDA $NVCC_CUDA"
else
    FEATURE="cuda-12060"; WHY="no nvidia-smi or nvcc: the default"
fi
echo "feature: $FEATURE ($WHY)"
if [ -n "$PREBUILT" ] && [ -f "$PREBUILT/MANIFEST" ]; then
    echo "prebuilt binaries in $PREBUILT:"; sed 's/^/  /' "$PREBUILT/MANIFEST"
fi

section "3. NCCL library"
nccl_dirs() {
    [ -n "${ADAG_NCCL_LIB_DIR:-}" ] && echo "$ADAG_NCCL_LIB_DIR"
    if command -v python3 >/dev/null 2>&1; then
        timeout 20 python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null
    fi
    if command -v ldconfig >/dev/null 2>&1; then
        ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF}' | xargs -r -n1 dirname
    fi
    ls -d /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib \
        /usr/local/lib /opt/conda/lib /usr/lib/python3*/site-packages/nvidia/nccl/lib \
        /usr/local/lib/python3*/dist-packages/nvidia/nccl/lib /usr/local/lib/python3*/site-packages/nvidia/nccl/lib \
        "$HOME"/.local/lib/python3*/site-packages/nvidia/nccl/lib /opt/conda/lib/python3*/site-packages/nvidia/nccl/lib \
        2>/dev/null
}
NCCL_DIR=""
for d in $(nccl_dirs); do
    if [ -e "$d/libnccl.so" ] || [ -e "$d/libnccl.so.2" ]; then NCCL_DIR="$d"; break; fi
done
if [ -z "$NCCL_DIR" ]; then
    echo "not in the usual places; searching / (at most 60 s)..."
    HIT="$(timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name 'libnccl.so*' -print 2>/dev/null | head -1)"
    [ -n "$HIT" ] && NCCL_DIR="$(dirname "$HIT")"
fi
NCCL_FOUND=0
if [ -n "$NCCL_DIR" ]; then
    NCCL_FOUND=1
    ls -l "$NCCL_DIR"/libnccl.so* 2>/dev/null
    if [ -e "$NCCL_DIR/libnccl.so" ]; then
        export LD_LIBRARY_PATH="$NCCL_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL: $NCCL_DIR/libnccl.so (cudarc opens it by that name)"
    else
        SHIM="$ROOT/target/nccl-shim"
        mkdir -p "$SHIM"
        ln -sf "$NCCL_DIR/libnccl.so.2" "$SHIM/libnccl.so"
        export LD_LIBRARY_PATH="$SHIM:$NCCL_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL: only $NCCL_DIR/libnccl.so.2; made $SHIM/libnccl.so -> it (cudarc never opens libnccl.so.2)"
    fi
else
    echo "NCCL: NOT FOUND. Install it with 'pip install nvidia-nccl-cu12' (or nvidia-nccl-cu13),"
    echo "      or the libnccl2 package, then rerun (or set ADAG_NCCL_LIB_DIR to the directory of libnccl.so.2)."
    if [ "${ADAG_PIP_INSTALL_NCCL:-0}" = 1 ] && command -v pip >/dev/null 2>&1; then
        echo "ADAG_PIP_INSTALL_NCCL=1: trying pip install --user nvidia-nccl-cu${SMI_CUDA%%.*}"
        timeout 120 pip install --user "nvidia-nccl-cu${SMI_CUDA%%.*}" && echo "installed: rerun the script"
    fi
fi
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
if [ "$NCCL_FOUND" = 1 ]; then result "NCCL library" "found in $NCCL_DIR"; else result "NCCL library" "NOT FOUND (NCCL tests and bench not run)"; fi

CARGO_FEATURES=(--release -p adag-cuda --no-default-features --features "$FEATURE")
if [ -z "$PREBUILT" ]; then
    section "4. build (cargo, $FEATURE)"
    if ! command -v cargo >/dev/null 2>&1; then
        result "build" "FAIL: no cargo here; build with scripts/gpu/bundle.sh elsewhere and pass --prebuilt"
        RUN_TESTS=0; RUN_BENCH=0
    elif timeout 300 cargo build "${CARGO_FEATURES[@]}" --bins --tests 2>&1 | tail -15; [ "${PIPESTATUS[0]}" = 0 ]; then
        result "build" "ok ($FEATURE)"
    else
        result "build" "FAIL (see above; offline? the crates must be in ~/.cargo or use --prebuilt)"
        RUN_TESTS=0; RUN_BENCH=0
    fi
fi

SKIP=()
[ "$NCCL_FOUND" = 1 ] || SKIP=(--skip gpu_nccl)
if [ "$RUN_TESTS" = 1 ]; then
    section "5. tests (GPU tests included, one at a time${SKIP:+, NCCL tests skipped})"
    if [ -n "$PREBUILT" ]; then
        STATUS=0
        for t in "$PREBUILT"/test-*; do
            echo "--- $(basename "$t")"
            timeout 180 "$t" --include-ignored --test-threads=1 --nocapture "${SKIP[@]}" 2>&1 | tee -a "$LOG_DIR/tests.log"
            [ "${PIPESTATUS[0]}" = 0 ] || STATUS=1
        done
    else
        timeout 240 cargo test "${CARGO_FEATURES[@]}" -- --include-ignored --test-threads=1 --nocapture "${SKIP[@]}" 2>&1 | tee "$LOG_DIR/tests.log"
        STATUS=${PIPESTATUS[0]}
    fi
    if [ "$STATUS" = 0 ]; then result "tests" "ok"; else result "tests" "FAIL (status $STATUS; log $LOG_DIR/tests.log)"; fi
    grep -E "^test .* (ok|FAILED|ignored)|SKIPPED|test result" "$LOG_DIR/tests.log" | sed 's/^/    /' > "$LOG_DIR/tests.summary" || true
    [ "$NCCL_FOUND" = 1 ] || result "NCCL tests" "NOT RUN (no libnccl)"
fi

GPU_SEEN=0
if command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then GPU_SEEN=1; fi
# One #[ignore]d test of cuda/tests/gpu_pipeline.rs, reported on its own line:
#   pipeline_test TITLE TEST LOG
pipeline_test() {
    local title="$1" test="$2" log="$LOG_DIR/$3" status
    if [ "$GPU_SEEN" = 0 ] || [ "$NCCL_FOUND" = 0 ]; then
        result "$title" "NOT RUN (needs a GPU and NCCL)"
        return
    fi
    if [ -n "$PREBUILT" ]; then
        timeout 180 "$PREBUILT/test-gpu_pipeline" --include-ignored --test-threads=1 --nocapture "$test" 2>&1 | tee "$log"
    else
        timeout 180 cargo test "${CARGO_FEATURES[@]}" --test gpu_pipeline -- --include-ignored --test-threads=1 --nocapture "$test" 2>&1 | tee "$log"
    fi
    status=${PIPESTATUS[0]}
    if [ "$status" != 0 ]; then
        result "$title" "FAIL (status $status; log $log)"
    elif grep -q SKIPPED "$log"; then
        result "$title" "SKIPPED: $(grep -m1 SKIPPED "$log")"
    else
        result "$title" "ok"
    fi
}

if [ "$RUN_TESTS" = 1 ]; then
    section "5b. 1F1B pipeline on the NCCL communicator"
    pipeline_test "1F1B on NCCL" gpu_nccl_1f1b_pipeline 1f1b.log
    section "5c. an NCCL tensor edge between two hosts (LocalHosts on loopback)"
    pipeline_test "NCCL across hosts" gpu_nccl_across_hosts hosts.log
fi

if [ "$RUN_BENCH" = 1 ]; then
    section "6. bench (nccl-bench ${BENCH_ARGS[*]})"
    if [ -n "$PREBUILT" ]; then
        timeout 240 "$PREBUILT/nccl-bench" "${BENCH_ARGS[@]}" 2>&1 | tee "$LOG_DIR/bench.txt"
    else
        timeout 240 cargo run "${CARGO_FEATURES[@]}" --bin nccl-bench -- "${BENCH_ARGS[@]}" 2>&1 | tee "$LOG_DIR/bench.txt"
    fi
    STATUS=${PIPESTATUS[0]}
    case "$STATUS" in
        0) result "bench" "ok (tables above and in $LOG_DIR/bench.txt)" ;;
        3) result "bench" "copies only: NCCL not available" ;;
        2) result "bench" "FAIL: no usable CUDA device (see above)" ;;
        124) result "bench" "FAIL: timed out" ;;
        *) result "bench" "FAIL (status $STATUS)" ;;
    esac
fi

section "summary"
for s in "${SUMMARY[@]}"; do echo "  $s"; done
[ -f "$LOG_DIR/tests.summary" ] && cat "$LOG_DIR/tests.summary"
echo "  total time $(elapsed)"
printf '%s\n' "${SUMMARY[@]}" > "$LOG_DIR/summary.txt"
exit "$FAILED"
