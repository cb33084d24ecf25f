"""Profiling a compiled graph in Ray Compiled Graphs' style, run on adag: only the import lines
differ from Ray's.

The program sets `RAY_CGRAPH_ENABLE_TORCH_PROFILING=1` before compiling. Ray then records a
torch profile per actor; adag records none and warns at compile, pointing to its timeline of
every operation of every actor. When the graph was compiled with that timeline on (its
variable set in the environment, see docs/observability.md), the program writes it as
Chrome-trace JSON (the first argument, else a temporary file) and checks it."""

import os

os.environ["RAY_CGRAPH_ENABLE_TORCH_PROFILING"] = "1"

import json
import sys
import tempfile
import warnings

import numpy as np

import adag as ray  # with Ray: import ray
from adag.dag import InputNode  # with Ray: from ray.dag import InputNode

LAYERS, WIDTH, STEPS = 3, 64, 20


def weights(seed):
    return np.random.default_rng(seed).standard_normal((WIDTH, WIDTH)) / WIDTH**0.5


@ray.remote
class Layer:
    def __init__(self, seed):
        self.w = weights(seed)

    def forward(self, x):
        return np.maximum(x @ self.w, 0.0)


layers = [Layer.remote(seed) for seed in range(LAYERS)]
with InputNode() as inp:
    out = inp
    for layer in layers:
        out = layer.forward.bind(out)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = out.experimental_compile()
for w in caught:
    print(f"at compile: {w.category.__name__}: {w.message}")

batch = np.random.default_rng(99).standard_normal((8, WIDTH))
want = batch
for seed in range(LAYERS):
    want = np.maximum(want @ weights(seed), 0.0)
for _ in range(STEPS):
    got = ray.get(compiled.execute(batch))
    if not np.allclose(got, want):
        sys.exit(f"the graph computed {got}, want {want}")

timeline = getattr(compiled, "timeline", None)
events = timeline() if timeline is not None else []
if events:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "timeline.json")
    compiled.write_timeline(path)
    with open(path) as f:
        trace = json.load(f)
    computes = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    if len(computes) != LAYERS * STEPS or not all(e["name"].endswith(".forward") for e in computes):
        sys.exit(f"the timeline should hold {LAYERS * STEPS} forward slices: {computes[:3]}")
    busy = sum(e["dur"] for e in computes) / 1e3
    print(f"timeline: {len(events)} operations ({busy:.1f} ms computing) written to {path}")
else:
    print("no timeline recorded")
compiled.teardown()
print("profiling: ok")
