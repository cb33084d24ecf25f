"""Async actors as Ray has them: ``async def`` methods run on the actor's own event loop, as
one-off calls (concurrently, so one call can wait for what a later one sets: Ray's
``SignalActor``) and as graph tasks; sync and async methods on one actor; ``asyncio`` in the
constructor."""
import asyncio
import time

import adag
from adag import InputNode


@adag.remote
class SignalActor:
    """Ray's test utility, as Ray's tests write it."""

    def __init__(self):
        self.ready_event = asyncio.Event()
        self.num_waiters = 0

    def send(self, clear=False):
        self.ready_event.set()
        if clear:
            self.ready_event.clear()

    async def wait(self, should_wait=True):
        if should_wait:
            self.num_waiters += 1
            await self.ready_event.wait()
            self.num_waiters -= 1

    async def cur_num_waiters(self):
        return self.num_waiters


@adag.remote
class Mixed:
    def __init__(self):
        self.loop = asyncio.get_event_loop()
        self.count = 0

    def bump(self, x):
        self.count += 1
        return x + 1

    async def slow_double(self, x):
        await asyncio.sleep(0.01)
        return 2 * x

    async def same_loop(self):
        return asyncio.get_running_loop() is self.loop

    async def fails(self, x):
        await asyncio.sleep(0)
        raise ValueError(f"async says no to {x}")


def test_a_waiting_call_does_not_block_the_one_that_releases_it():
    signal = SignalActor.remote()
    waiters = [signal.wait.remote() for _ in range(3)]
    deadline = time.monotonic() + 30
    while adag.get(signal.cur_num_waiters.remote(), timeout=30) < 3:
        assert time.monotonic() < deadline, "the waits never started"
        time.sleep(0.01)
    ready, pending = adag.wait(waiters, num_returns=3, timeout=0.2)
    assert ready == [] and len(pending) == 3
    signal.send.remote()
    assert adag.get(waiters, timeout=30) == [None, None, None]
    assert adag.get(signal.cur_num_waiters.remote(), timeout=30) == 0


def test_async_methods_as_graph_tasks_beside_sync_ones():
    m = Mixed.remote()
    with InputNode() as inp:
        dag = m.slow_double.bind(m.bump.bind(inp))
    compiled = dag.experimental_compile()
    try:
        assert [compiled.execute(i).get(timeout=30) for i in range(5)] == [2, 4, 6, 8, 10]
    finally:
        compiled.teardown()
    # The constructor's event loop is the one the methods run on.
    assert adag.get(m.same_loop.remote(), timeout=30) is True


def test_an_async_methods_exception_is_its_task_error():
    m = Mixed.remote()
    ref = m.fails.remote(3)
    try:
        adag.get(ref, timeout=30)
        raise AssertionError("no error")
    except adag.TaskError as e:
        assert isinstance(e.cause, ValueError) and "async says no to 3" in str(e)
    with InputNode() as inp:
        dag = m.fails.bind(inp)
    compiled = dag.experimental_compile()
    try:
        try:
            compiled.execute(4).get(timeout=30)
            raise AssertionError("no error")
        except adag.TaskError as e:
            assert "async says no to 4" in str(e)
    finally:
        compiled.teardown()


def test_one_off_async_calls_run_concurrently():
    """Eight calls that each wait until all eight have started: they can only finish if
    they run at the same time."""

    @adag.remote
    class Gather:
        def __init__(self):
            self.started = 0
            self.all_in = asyncio.Event()

        async def meet(self, n):
            self.started += 1
            if self.started == n:
                self.all_in.set()
            await self.all_in.wait()
            return self.started

    g = Gather.remote()
    assert adag.get([g.meet.remote(8) for _ in range(8)], timeout=60) == [8] * 8
