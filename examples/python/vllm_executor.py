"""A pipeline-parallel x tensor-parallel model executor in the shape of vLLM's Ray executor,
run on adag: only the import lines differ from Ray's.

PP=2 stages of TP=2 workers each (rank = pp * TP + tp). The workers are a plain class wrapped
with `ray.remote(num_cpus=0)(Worker)` and driven before compiling, and between steps, through
a generic `execute_method.remote("name", *args)`. Every first-stage worker binds the same
InputNode; worker i of a stage feeds worker i of the next; a non-last stage returns
`(scheduler_output, grammar_output, intermediate_tensors)`, the tensors annotated with
`with_tensor_transport(transport="auto")`. The driver keeps up to PP executions in flight,
reads only the first rank's ref of each, and drops the others unread. The scheduler and grammar
outputs are dataclasses of this script (they travel by value)."""

import os

# Set before the graph module is imported, as vLLM does: the default timeout of a get.
os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

import adag as ray  # with Ray: import ray
from adag.dag import DAGContext, InputNode, MultiOutputNode  # with Ray: from ray.dag import ...

PP, TP = 2, 2
HIDDEN, VOCAB = 8, 50


@dataclass
class SchedulerOutput:
    step: int
    num_scheduled_tokens: Dict[str, int]


@dataclass
class GrammarOutput:
    # Per request, the token ids the grammar allows next (requests not named are free).
    allowed: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class IntermediateTensors:
    tensors: Dict[str, torch.Tensor]


class Worker:
    """One rank: holds a stage's weights (the same on every TP rank of a stage here)."""

    def __init__(self, rank):
        self.rank = rank
        self.pp_rank, self.tp_rank = divmod(rank, TP)
        self.weight: Optional[torch.Tensor] = None
        self.steps = 0

    def execute_method(self, method, *args, **kwargs):
        return getattr(self, method)(*args, **kwargs)

    def init_device(self):
        return {"rank": self.rank, "pp": self.pp_rank, "tp": self.tp_rank, "pid": os.getpid()}

    def load_model(self, scale):
        self.weight = torch.linspace(1.0, 2.0, HIDDEN, dtype=torch.float64) * scale * (self.pp_rank + 1)
        return float(self.weight.sum())

    def update_weights(self, factor):
        self.weight = self.weight * factor
        return float(self.weight.sum())

    def steps_done(self):
        return self.steps

    def execute_model_ray(self, model_input):
        if len(model_input) == 2:
            scheduler_output, grammar_output = model_input
            req_ids = sorted(scheduler_output.num_scheduled_tokens)
            tokens = torch.tensor(
                [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=torch.float64
            )
            hidden = tokens[:, None] + torch.arange(HIDDEN, dtype=torch.float64)[None, :]
        else:
            scheduler_output, grammar_output, intermediate = model_input
            hidden = intermediate.tensors["hidden_states"]
            req_ids = sorted(scheduler_output.num_scheduled_tokens)
        hidden = hidden * self.weight
        self.steps += 1
        if self.pp_rank < PP - 1:
            return scheduler_output, grammar_output, IntermediateTensors({"hidden_states": hidden})
        sampled = {}
        for i, req in enumerate(req_ids):
            token = int(hidden[i].sum().item()) % VOCAB
            allowed = grammar_output.allowed.get(req)
            sampled[req] = allowed[token % len(allowed)] if allowed else token
        return {"rank": self.rank, "step": scheduler_output.step, "sampled": sampled}


def expected_tokens(scheduler_output, grammar_output, scale):
    """What the model computes, in the driver."""
    out = {}
    for req, n in scheduler_output.num_scheduled_tokens.items():
        hidden = [n + j for j in range(HIDDEN)]
        for pp in range(PP):
            weight = torch.linspace(1.0, 2.0, HIDDEN, dtype=torch.float64) * scale * (pp + 1)
            hidden = [h * float(w) for h, w in zip(hidden, weight)]
        token = int(torch.tensor(hidden, dtype=torch.float64).sum().item()) % VOCAB
        allowed = grammar_output.allowed.get(req)
        out[req] = allowed[token % len(allowed)] if allowed else token
    return out


workers = [ray.remote(num_cpus=0)(Worker).remote(rank=rank) for rank in range(PP * TP)]
infos = ray.get([w.execute_method.remote("init_device") for w in workers])
assert [i["rank"] for i in infos] == list(range(PP * TP)), infos
ray.get([w.execute_method.remote("load_model", 1.0) for w in workers])

with InputNode() as input_data:
    outputs = [input_data for _ in range(TP)]
    for pp_rank in range(PP):
        stage = workers[pp_rank * TP : (pp_rank + 1) * TP]
        outputs = [w.execute_model_ray.bind(outputs[i]) for i, w in enumerate(stage)]
        if pp_rank < PP - 1:
            outputs = [o.with_tensor_transport(transport="auto") for o in outputs]
    forward_dag = MultiOutputNode(outputs)

compiled = forward_dag.experimental_compile()
get_timeout = DAGContext.get_current().get_timeout
if get_timeout != float(os.environ["RAY_CGRAPH_get_timeout"]):
    sys.exit(f"RAY_CGRAPH_get_timeout was not used: the context has {get_timeout}")

STEPS_PER_PHASE = 6
checked = 0
scale = 1.0
start = time.perf_counter()
for phase in range(2):
    in_flight = deque()

    def finish_oldest():
        global checked
        step, want, ref = in_flight.popleft()
        got = ray.get(ref)
        if got["rank"] != (PP - 1) * TP or got["step"] != step or got["sampled"] != want:
            sys.exit(f"step {step}: got {got}, want rank {(PP - 1) * TP} and {want}")
        checked += 1

    for i in range(STEPS_PER_PHASE):
        step = phase * STEPS_PER_PHASE + i
        reqs = {f"req-{r}": 1 + (step + r) % 5 for r in range(3 + step % 2)}
        scheduler_output = SchedulerOutput(step=step, num_scheduled_tokens=reqs)
        grammar_output = GrammarOutput(allowed={"req-0": [7, 11, 13]} if step % 3 == 0 else {})
        want = expected_tokens(scheduler_output, grammar_output, scale)
        if len(in_flight) == PP:
            finish_oldest()
        refs = compiled.execute((scheduler_output, grammar_output))
        in_flight.append((step, want, refs[0]))  # the other ranks' refs are dropped unread
    while in_flight:
        finish_oldest()
    # A weight update between steps, while the graph is live.
    ray.get([w.execute_method.remote("update_weights", 0.5) for w in workers])
    scale *= 0.5
took = time.perf_counter() - start

steps = ray.get([w.execute_method.remote("steps_done") for w in workers])
if steps != [2 * STEPS_PER_PHASE] * len(workers):
    sys.exit(f"every rank should have run {2 * STEPS_PER_PHASE} steps: {steps}")
compiled.teardown()
for w in workers:
    ray.kill(w)

print(f"PP={PP} x TP={TP}: {checked} steps checked ({took / checked * 1e3:.1f} ms a step, up to "
      f"{PP} in flight), weights updated between steps, every rank ran {steps[0]} steps")
print("vllm_executor: ok")
