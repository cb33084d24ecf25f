"""Pipeline-parallel training steps in Ray Compiled Graphs' style, run on adag: two stages,
micro-batches forward then backward (all forwards bound first, as a GPipe schedule), a
stage's forward returning two values (`num_returns=2`: the activation for the next stage and
what backward keeps). Only the import lines differ from Ray's."""

import numpy as np

import adag as ray  # with Ray: import ray
from adag.dag import InputNode, MultiOutputNode  # with Ray: from ray.dag import ...


@ray.remote
class Stage:
    def __init__(self, scale):
        self.weight = np.full(4, float(scale), dtype=np.float32)
        self.grad = np.zeros(4, dtype=np.float32)
        self.order = []

    @ray.method(num_returns=2)
    def forward(self, x):
        self.order.append("F")
        out = x * self.weight
        return out, x  # (activation for the next stage, input kept for backward)

    def forward_last(self, x):
        self.order.append("F")
        return x * self.weight

    def backward(self, grad_out, saved_input):
        self.order.append("B")
        self.grad += grad_out * saved_input
        return grad_out * self.weight

    def backward_last(self, activation):
        self.order.append("B")
        # The loss is the sum of the output: its gradient is the input of this stage.
        self.grad += activation
        return self.weight.copy()

    def step(self):
        self.weight -= 0.01 * self.grad
        self.grad[:] = 0
        order, self.order = "".join(self.order), []
        return order


MICRO_BATCHES = 3
first, last = Stage.remote(2.0), Stage.remote(3.0)
with InputNode() as inp:
    saved, grads = [], []
    acts = []
    for i in range(MICRO_BATCHES):
        act, kept = first.forward.bind(inp[i])
        saved.append(kept)
        acts.append(act)
    outs = [last.forward_last.bind(a) for a in acts]
    for i in range(MICRO_BATCHES):
        g = last.backward_last.bind(acts[i])
        grads.append(first.backward.bind(g, saved[i]))
    dag = MultiOutputNode(outs + grads)

compiled = dag.experimental_compile()
batches = [np.full(4, float(i + 1), dtype=np.float32) for i in range(MICRO_BATCHES)]
for step in range(3):
    results = ray.get(compiled.execute(*batches))
    losses = [float(r.sum()) for r in results[:MICRO_BATCHES]]
    print(f"step {step}: losses {[round(x, 3) for x in losses]}")
    orders = ray.get([first.step.remote(), last.step.remote()])
    # Each stage runs its tasks in the order they were bound: every forward, then backward.
    assert orders == ["FFFBBB", "FFFBBB"], orders
compiled.teardown()
print("pipeline_parallel: ok")
