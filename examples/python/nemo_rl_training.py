"""Training steps in the shape of NeMo-RL's worker groups, run on adag: only the import lines
differ from Ray's.

Two data-parallel shards of two workers each, one compiled graph per shard over its own
actors; every worker of a shard binds the same input dict (`worker.train.bind(inp)`), and a
MultiOutputNode gathers the shard's results. Both graphs are live at once: each step submits
to both before reading either. The losses are checked against the same arithmetic done here."""

import sys

import torch

import adag as ray  # with Ray: import ray
from adag.dag import InputNode, MultiOutputNode  # with Ray: from ray.dag import ...

SHARDS, WORKERS_PER_SHARD, STEPS = 2, 2, 4
FEATURES, ROWS = 4, 16
TRUE_WEIGHTS = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)


@ray.remote
class PolicyWorker:
    """A replica of a linear model; a step is one gradient step of the squared error."""

    def __init__(self, shard, rank):
        self.shard, self.rank = shard, rank
        self.weights = torch.zeros(FEATURES, dtype=torch.float64)

    def train(self, data):
        x, y, lr = data["input"], data["target"], data["lr"]
        error = x @ self.weights - y
        loss = float((error**2).mean())
        self.weights = self.weights - lr * (2.0 / len(y)) * (x.T @ error)
        return {"shard": self.shard, "rank": self.rank, "loss": loss}


def batch(shard, step):
    g = torch.Generator().manual_seed(1000 * shard + step)
    x = torch.randn(ROWS, FEATURES, generator=g, dtype=torch.float64)
    return {"input": x, "target": x @ TRUE_WEIGHTS, "lr": 0.1}


def expected_losses(shard):
    w = torch.zeros(FEATURES, dtype=torch.float64)
    losses = []
    for step in range(STEPS):
        data = batch(shard, step)
        error = data["input"] @ w - data["target"]
        losses.append(float((error**2).mean()))
        w = w - data["lr"] * (2.0 / ROWS) * (data["input"].T @ error)
    return losses


shards = [
    [PolicyWorker.remote(shard, rank) for rank in range(WORKERS_PER_SHARD)] for shard in range(SHARDS)
]
graphs = []
for workers in shards:
    with InputNode() as inp:
        dag = MultiOutputNode([w.train.bind(inp) for w in workers])
    graphs.append(dag.experimental_compile())

losses = [[] for _ in range(SHARDS)]
for step in range(STEPS):
    refs = [g.execute(batch(shard, step)) for shard, g in enumerate(graphs)]
    for shard, shard_refs in enumerate(refs):
        results = ray.get(shard_refs)
        if [(r["shard"], r["rank"]) for r in results] != [(shard, k) for k in range(WORKERS_PER_SHARD)]:
            sys.exit(f"step {step}: results from the wrong workers: {results}")
        if len({r["loss"] for r in results}) != 1:
            sys.exit(f"step {step}: the replicas of shard {shard} disagree: {results}")
        losses[shard].append(results[0]["loss"])

for shard in range(SHARDS):
    want = expected_losses(shard)
    if any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(losses[shard], want)):
        sys.exit(f"shard {shard}: losses {losses[shard]}, want {want}")
    if not losses[shard][-1] < losses[shard][0]:
        sys.exit(f"shard {shard}: the loss did not go down: {losses[shard]}")
    print(f"shard {shard}: losses " + " ".join(f"{x:.4f}" for x in losses[shard]))

for g in graphs:
    g.teardown()
print("nemo_rl_training: ok")
