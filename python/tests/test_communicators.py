"""A user's ``Communicator`` (Ray's custom communicators) moves the tensors and runs the
collectives: here one written on ``torch.distributed`` with the gloo backend, on loopback.
adag initializes it on each of its actors (every rank at once), calls ``allreduce``,
``allgather``, ``reducescatter``, ``send`` and ``recv`` in the actors as Ray does, and
destroys it at teardown."""
import pytest
import torch

import adag
from adag import InputNode, MultiOutputNode
from adag.exceptions import CompileError
from adag.experimental.collective import allgather, allreduce, reducescatter
from adag.experimental.util.types import ReduceOp
from gloo_communicator import GlooCommunicator


@adag.remote
class Ranked:
    def __init__(self, rank):
        self.rank = rank

    def make(self, n):
        return torch.arange(n, dtype=torch.float32) * (self.rank + 1)

    def nested(self, n):
        t = torch.arange(n, dtype=torch.float32)
        return (t, {"twice": t * 2, "tag": f"rank{self.rank}"}, [t.to(torch.int64)])

    def summary(self, value):
        t, d, (ints,) = value
        return (float(t.sum()), float(d["twice"].sum()), d["tag"], ints.dtype == torch.int64)

    def total(self, t):
        return float(t.sum()), tuple(t.shape)

    def calls(self):
        """What each communicator of this actor was asked, by name."""
        from adag import _comm_steps

        return [[c[0] for c in comm.calls] for comm in _comm_steps._groups.values()]

    def dist_initialized(self):
        import torch.distributed as dist

        return dist.is_initialized()


def ranks(n):
    return [Ranked.remote(r) for r in range(n)]


def test_allreduce_through_a_users_communicator():
    actors = ranks(3)
    comm = GlooCommunicator(actors)
    with InputNode() as inp:
        parts = [a.make.bind(inp) for a in actors]
        summed = allreduce.bind(parts, transport=comm)
        maxed = allreduce.bind(parts, op=ReduceOp.MAX, transport=comm)
        dag = MultiOutputNode(
            [a.total.bind(s) for a, s in zip(actors, summed)]
            + [a.total.bind(m) for a, m in zip(actors, maxed)]
        )
    compiled = dag.experimental_compile()
    try:
        for n in (4, 1000):
            out = adag.get(compiled.execute(n), timeout=60)
            base = sum(range(n))
            assert out[:3] == [(base * 6.0, (n,))] * 3
            assert out[3:] == [(base * 3.0, (n,))] * 3
        # Called in each actor, as Ray calls it: initialized once, then the collectives.
        for calls in adag.get([a.calls.remote() for a in actors]):
            assert calls == [["initialize"] + ["allreduce", "allreduce"] * 2]
    finally:
        compiled.teardown()
    # Destroyed on every actor at teardown.
    assert adag.get([a.dist_initialized.remote() for a in actors]) == [False] * 3


def test_allgather_and_reducescatter_through_a_users_communicator():
    actors = ranks(2)
    comm = GlooCommunicator(actors)
    with InputNode() as inp:
        parts = [a.make.bind(inp) for a in actors]
        gathered = allgather.bind(parts, transport=comm)
        scattered = reducescatter.bind(parts, transport=comm)
        dag = MultiOutputNode(gathered + scattered)
    compiled = dag.experimental_compile()
    try:
        g0, g1, s0, s1 = adag.get(compiled.execute(4), timeout=60)
        expected = torch.cat([torch.arange(4.0), torch.arange(4.0) * 2])
        assert torch.equal(g0, expected) and torch.equal(g1, expected)
        total = torch.arange(4.0) * 3
        assert torch.equal(s0, total[:2]) and torch.equal(s1, total[2:])
    finally:
        compiled.teardown()


def test_a_tensor_edge_moves_through_send_and_recv():
    """The writer's tensors (nested in a tuple, a dict and a list) go through the
    communicator's send/recv; the rest of the value through the graph's channel."""
    a, b = ranks(2)
    comm = GlooCommunicator([a, b])
    with InputNode() as inp:
        dag = b.summary.bind(a.nested.bind(inp).with_tensor_transport(transport=comm))
    compiled = dag.experimental_compile()
    try:
        for n in (3, 100, 3):
            s = sum(range(n))
            assert compiled.execute(n).get(timeout=60) == (s, 2.0 * s, "rank0", True)
        sent, received = adag.get([a.calls.remote(), b.calls.remote()])
        assert sent == [["initialize"] + ["send"] * 9]
        assert received == [["initialize"] + ["recv"] * 9]
    finally:
        compiled.teardown()
    assert adag.get([a.dist_initialized.remote(), b.dist_initialized.remote()]) == [False, False]


def test_the_default_communicator_runs_collectives_without_their_own():
    actors = ranks(2)
    comm = GlooCommunicator(actors)
    with InputNode() as inp:
        summed = allreduce.bind([a.make.bind(inp) for a in actors])
        dag = MultiOutputNode(summed)
    compiled = dag.experimental_compile(_default_communicator=comm)
    try:
        out = adag.get(compiled.execute(5), timeout=60)
        assert all(torch.equal(t, torch.arange(5.0) * 3) for t in out)
        assert adag.get(actors[0].calls.remote()) == [["initialize", "allreduce"]]
    finally:
        compiled.teardown()


def test_a_reader_outside_the_communicator_is_a_compile_error():
    a, b, c = ranks(3)
    comm = GlooCommunicator([a, b])
    with InputNode() as inp:
        dag = c.total.bind(a.make.bind(inp).with_tensor_transport(transport=comm))
    with pytest.raises(CompileError, match="not in the communicator"):
        dag.experimental_compile()
