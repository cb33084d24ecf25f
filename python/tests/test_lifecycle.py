"""No hang, no leak: the GIL is free while the driver waits, a killed driver leaves no
worker behind, and the interpreter's exit tears graphs down."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import adag
from adag import InputNode
from actors import Echo
from procs import alive, wait_gone

EchoActor = adag.remote(Echo)
HERE = os.path.dirname(os.path.abspath(__file__))


def test_gil_is_released_while_waiting():
    a = EchoActor.remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp, "late")
    compiled = dag.experimental_compile()
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    try:
        ref = compiled.execute(0.5)
        t.start()
        assert ref.get(timeout=30) == "late"
        # The other thread ran while this one waited inside get().
        assert len(ticks) > 5
    finally:
        stop.set()
        t.join()
        compiled.teardown()


DRIVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from actors import Echo
    E = adag.remote(Echo)
    actors = [E.remote() for _ in range(2)]
    with InputNode() as inp:
        dag = actors[1].echo.bind(actors[0].echo.bind(inp))
    compiled = dag.experimental_compile()
    assert compiled.execute(1).get() == 1
    print(" ".join(str(a.pid.remote().get()) for a in actors), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    """
)


def test_killed_driver_leaves_no_worker():
    p = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(here=HERE), "hang"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(x) for x in pids)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert wait_gone(pids), "worker processes outlived their driver"
    finally:
        if p.poll() is None:
            p.kill()


def test_interpreter_exit_tears_down_and_ends_workers():
    p = subprocess.run(
        [sys.executable, "-c", DRIVER.format(here=HERE), "exit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    pids = [int(x) for x in p.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids), "worker processes outlived the interpreter"


def test_dropped_actor_handle_ends_its_worker():
    import gc

    a = EchoActor.remote()
    pid = a.pid.remote().get()
    assert alive(pid)
    del a
    gc.collect()
    assert wait_gone([pid])


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_graph_after_graph_does_not_grow_the_worker():
    """A worker keeps what it prepared for one graph's calls (bound method, constant
    arguments) only until the next graph's first call: 40 graphs in turn, each binding a
    different 2 MiB constant, grow it by far less than the 80 MiB they bound."""
    a = EchoActor.remote()
    pid = a.pid.remote().get()

    def one(i):
        blob = bytes([i % 256]) * (2 << 20)
        with InputNode() as inp:
            node = a.plus_len.bind(inp, blob)
        dag = node.experimental_compile()
        assert dag.execute(i).get() == i + len(blob)
        dag.teardown()

    for i in range(5):
        one(i)
    before = _rss_kib(pid)
    for i in range(40):
        one(i)
    grown_mib = (_rss_kib(pid) - before) / 1024
    assert grown_mib < 20, f"the worker grew by {grown_mib:.1f} MiB over 40 graphs"


SHUTDOWN = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from actors import Echo
    from procs import alive

    E = adag.remote(Echo)

    @adag.remote
    def pid_of_task():
        import os
        return os.getpid()

    a, b = E.remote(), E.remote()
    pids = [a.pid.remote().get(), b.pid.remote().get(), pid_of_task.remote().get()]
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp))
    compiled = dag.experimental_compile()
    assert compiled.execute(5).get() == 5
    adag.shutdown()
    # Gone when shutdown returns, not when the interpreter exits.
    print("alive", sum(alive(p) for p in pids))
    for what, call in [("remote", lambda: a.echo.remote(1)), ("bind", lambda: a.echo.bind(1))]:
        try:
            call()
            print(what, "worked")
        except adag.exceptions.RaySystemError as e:
            print(what, "raised", "Ray has not been started yet" in str(e) and "shutdown" in str(e))
    # init() again starts afresh: new actors, new graphs.
    adag.init()
    c = E.remote()
    with InputNode() as inp:
        dag = c.echo.bind(inp)
    compiled = dag.experimental_compile()
    print("after", compiled.execute(7).get(), pid_of_task.remote().get() not in pids)
    compiled.teardown()
    """
)


def test_shutdown_ends_every_actor_and_init_starts_afresh():
    """Ray's ``ray.shutdown()`` ends the driver's actors: their workers are gone when it
    returns (they used to live until the interpreter exited), their handles raise Ray's
    error, and the next actors work."""
    p = subprocess.run(
        [sys.executable, "-c", SHUTDOWN.format(here=HERE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split("\n")
    assert "alive 0" in lines, p.stdout + p.stderr
    assert "remote raised True" in lines, p.stdout + p.stderr
    assert "bind raised True" in lines, p.stdout + p.stderr
    assert "after 7 True" in lines, p.stdout + p.stderr
