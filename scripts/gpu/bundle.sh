#!/usr/bin/env bash
# Builds the adag-cuda test binaries and nccl-bench in release mode, for a GPU machine that has
# no cargo or no network (its crates cannot be fetched there), into target/gpu-bundle:
#
#   scripts/gpu/bundle.sh [cuda-XXXXX]        # default cuda-12060
#
# then, on the GPU machine, from the repository root:
#
#   scripts/gpu/run.sh --prebuilt target/gpu-bundle
#
# (with the device tool: carry ["target/gpu-bundle"]). The binaries open libcuda and libnccl
# at run time, so building them needs no CUDA; they need a glibc at least as new as this
# machine's. Pick the feature of the GPU machine's driver if known (nvidia-smi's "CUDA
# Version"): the bindings must not be newer than the driver. cuda-12060 suits drivers for
# CUDA 12.6 and newer, which every H100/H200 image has.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
FEATURE="${1:-cuda-12060}"
OUT_DIR="$ROOT/target/gpu-bundle"
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
ARGS=(--release -p adag-cuda --no-default-features --features "$FEATURE")
cargo build "${ARGS[@]}" --bin nccl-bench
cargo test "${ARGS[@]}" --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        t = m["target"]
        print(("lib" if t["kind"] == ["lib"] else t["name"]) + " " + m["executable"])
' | while read -r name exe; do
    cp "$exe" "$OUT_DIR/test-$name"
done
cp "${CARGO_TARGET_DIR:-target}/release/nccl-bench" "$OUT_DIR/nccl-bench"
strip "$OUT_DIR"/* 2>/dev/null || true
{
    echo "adag-cuda bundle, feature $FEATURE"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?') (working tree, may be dirty)"
    echo "glibc $(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')"
    (cd "$OUT_DIR" && ls -l | tail -n +2 | awk '{print $5, $NF}')
} > "$OUT_DIR/MANIFEST"
cat "$OUT_DIR/MANIFEST"
du -sh "$OUT_DIR"
