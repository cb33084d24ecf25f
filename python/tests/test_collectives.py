"""Collectives and transport annotations: allreduce, allgather, reducescatter between the
actors of a graph; with_tensor_transport is accepted."""
import numpy as np
import pytest

import adag
from adag import InputNode, MultiOutputNode
from adag.collective import ReduceOp, allgather, allreduce, reducescatter
from actors import Echo

EchoActor = adag.remote(Echo)


@pytest.fixture(scope="module")
def workers():
    return [EchoActor.remote() for _ in range(3)]


def test_allreduce_sum_and_max(workers):
    with InputNode() as inp:
        parts = [w.scale.bind(inp, k=i + 1).with_tensor_transport("auto") for i, w in enumerate(workers)]
        summed = allreduce.bind(parts)
        maxed = allreduce.bind(parts, op=ReduceOp.MAX)
        dag = MultiOutputNode(summed + maxed)
    compiled = dag.experimental_compile()
    try:
        x = np.arange(6, dtype=np.float64)
        out = adag.get(compiled.execute(x))
        for r in out[:3]:
            assert np.array_equal(r, x * 6)
        for r in out[3:]:
            assert np.array_equal(r, x * 3)
    finally:
        compiled.teardown()


def test_allgather_and_reducescatter(workers):
    with InputNode() as inp:
        parts = [w.scale.bind(inp, k=i + 1) for i, w in enumerate(workers)]
        gathered = allgather.bind(parts)
        scattered = reducescatter.bind(parts, op=ReduceOp.SUM)
        dag = MultiOutputNode(gathered + scattered)
    compiled = dag.experimental_compile()
    try:
        x = np.ones(9)
        out = adag.get(compiled.execute(x))
        for g in out[:3]:
            assert [float(v[0]) for v in g] == [1.0, 2.0, 3.0]
        assert [len(s) for s in out[3:]] == [3, 3, 3]
        assert all(np.array_equal(s, np.full(3, 6.0)) for s in out[3:])
    finally:
        compiled.teardown()


def test_collective_inputs_must_be_distinct_actors(workers):
    with InputNode() as inp:
        a = workers[0].echo.bind(inp)
        b = workers[0].echo.bind(inp)
        with pytest.raises(ValueError, match="distinct actor"):
            allreduce.bind([a, b])
