#!/usr/bin/env bash
# Create target/ray-venv with Ray 2.60.0 (plus numpy, matplotlib and torch, for the tensor
# rows of workloads.py) from PyPI, for the side-by-side benchmarks in scripts/ray/.
# Idempotent: re-running only checks the install.
#
#   bash scripts/ray/setup.sh            # uses python3 from PATH
#   PYTHON=python3.12 bash scripts/ray/setup.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${RAY_VENV:-$root/target/ray-venv}"
python="${PYTHON:-python3}"
ray_version="${RAY_VERSION:-2.60.0}"
torch_version="${TORCH_VERSION:-2.11.0}"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "creating $venv with $("$python" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "ray==$ray_version" numpy matplotlib "torch==$torch_version"
"$venv/bin/python" - <<'PY'
import ray, numpy, matplotlib, torch
print(f"ray {ray.__version__}, numpy {numpy.__version__}, matplotlib {matplotlib.__version__}, torch {torch.__version__}")
from ray.dag import InputNode, MultiOutputNode  # noqa: F401  (Compiled Graphs API present)
PY
echo "ok: $venv/bin/python"
