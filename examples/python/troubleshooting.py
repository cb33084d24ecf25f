"""Two things a Compiled Graphs program runs into, in Ray Compiled Graphs' style, run on adag:
only the import lines differ from Ray's.

1. A numpy array returned by a graph arrives without a copy: it is a read-only view of the
   channel's memory. Copy it to write into it, and `del` it when done with it (Ray asks for
   that before the next execution reuses the buffer; adag keeps a held array's memory valid
   while it lives, so the values held here stay as they were).
2. Executions submitted and not yet read are bounded (`_max_inflight_executions`): one more
   raises `RayCgraphCapacityExceeded` at once, and reading a result makes room."""

import sys

import numpy as np

import adag as ray  # with Ray: import ray
from adag.dag import InputNode  # with Ray: from ray.dag import InputNode
from adag.exceptions import RayCgraphCapacityExceeded  # with Ray: from ray.exceptions import ...


@ray.remote
class Sensor:
    def read(self, step):
        return np.full(1_000_000, float(step))  # 8 MB


sensor = Sensor.remote()
with InputNode() as inp:
    dag = sensor.read.bind(inp)
compiled = dag.experimental_compile(_max_inflight_executions=2)

first = ray.get(compiled.execute(1))
if first.flags.writeable:
    sys.exit("a received array should be a read-only view")
try:
    first[0] = -1.0
    sys.exit("writing into a received array should fail")
except ValueError as e:
    print(f"writing into the result: ValueError: {e}")
mine = first.copy()
mine[0] = -1.0  # a copy is the program's own

# The array is held while more executions run.
for step in range(2, 6):
    later = ray.get(compiled.execute(step))
    if later[0] != step or first[0] != 1.0 or first[-1] != 1.0:
        sys.exit(f"step {step}: got {later[0]}, and the held array now holds {first[0]}")
    del later
del first  # done with it: its memory goes back to the channel

refs = [compiled.execute(step) for step in (10, 11)]
try:
    compiled.execute(12)
    sys.exit("a third execution in flight should exceed _max_inflight_executions=2")
except RayCgraphCapacityExceeded as e:
    print(f"a third execution in flight: {type(e).__name__}: {str(e).split('. ')[0]}.")
values = [ray.get(r)[0] for r in refs]
if values != [10.0, 11.0]:
    sys.exit(f"the two executions in flight returned {values}")
del refs
if ray.get(compiled.execute(12))[0] != 12.0:
    sys.exit("after reading, an execution should run again")
compiled.teardown()
print("troubleshooting: ok")
