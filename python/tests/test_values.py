"""Values: pickle protocol 5 with out-of-band buffers; numpy arrays arrive as read-only
views of the shared memory they came in, valid as long as the array lives."""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import adag
from adag import InputNode, MultiOutputNode
from actors import Echo

EchoActor = adag.remote(Echo)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def pair():
    return EchoActor.remote(), EchoActor.remote()


def test_numpy_array_is_a_view_of_shared_memory(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        big = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
        out = compiled.execute(big).get()
        assert out.dtype == big.dtype and out.shape == big.shape
        assert np.array_equal(out, big)
        # Read in place: a read-only view whose memory is adag's (an ShmBuffer).
        assert not out.flags.writeable
        assert not out.flags.owndata
        base = out.base
        while base is not None and not isinstance(base, adag._native.ShmBuffer):
            base = getattr(base, "obj", None) or getattr(base, "base", None)
        assert isinstance(base, adag._native.ShmBuffer)
        # The view stays valid while later executions reuse the channel.
        kept = out
        for i in range(5):
            other = compiled.execute(np.full(4 << 20, i, dtype=np.float32)).get()
            assert other[0] == i
        del other
        gc.collect()
        assert np.array_equal(kept, big)
    finally:
        compiled.teardown()
    # ...and after the graph is gone.
    assert np.array_equal(kept, big)


def test_actor_reads_the_array_in_place(pair):
    a, b = pair
    with InputNode() as inp:
        dag = b.info.bind(a.scale.bind(inp, k=3))
    compiled = dag.experimental_compile()
    try:
        x = np.ones((1024, 1024), dtype=np.float64)  # 8 MiB
        total, writable, _base = compiled.execute(x).get()
        assert total == 3 * 1024 * 1024
        assert writable is False
    finally:
        compiled.teardown()


def test_small_and_odd_arrays(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for arr in [
            np.arange(10),
            np.zeros((0,), dtype=np.int8),
            np.arange(12).reshape(3, 4).T,  # not C-contiguous
            np.array(["a", "bc"]),
            {"w": np.ones(100_000), "b": np.arange(3)},
        ]:
            out = compiled.execute(arr).get()
            if isinstance(arr, dict):
                assert np.array_equal(out["w"], arr["w"]) and np.array_equal(out["b"], arr["b"])
            else:
                assert np.array_equal(out, arr) and out.dtype == arr.dtype
    finally:
        compiled.teardown()


def test_bytes_bytearray_memoryview(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.kind.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for value, kind in [
            (b"x" * (1 << 20), "bytes"),
            (bytearray(b"y" * (1 << 20)), "bytearray"),
            (b"", "bytes"),
            ("text" * 10000, "str"),
        ]:
            assert compiled.execute(value).get() == (kind, len(value))
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        data = bytes(range(256)) * 4096
        assert compiled.execute(data).get() == data
        ba = bytearray(data)
        out = compiled.execute(ba).get()
        assert isinstance(out, bytearray) and out == ba
    finally:
        compiled.teardown()


def test_large_value_over_the_buffer_size(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile(_buffer_size_bytes=1 << 16)
    try:
        big = np.random.default_rng(1).integers(0, 255, size=32 << 20, dtype=np.uint8)
        assert np.array_equal(compiled.execute(big).get(), big)
        objs = [list(range(100_000)), {"k": "v" * 100_000}]
        for o in objs:
            assert compiled.execute(o).get() == o
    finally:
        compiled.teardown()


def test_lambdas_travel_by_value(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        f = compiled.execute(lambda v: v + 1).get()
        assert f(1) == 2
    finally:
        compiled.teardown()


def test_memoryview_is_read_in_place(pair):
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        data = bytes(range(256)) * 4096  # 1 MiB
        out = compiled.execute(memoryview(data)).get()
        assert isinstance(out, memoryview)
        assert out.readonly
        assert isinstance(out.obj, adag._native.ShmBuffer)
        assert out.tobytes() == data
        # A view of another format travels as its bytes.
        ints = memoryview(np.arange(1000, dtype=np.int32))
        back = compiled.execute(ints).get()
        assert back.tobytes() == ints.tobytes()
    finally:
        compiled.teardown()


def test_scalars_and_strings_keep_their_exact_type(pair):
    """None, bool, int, float and str travel without pickling; their subclasses, big ints
    and strings without UTF-8 are pickled: every value comes back equal, of its own type."""
    import enum
    import math

    class Color(enum.IntEnum):
        RED = 1

    a, b = pair
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp))
    compiled = dag.experimental_compile()
    try:
        values = [
            None, True, False, 0, -1, 7, 2**63 - 1, -(2**63), 2**64, -(2**100),
            0.0, -0.0, 1.5, float("inf"), "", "héllo ✓", "x" * 100_000, "\ud800",
            Color.RED, 3 + 4j,
        ]
        for v in values:
            out = compiled.execute(v).get(timeout=30)
            assert type(out) is type(v) and out == v, (v, out)
        assert math.copysign(1.0, compiled.execute(-0.0).get()) == -1.0
        assert math.isnan(compiled.execute(float("nan")).get())
    finally:
        compiled.teardown()



def test_results_made_in_place_are_written_once():
    """``adag.empty`` inside a method lends the output channel's memory: the array the method
    fills and returns crosses to the driver without a copy (the edge carries a reference),
    while a plain numpy result is copied into the channel as before."""

    @adag.remote
    class Xor:
        def in_place(self, x):
            out = adag.empty(x.shape, x.dtype)
            np.bitwise_xor(x, 0x5A, out=out)
            return out

        def plain(self, x):
            return x ^ 0x5A

        def lent(self, n):
            return bool(adag._native.output_buffer(n).lent)

    n = 4 << 20
    a = Xor.remote()
    x = np.arange(n, dtype=np.uint8)
    with InputNode() as inp:
        dag = MultiOutputNode([a.in_place.bind(inp)])
    compiled = dag.experimental_compile()
    try:
        kept = []
        for i in range(6):
            (out,) = adag.get(compiled.execute(x + i))
            np.testing.assert_array_equal(out, (x + i) ^ 0x5A)
            kept.append((i, out))
        for i, out in kept:  # kept results never change while later ones are built
            np.testing.assert_array_equal(out, (x + i) ^ 0x5A)
        written = sum(e["bytes"] for e in compiled.stats()["edges"] if "in_place" in e["label"])
        assert written < 6 * 4096, f"{written} bytes written for 6 results made in place"
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = a.plain.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for i in range(3):
            np.testing.assert_array_equal(adag.get(compiled.execute(x + i)), (x + i) ^ 0x5A)
        copied = sum(e["bytes"] for e in compiled.stats()["edges"] if "plain" in e["label"])
        assert copied >= 3 * n
    finally:
        compiled.teardown()
    # Outside a graph: an ordinary array.
    assert adag.get(a.lent.remote(1024)) is False
    local = adag.empty((2, 3), np.float32)
    assert local.shape == (2, 3) and local.dtype == np.float32 and local.flags.writeable


MAIN_VALUES = textwrap.dedent(
    """
    import dataclasses, enum, sys, time
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from actors import Echo

    class Color(enum.Enum):
        RED = 1

    @dataclasses.dataclass
    class Msg:
        step: int
        color: Color
        payload: bytes

    def double(x):
        return 2 * x

    E = adag.remote(Echo)
    a, b = E.remote(), E.remote()
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp))
    compiled = dag.experimental_compile()
    msg = Msg(7, Color.RED, b"x" * 1024)
    out = compiled.execute(msg).get(timeout=60)
    # Back in the driver as the script's own class, enum and function.
    print("same", type(out) is Msg and out == msg and out.color is Color.RED)
    f = compiled.execute(double).get(timeout=60)
    print("function", f(21))
    print("one-off", a.echo.remote(msg).get(timeout=60) == msg)
    n = 300
    t = time.perf_counter()
    for _ in range(n):
        compiled.execute(msg).get(timeout=60)
    print("main_us", (time.perf_counter() - t) / n * 1e6)
    compiled.teardown()
    """
)


def test_classes_of_the_script_travel_by_value():
    """A dataclass, an enum and a function of the driver's ``__main__`` cross a graph both
    ways (the worker cannot import them by name: they go by value, as in Ray), and come
    back as the script's own objects."""
    p = subprocess.run(
        [sys.executable, "-c", MAIN_VALUES.format(here=HERE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split("\n")
    assert "same True" in lines, p.stdout + p.stderr
    assert "function 42" in lines, p.stdout + p.stderr
    assert "one-off True" in lines, p.stdout + p.stderr
    print(p.stdout)
