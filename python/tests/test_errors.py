"""Errors keep Ray's meaning: the method's own exception inside a task error, actor died,
timeouts naming their option, capacity, closed channels, wrong mode."""
import asyncio
import time

import pytest

import adag
from adag import InputNode, MultiOutputNode
from actors import Broken, Echo

EchoActor = adag.remote(Echo)


def test_method_exception_is_a_task_error_and_its_own_type():
    a = EchoActor.remote()
    b = EchoActor.remote()
    with InputNode() as inp:
        dag = b.add.bind(a.fail.bind(inp))
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(ValueError) as info:
            compiled.execute(7).get()
        err = info.value
        assert isinstance(err, adag.TaskError)
        assert isinstance(err.cause, ValueError)
        assert str(err.cause) == "bad value 7"
        assert err.method_name == "fail"
        # The worker's traceback names the failing line of the method.
        assert "raise ValueError" in err.traceback_str
        assert "in fail" in err.traceback_str
        # The graph goes on.
        with pytest.raises(adag.TaskError):
            compiled.execute(8).get()
    finally:
        compiled.teardown()
    # The downstream actor never ran.
    assert b.count.remote().get() == 0


def test_unpicklable_exception_is_still_a_task_error():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.fail_unpicklable.bind(inp)
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(adag.TaskError, match="local 3") as info:
            compiled.execute(3).get()
        assert info.value.cause is None
        assert "Local" in str(info.value)
    finally:
        compiled.teardown()


def test_one_off_call_error():
    a = EchoActor.remote()
    with pytest.raises(ValueError, match="bad value 1"):
        adag.get(a.fail.remote(1))


def test_constructor_failure_is_actor_died_at_first_use():
    """As in Ray: ``.remote()`` returns the handle; its first use raises ActorDiedError
    with the constructor's traceback (a program's ``try`` around its first call catches it)."""
    broken = adag.remote(Broken).remote()
    ref = broken.echo.remote(1)
    with pytest.raises(adag.ActorDiedError, match="constructor says no") as info:
        adag.get(ref)
    assert str(info.value).startswith(
        "The actor died because of an error raised in its creation task"
    ), str(info.value)
    with pytest.raises(adag.ActorDiedError, match="constructor says no"):
        broken.echo.bind(1)


def test_actor_death_fails_the_graph():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.exit_now.bind(inp)
    compiled = dag.experimental_compile()
    with pytest.raises((adag.ActorDiedError, adag.ChannelClosedError)):
        compiled.execute(1).get(timeout=30)
    # Torn down: no more executions.
    with pytest.raises((adag.ActorDiedError, adag.ChannelClosedError)):
        compiled.execute(2).get(timeout=30)


def test_killed_actor():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp, 1)
    compiled = dag.experimental_compile()
    ref = compiled.execute(60)
    adag.kill(a)
    with pytest.raises((adag.ActorDiedError, adag.ChannelClosedError)):
        ref.get(timeout=30)
    with pytest.raises(adag.ActorDiedError):
        a.echo.remote(1).get()


def test_get_timeout_names_the_option_and_keeps_the_ref():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp, "done")
    compiled = dag.experimental_compile()
    try:
        ref = compiled.execute(0.5)
        with pytest.raises(adag.GetTimeoutError, match="timeout=") as info:
            adag.get(ref, timeout=0.01)
        assert isinstance(info.value, TimeoutError)
        assert adag.get(ref, timeout=30) == "done"
    finally:
        compiled.teardown()


def test_capacity_exceeded():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile(_max_inflight_executions=2)
    try:
        r1 = compiled.execute(1)
        r2 = compiled.execute(2)
        with pytest.raises(adag.CapacityExceededError, match="_max_inflight_executions") as info:
            compiled.execute(3)
        # Ray's words first (programs match on them), adag's explanation after.
        assert str(info.value).startswith(
            "The compiled graph can't have more than 2 in-flight executions, and you currently "
            "have 2 in-flight executions. Retrieve an output using ray.get before submitting "
            "more requests or increase `_max_inflight_executions`."
        ), str(info.value)
        assert adag.get([r1, r2]) == [1, 2]
        assert compiled.execute(3).get() == 3
    finally:
        compiled.teardown()


def test_submit_timeout_names_the_option():
    import gc

    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp, "done")
    compiled = dag.experimental_compile(_max_inflight_executions=1, _submit_timeout=0.2)
    try:
        # The only execution in flight runs for 3 s and its ref is gone: the next submission
        # must read (and discard) its result first, and gives up after _submit_timeout.
        # (3 s: a full collection in a long test run can take a second.)
        compiled.execute(3.0)
        gc.collect()
        t = time.monotonic()
        with pytest.raises(adag.GetTimeoutError, match=r"_submit_timeout=") as info:
            compiled.execute(0)
        assert 0.15 < time.monotonic() - t < 1.5
        assert isinstance(info.value, TimeoutError)
        # Nothing was submitted, and the graph goes on once the slow execution is over.
        time.sleep(3.0)
        assert compiled.execute(0).get(timeout=30) == "done"
    finally:
        compiled.teardown()


def test_ref_is_claimed_once():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        ref = compiled.execute(1)
        assert ref.get() == 1
        with pytest.raises(ValueError, match="once"):
            ref.get()
    finally:
        compiled.teardown()


def test_wrong_mode():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    sync = dag.experimental_compile()
    try:
        with pytest.raises(adag.WrongModeError, match="enable_asyncio"):
            asyncio.run(sync.execute_async(1))
    finally:
        sync.teardown()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    asyncio_graph = dag.experimental_compile(enable_asyncio=True)
    try:
        with pytest.raises(adag.WrongModeError, match="execute_async"):
            asyncio_graph.execute(1)
    finally:
        asyncio_graph.teardown()


def test_multi_output_error_fails_every_ref_of_the_execution():
    a = EchoActor.remote()
    b = EchoActor.remote()
    with InputNode() as inp:
        dag = MultiOutputNode([a.echo.bind(inp), b.fail.bind(inp)])
    compiled = dag.experimental_compile()
    try:
        refs = compiled.execute(1)
        for r in refs:
            with pytest.raises(ValueError, match="bad value 1"):
                r.get()
    finally:
        compiled.teardown()


def test_buffered_results_exceeded_in_rays_words():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile(_max_inflight_executions=8, _max_buffered_results=2)
    try:
        refs = [compiled.execute(i) for i in range(5)]
        with pytest.raises(adag.CapacityExceededError) as info:
            refs[4].get(timeout=30)
        assert str(info.value).startswith(
            "The compiled graph can't have more than 2 buffered results, and you currently "
            "have 2 buffered results. Call `ray.get()` on CompiledDAGRef's"
        ), str(info.value)
        assert [r.get(timeout=30) for r in refs[:4]] == [0, 1, 2, 3]
    finally:
        compiled.teardown()


def test_a_value_the_worker_cannot_decode_fails_the_method_naming_the_argument():
    from actors import Unrebuildable

    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.add.bind(1, inp)
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(adag.TaskError) as info:
            compiled.execute(Unrebuildable()).get(timeout=30)
        text = str(info.value)
        assert "cannot decode argument 0 of add" in text, text
        assert "this value does not rebuild" in text, text
        assert isinstance(info.value.cause, ValueError)
        # The graph goes on.
        assert compiled.execute(2).get(timeout=30) == 3
    finally:
        compiled.teardown()
