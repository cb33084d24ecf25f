"""Graphs of Python actors: inputs, chains, multiple outputs, constants, one-off calls,
teardown."""
import gc

import pytest

import adag
from adag import InputNode, MultiOutputNode
from actors import Echo

EchoActor = adag.remote(Echo)


@pytest.fixture(scope="module")
def actors():
    return [EchoActor.remote(i) for i in range(3)]


def test_one_actor_echo_many_times(actors):
    a = actors[0]
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for i in range(200):
            assert adag.get(compiled.execute(i)) == i
        values = [{"k": [1, 2]}, "text", None, 3.5, (1, "a")]
        for v in values:
            assert compiled.execute(v).get() == v
    finally:
        compiled.teardown()


def test_chain_of_three(actors):
    a, b, c = actors
    with InputNode() as inp:
        dag = c.add.bind(b.add.bind(a.add.bind(inp)))
    compiled = dag.experimental_compile()
    try:
        for i in range(50):
            # offsets 0 + 1 + 2
            assert adag.get(compiled.execute(i)) == i + 3
    finally:
        compiled.teardown()


def test_input_parts_keywords_and_constants(actors):
    a, b, _ = actors
    with InputNode() as inp:
        x = a.add.bind(inp[0], y=inp.extra)
        dag = MultiOutputNode([x, b.add.bind(inp[1], 100), b.add.bind(x, y=x)])
    compiled = dag.experimental_compile()
    try:
        r = compiled.execute(1, 2, extra=10)
        assert isinstance(r, list) and len(r) == 3
        # a: 1 + 10 + 0; b: 2 + 100 + 1; b: 11 + 11 + 1
        assert adag.get(r) == [11, 103, 23]
        with pytest.raises(ValueError, match="must be called with kwarg `extra`"):
            compiled.execute(1, 2)
    finally:
        compiled.teardown()


def test_whole_input_takes_one_argument(actors):
    with InputNode() as inp:
        dag = actors[0].echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(ValueError, match="must be called with 1 positional args, got 2"):
            compiled.execute(1, 2)
        assert compiled.execute(5).get() == 5
    finally:
        compiled.teardown()


def test_same_output_twice_and_fan_out(actors):
    a, b, c = actors
    with InputNode() as inp:
        x = a.echo.bind(inp)
        dag = MultiOutputNode([x, x, b.add.bind(x), c.add.bind(x)])
    compiled = dag.experimental_compile()
    try:
        assert adag.get(compiled.execute(7)) == [7, 7, 8, 9]
    finally:
        compiled.teardown()


def test_one_off_calls_and_state(actors):
    fresh = EchoActor.options(name="one-off", num_cpus=1).remote(5)
    refs = [fresh.add.remote(i, y=1) for i in range(5)]
    assert adag.get(refs) == [i + 6 for i in range(5)]
    assert adag.get(fresh.count.remote()) == 5
    # A ref as an argument is resolved first, as in Ray.
    assert adag.get(fresh.add.remote(fresh.add.remote(1))) == 1 + 5 + 5
    assert "one-off" in repr(fresh)


def test_actor_state_is_kept_between_graphs_and_calls():
    a = EchoActor.remote()
    for _ in range(2):
        with InputNode() as inp:
            dag = a.echo.bind(inp)
        compiled = dag.experimental_compile()
        for i in range(3):
            compiled.execute(i).get()
        compiled.teardown()
    assert a.count.remote().get() == 6


def test_teardown_then_execute_raises_channel_closed(actors):
    with InputNode() as inp:
        dag = actors[0].echo.bind(inp)
    compiled = dag.experimental_compile()
    compiled.teardown()
    compiled.teardown()  # idempotent
    with pytest.raises(adag.ChannelClosedError):
        compiled.execute(1)


def test_garbage_collection_tears_down(actors):
    a = actors[0]
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    assert compiled.execute(1).get() == 1
    del compiled
    gc.collect()
    # The actor is free again: a new graph compiles over it.
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    assert compiled.execute(2).get() == 2
    compiled.teardown()


def test_actor_in_two_live_graphs_is_refused(actors):
    with InputNode() as inp:
        dag = actors[0].echo.bind(inp)
    first = dag.experimental_compile()
    try:
        with InputNode() as inp:
            second = actors[0].echo.bind(inp)
        with pytest.raises(adag.CompileError, match="graph"):
            second.experimental_compile()
    finally:
        first.teardown()


def test_visualize_names_the_actors(actors):
    with InputNode() as inp:
        dag = actors[1].echo.bind(actors[0].echo.bind(inp))
    compiled = dag.experimental_compile()
    try:
        text = compiled.visualize(format="ascii")  # the picture: python/tests/test_visualize.py
        assert "Echo#" in text and "Echo.echo()" in text
    finally:
        compiled.teardown()


def test_misuse_is_explained(actors):
    with pytest.raises(TypeError, match="remote"):
        EchoActor(1)
    with pytest.raises(TypeError, match="bind"):
        actors[0].echo(1)
    with pytest.raises(TypeError, match="unknown actor options"):
        EchoActor.options(colour="red")
    with InputNode() as inp:
        with pytest.raises(TypeError, match="bind"):
            actors[0].echo.remote(inp).get(timeout=30)
    # As Ray's handles, a handle knows its class's methods.
    with pytest.raises(AttributeError, match="no_such_method"):
        actors[0].no_such_method
