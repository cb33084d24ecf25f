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


@pytest.mark.timeout(180)
def test_more_than_seven_participants():
    """A node takes at most 7 node arguments: 9 participants read each other through packs."""
    many = [EchoActor.remote() for _ in range(9)]
    with InputNode() as inp:
        parts = [w.scale.bind(inp, k=i + 1) for i, w in enumerate(many)]
        dag = MultiOutputNode(
            allreduce.bind(parts) + allgather.bind(parts) + reducescatter.bind(parts)
        )
    compiled = dag.experimental_compile()
    try:
        x = np.arange(18, dtype=np.float32)
        out = adag.get(compiled.execute(x), timeout=60)
        total = x * sum(range(1, 10))
        for r in out[:9]:
            np.testing.assert_array_equal(r, total)
        for gathered in out[9:18]:
            assert [float(v[1]) for v in gathered] == [float(k) for k in range(1, 10)]
        np.testing.assert_array_equal(np.concatenate(out[18:]), total)
        assert [len(s) for s in out[18:]] == [2] * 9
    finally:
        compiled.teardown()


def test_collective_inputs_must_be_distinct_actors(workers):
    with InputNode() as inp:
        a = workers[0].echo.bind(inp)
        b = workers[0].echo.bind(inp)
        with pytest.raises(ValueError, match="distinct actor") as info:
            allreduce.bind([a, b])
        assert str(info.value).startswith(
            "Expected unique actor handles for a collective operation, but found duplicate "
            "actor handles from input nodes"
        )


def test_a_communicator_of_other_actors_is_refused_in_rays_words(workers):
    from adag.experimental.channel.cpu_communicator import CPUCommunicator

    comm = CPUCommunicator(2, [workers[0], workers[2]])
    with InputNode() as inp:
        a = workers[0].echo.bind(inp)
        b = workers[1].echo.bind(inp)
        with pytest.raises(ValueError) as info:
            allreduce.bind([a, b], transport=comm)
        assert str(info.value).startswith(
            "Expected actor handles to match the custom communicator group"
        )


def test_packs_nest_for_any_number_of_participants():
    """The pack tree itself (no actors): at most 7 node arguments per node at every level,
    and the step sees every input in rank order."""
    from adag._collective import _MAX_NODE_ARGS, _Pack, _flat, _packed, pack
    from adag._dag import ClassMethodNode

    for n in [1, 7, 8, 49, 50, 400]:
        leaves = [ClassMethodNode(object(), "m", (), {}) for _ in range(n)]
        top = _packed(object(), leaves)
        assert len(top) <= _MAX_NODE_ARGS

        def run(node):  # evaluate the tree as the workers would
            if node._method.endswith(".pack"):
                assert len(node._args) <= _MAX_NODE_ARGS
                return pack(*[run(a) for a in node._args])
            return leaves.index(node)

        assert _flat([run(t) if t not in leaves else leaves.index(t) for t in top]) == list(range(n))
    assert _flat([_Pack((1, _Pack((2, 3)))), 4]) == [1, 2, 3, 4]
