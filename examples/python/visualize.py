"""Drawing a compiled graph in Ray Compiled Graphs' style, run on adag: only the import lines
differ from Ray's. `visualize()` writes the picture through Graphviz (`compiled_graph.png`
beside its DOT source `compiled_graph`, here in a temporary folder or the folder given as the
first argument) and returns the DOT source; `format="ascii"` returns a text picture and needs
no Graphviz."""

import os
import sys
import tempfile

import adag as ray  # with Ray: import ray
from adag.dag import InputNode, MultiOutputNode  # with Ray: from ray.dag import ...


@ray.remote
class Worker:
    def __init__(self, factor):
        self.factor = factor

    def forward(self, x):
        return x * self.factor

    def combine(self, a, b):
        return a + b


a, b, c = Worker.remote(2), Worker.remote(3), Worker.remote(1)
with InputNode() as inp:
    left = a.forward.bind(inp)
    right = b.forward.bind(inp)
    dag = MultiOutputNode([c.combine.bind(left, right), right])
compiled = dag.experimental_compile()
result = ray.get(compiled.execute(5))
if result != [25, 15]:
    sys.exit(f"the graph computed {result}, want [25, 15]")

print(compiled.visualize(format="ascii"))

folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
filename = os.path.join(folder, "compiled_graph")
try:
    dot = compiled.visualize(filename=filename, format="png")
except (ImportError, RuntimeError) as e:  # the graphviz package, or its dot program, is missing
    print(f"no picture: {e}")
else:
    with open(filename + ".png", "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            sys.exit(f"{filename}.png is not a PNG")
    if "forward" not in dot or "combine" not in dot:
        sys.exit(f"the DOT source does not name the methods:\n{dot}")
    size = os.path.getsize(filename + ".png")
    print(f"wrote {filename}.png ({size} bytes) from {len(dot.splitlines())} lines of DOT")
compiled.teardown()
print("visualize: ok")
