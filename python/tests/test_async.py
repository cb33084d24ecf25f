"""asyncio: graphs compiled with enable_asyncio, awaited refs, awaited one-off calls."""
import asyncio

import pytest

import adag
from adag import InputNode, MultiOutputNode
from actors import Echo

EchoActor = adag.remote(Echo)


def test_execute_async_and_await():
    a, b = EchoActor.remote(), EchoActor.remote(1)

    async def main():
        with InputNode() as inp:
            dag = MultiOutputNode([a.echo.bind(inp), b.add.bind(inp)])
        compiled = dag.experimental_compile(enable_asyncio=True)
        try:
            futs = [await compiled.execute_async(i) for i in range(5)]
            results = [[await f for f in fs] for fs in futs]
            assert results == [[i, i + 1] for i in range(5)]
            # Several executions awaited together.
            many = await asyncio.gather(*[compiled.execute_async(i) for i in range(4)])
            values = await asyncio.gather(*[f for fs in many for f in fs])
            assert sorted(values) == sorted([i for i in range(4)] + [i + 1 for i in range(4)])
        finally:
            compiled.teardown()

    asyncio.run(main())


def test_awaits_read_here_and_through_the_pump_mix():
    """An await on an idle loop reads the result on the loop's thread; awaits that run
    together (the loop busy) are woken by the graph's pump. Mixed, every value arrives once,
    to its own future, in order."""
    a = EchoActor.remote(1)

    async def main():
        with InputNode() as inp:
            dag = a.add.bind(inp)
        compiled = dag.experimental_compile(enable_asyncio=True, _max_inflight_executions=8)
        try:
            for round_ in range(50):
                base = round_ * 100
                # One at a time: read on this thread.
                for i in range(3):
                    assert await (await compiled.execute_async(base + i)) == base + i + 1
                # Four in flight, the last awaited first (the others are read on the way).
                futs = [await compiled.execute_async(base + 10 + i) for i in range(4)]
                assert await futs[3] == base + 14
                # Awaited together: the pump delivers what no idle await read.
                got = await asyncio.gather(*futs[:3], *[
                    _submit_and_await(compiled, base + 20 + i) for i in range(3)])
                assert got == [base + 11, base + 12, base + 13, base + 21, base + 22, base + 23]
        finally:
            compiled.teardown()

    asyncio.run(main())


async def _submit_and_await(compiled, x):
    return await (await compiled.execute_async(x))


def test_async_task_error():
    a = EchoActor.remote()

    async def main():
        with InputNode() as inp:
            dag = a.fail.bind(inp)
        compiled = dag.experimental_compile(enable_asyncio=True)
        try:
            fut = await compiled.execute_async(4)
            with pytest.raises(ValueError, match="bad value 4"):
                await fut
        finally:
            compiled.teardown()

    asyncio.run(main())


def test_await_one_off_call():
    a = EchoActor.remote(2)

    async def main():
        return await a.add.remote(40)

    assert asyncio.run(main()) == 42


def test_async_ref_is_not_read_with_get():
    a = EchoActor.remote()

    async def main():
        with InputNode() as inp:
            dag = a.echo.bind(inp)
        compiled = dag.experimental_compile(enable_asyncio=True)
        try:
            fut = await compiled.execute_async(1)
            assert await fut == 1
        finally:
            compiled.teardown()

    asyncio.run(main())


def test_async_capacity_and_room_freed_by_dropped_futures():
    import gc

    a = EchoActor.remote()

    async def main():
        with InputNode() as inp:
            dag = a.sleep.bind(inp, "done")
        compiled = dag.experimental_compile(enable_asyncio=True, _max_inflight_executions=1)
        try:
            # Still running (0.3 s): its result is not read yet, so the graph is full.
            first = await compiled.execute_async(0.3)
            with pytest.raises(adag.CapacityExceededError):
                await compiled.execute_async(0)
            assert await first == "done"
            dropped = await compiled.execute_async(0.3)
            del dropped
            gc.collect()
            # Full until the result of the dropped execution is read and discarded: this
            # submission waits for that room (on a thread of the graph), then runs.
            assert await (await compiled.execute_async(0)) == "done"
        finally:
            compiled.teardown()

    asyncio.run(main())


def test_await_with_a_timeout_then_again():
    a = EchoActor.remote()

    async def main():
        with InputNode() as inp:
            dag = a.sleep.bind(inp, "late")
        compiled = dag.experimental_compile(enable_asyncio=True)
        try:
            fut = await compiled.execute_async(0.5)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fut, 0.01)
            # The cancelled wait gave nothing up: the same future still yields the value.
            assert await asyncio.wait_for(fut, 30) == "late"
            # A blocking get of a future whose await was cancelled finishes it.
            other = await compiled.execute_async(0.2)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(other, 0.01)
            assert other.get() == "late"
        finally:
            compiled.teardown()

    asyncio.run(main())


def test_async_submit_timeout_names_the_option():
    import gc
    import time

    a = EchoActor.remote()

    async def main():
        with InputNode() as inp:
            dag = a.sleep.bind(inp, "done")
        compiled = dag.experimental_compile(
            enable_asyncio=True, _max_inflight_executions=1, _submit_timeout=0.2
        )
        try:
            # A dropped future's execution runs for 1 s: a submission waits for the room its
            # result frees, up to _submit_timeout.
            dropped = await compiled.execute_async(1.0)
            del dropped
            gc.collect()
            t = time.monotonic()
            with pytest.raises(adag.GetTimeoutError, match=r"_submit_timeout=") as info:
                await compiled.execute_async(0)
            assert 0.15 < time.monotonic() - t < 1.5
            assert isinstance(info.value, TimeoutError)
            # Nothing was submitted; with room again, the graph goes on.
            await asyncio.sleep(1.0)
            assert await asyncio.wait_for(await compiled.execute_async(0), 30) == "done"
        finally:
            compiled.teardown()

    asyncio.run(main())
