"""Actors on other hosts: the driver listens, hosts join (`python -m adag.agent`, here as
separate process trees on loopback), actors are placed with Ray's
`NodeAffinitySchedulingStrategy` or `host=`, and one graph spans the hosts."""
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import adag
from adag import InputNode, MultiOutputNode
from adag.cluster import LocalHosts
from adag.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from actors import Where
from procs import wait_gone

W = adag.remote(Where)
HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = secrets.token_hex(16)


def _listening() -> str:
    """This test process's driver listens (once per process: one listener per driver)."""
    addr = adag.cluster.address()
    if addr is None:
        addr = adag.init(listen="127.0.0.1:0", token=TOKEN)
    return addr


@pytest.fixture(scope="module")
def hosts():
    _listening()
    h = LocalHosts(2, names=["py-a", "py-b"])
    yield h
    h.stop()


def _on(node_id: str, offset: int = 0, soft: bool = False):
    return W.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)
    ).remote(offset)


def test_nodes_lists_the_driver_and_the_joined_hosts(hosts):
    ids = hosts.node_ids()
    ns = adag.nodes()
    assert ns[0]["NodeID"] == "0" and ns[0]["IsDriver"] and ns[0]["AgentPid"] == os.getpid()
    joined = {n["NodeID"]: n for n in ns[1:]}
    for node_id, name, pid in zip(ids, ["py-a", "py-b"], hosts.pids):
        n = joined[node_id]
        assert n["NodeName"] == name and n["Alive"] and n["AgentPid"] == pid
        assert n["NodeManagerAddress"] == "127.0.0.1"
        assert n["Resources"]["CPU"] >= 1
    assert len(adag.wait_for_nodes(2, timeout=30)) >= 3


def test_chain_across_hosts(hosts):
    ida, idb = hosts.node_ids()
    a, b, c = _on(ida, 1), W.options(host=int(idb)).remote(10), W.remote(100)
    assert a.where.remote().get()[0] == "py-a"
    assert b.where.remote().get()[0] == "py-b"
    assert c.where.remote().get()[0] is None
    assert (a._node_id, b._node_id, c._node_id) == (ida, idb, "0")
    with InputNode() as inp:
        dag = c.step.bind(b.step.bind(a.step.bind(inp)))
    compiled = dag.experimental_compile()
    try:
        for i in range(20):
            assert compiled.execute(i).get(timeout=30) == i + 111
        # Pipelined: several in flight across the hosts.
        refs = [compiled.execute(i) for i in range(8)]
        assert adag.get(refs, timeout=30) == [i + 111 for i in range(8)]
    finally:
        compiled.teardown()


def test_chain_across_hosts_async(hosts):
    ida, idb = hosts.node_ids()
    a, b = _on(ida, 1), _on(idb, 10)
    with InputNode() as inp:
        dag = b.step.bind(a.step.bind(inp))
    compiled = dag.experimental_compile(enable_asyncio=True)

    async def main():
        futs = [await compiled.execute_async(i) for i in range(5)]
        return [await asyncio.wait_for(f, 30) for f in futs]

    try:
        assert asyncio.run(main()) == [i + 11 for i in range(5)]
    finally:
        compiled.teardown()


def test_numpy_arrays_cross_hosts(hosts):
    ida, idb = hosts.node_ids()
    a, b = _on(ida), _on(idb)
    with InputNode() as inp:
        dag = b.scale.bind(a.scale.bind(inp, 2), 3)
    compiled = dag.experimental_compile()
    try:
        for n in [0, 3, 1 << 10, 1 << 22]:  # empty, small, 4 KiB, 16 MiB of float32
            x = np.arange(n, dtype=np.float32)
            y = compiled.execute(x).get(timeout=60)
            assert y.dtype == np.float32 and y.shape == (n,)
            np.testing.assert_array_equal(y, x * 6)
        m = np.ones((64, 32), dtype=np.int64)
        assert compiled.execute(m).get(timeout=30).sum() == 64 * 32 * 6
    finally:
        compiled.teardown()


def test_one_node_read_on_several_hosts(hosts):
    ida, idb = hosts.node_ids()
    src, x, y, z = W.remote(0), _on(ida, 1), _on(idb, 2), _on(idb, 3)
    with InputNode() as inp:
        first = src.echo.bind(inp)
        dag = adag.MultiOutputNode([x.step.bind(first), y.step.bind(first), z.step.bind(first)])
    compiled = dag.experimental_compile()
    try:
        assert adag.get(compiled.execute(10), timeout=30) == [11, 12, 13]
    finally:
        compiled.teardown()


def test_unsatisfiable_placement_is_a_clear_error(hosts):
    with pytest.raises(adag.PlacementError) as e:
        W.options(
            name="stranded",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id="97", soft=False),
        ).remote()
    msg = str(e.value)
    assert "stranded" in msg and "'97'" in msg and "python -m adag.agent" in msg
    assert "soft=True" in msg and "py-a" in msg
    with pytest.raises(adag.PlacementError, match="host 98"):
        W.options(host=98).remote()
    # soft=True: the driver's host instead.
    s = _on("97", soft=True)
    assert s._node_id == "0" and s.where.remote().get()[0] is None
    with pytest.raises(TypeError, match="not supported"):
        W.options(scheduling_strategy="NEAREST").remote()
    with pytest.raises(TypeError, match="not both"):
        W.options(host=1, scheduling_strategy="SPREAD").remote()


def test_spread_places_actors_on_every_host_in_turn(hosts):
    actors = [W.options(scheduling_strategy="SPREAD").remote() for _ in range(3)]
    assert sorted(a._node_id for a in actors) == sorted(["0"] + hosts.node_ids())


def test_actor_on_a_killed_host_worker_fails_naming_the_host(hosts):
    ida, idb = hosts.node_ids()
    a, b = _on(ida, 1), W.options(name="doomed", host=idb).remote(2)
    with InputNode() as inp:
        dag = b.step.bind(a.step.bind(inp))
    compiled = dag.experimental_compile()
    assert compiled.execute(1).get(timeout=30) == 4
    os.kill(b.where.remote().get()[1], signal.SIGKILL)
    with pytest.raises(adag.ActorDiedError) as e:
        for _ in range(100):
            compiled.execute(1).get(timeout=30)
            time.sleep(0.05)
    assert "doomed" in str(e.value) and "py-b" in str(e.value), str(e.value)
    # The host itself is fine: a new actor there works.
    c = _on(idb, 5)
    assert c.step.remote(1).get(timeout=30) == 6


def test_lost_host_fails_the_graph_and_leaves_nothing():
    _listening()
    shm_before = set(os.listdir("/dev/shm"))
    lone = LocalHosts(1, names=["py-lost"])
    try:
        (node,) = lone.node_ids()
        a, b = W.remote(1), W.options(name="far", host=node).remote(2)
        worker = b.where.remote().get()[1]
        with InputNode() as inp:
            dag = b.step.bind(a.step.bind(inp))
        compiled = dag.experimental_compile()
        assert compiled.execute(1).get(timeout=30) == 4
        lone.kill(0)
        with pytest.raises(adag.ActorDiedError) as e:
            compiled.execute(2).get(timeout=30)
        assert "far" in str(e.value) and "py-lost" in str(e.value), str(e.value)
        compiled.teardown()
        # The lost host stays listed, dead, with when and why (Ray's `Alive: False`).
        (gone,) = [n for n in adag.nodes() if n["NodeID"] == node]
        assert gone["Alive"] is False and gone["NodeName"] == "py-lost", gone
        assert "connection" in gone["DeathReasonMessage"], gone
        assert abs(gone["LostAt"] - time.time()) < 120, gone
        assert wait_gone(lone.pids + [worker])
    finally:
        lone.stop()
    assert set(os.listdir("/dev/shm")) <= shm_before


DRIVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from adag.cluster import LocalHosts
    from actors import Where
    adag.init(listen="127.0.0.1:0", token="t0ken")
    hosts = LocalHosts(2)
    W = adag.remote(Where)
    a, b = [W.options(host=n).remote(1) for n in hosts.node_ids()]
    with InputNode() as inp:
        dag = b.step.bind(a.step.bind(inp))
    compiled = dag.experimental_compile()
    assert compiled.execute(1).get() == 3
    pids = hosts.pids + [a.where.remote().get()[1], b.where.remote().get()[1]]
    print(" ".join(map(str, pids)), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_driver_gone_leaves_no_agent_or_worker(how):
    shm_before = set(os.listdir("/dev/shm"))
    p = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(here=HERE), "exit" if how == "exit" else "hang"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 4, pids
        if how == "killed":
            os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=60) in (0, -signal.SIGKILL)
        assert wait_gone(pids), "agents or workers outlived their driver"
    finally:
        if p.poll() is None:
            p.kill()
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_an_agent_with_another_secret_cannot_join():
    addr = _listening()
    env = dict(os.environ, ADAG_JOIN=addr, ADAG_TOKEN="not-the-secret")
    p = subprocess.run(
        [sys.executable, "-m", "adag.agent"], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == adag.cluster.EXIT_JOIN_FAILED, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "adag.agent"],
        env={k: v for k, v in os.environ.items() if k != "ADAG_JOIN"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "usage" in p.stderr


def test_importing_adag_with_adag_join_set_does_not_make_an_agent():
    env = dict(os.environ, ADAG_JOIN="127.0.0.1:9", ADAG_TOKEN="x")
    p = subprocess.run(
        [sys.executable, "-c", "import os, adag; print(os.environ['ADAG_JOIN'])"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout.strip() == "127.0.0.1:9", p.stderr


def test_init_and_wait_for_nodes_errors(hosts):
    addr = _listening()
    with pytest.raises(adag.AdagError, match="already listens"):
        adag.init(listen="127.0.0.1:0", token="another")
    with pytest.raises(ValueError, match="shared secret"):
        adag.cluster.listen("127.0.0.1:0", token="")
    with pytest.raises(TypeError, match="listen="):
        adag.init(token="x")
    assert adag.init() is None  # Ray's plain init: nothing to do
    t = time.monotonic()
    with pytest.raises(adag.GetTimeoutError, match=addr.replace(".", r"\.")):
        adag.wait_for_nodes(50, timeout=0.2)
    assert time.monotonic() - t < 10


def test_collectives_and_a_tensor_edge_span_hosts(hosts):
    """An allreduce over an actor on each joined host and one on the driver's (a TCP
    communicator group), and a tensor edge through a communicator between two hosts."""
    from adag.collective import ReduceOp, allreduce
    from actors import Echo

    E = adag.remote(Echo)
    a, b = [
        E.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote()
        for n in hosts.node_ids()
    ]
    c = E.remote()
    with InputNode() as inp:
        parts = [w.scale.bind(inp, k=i + 1) for i, w in enumerate([a, b, c])]
        summed = allreduce.bind(parts, op=ReduceOp.SUM)
        edge = b.scale.bind(a.scale.bind(inp, k=5).with_tensor_transport("auto"), k=1)
        dag = MultiOutputNode(summed + [edge])
    compiled = dag.experimental_compile()
    try:
        for n in [6, 1 << 20]:
            x = np.arange(n, dtype=np.float32)
            out = adag.get(compiled.execute(x), timeout=60)
            for r in out[:3]:
                assert np.array_equal(r, x * 6)
            assert np.array_equal(out[3], x * 5)
    finally:
        compiled.teardown()


MAIN_ACROSS_HOSTS = textwrap.dedent(
    """
    import dataclasses, sys
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from adag.cluster import LocalHosts
    from actors import Where

    @dataclasses.dataclass
    class Order:
        item: str
        count: int

    adag.init(listen="127.0.0.1:0", token="main-across-hosts")
    hosts = LocalHosts(2, names=["far-a", "far-b"])
    try:
        a_node, b_node = hosts.node_ids()
        W = adag.remote(Where)
        a = W.options(host=a_node).remote(0)
        b = W.options(host=b_node).remote(0)
        with InputNode() as inp:
            dag = b.echo.bind(a.echo.bind(inp))
        compiled = dag.experimental_compile()
        out = compiled.execute(Order("tea", 3)).get(timeout=60)
        print("across", type(out) is Order and out == Order("tea", 3))
        compiled.teardown()
    finally:
        adag.shutdown()
        hosts.stop()
    """
)


def test_a_class_of_the_script_crosses_hosts_by_value():
    """A dataclass of the driver's ``__main__`` through actors on two other hosts (TCP
    between them) and back: it travels by value and returns as the script's own class."""
    p = subprocess.run(
        [sys.executable, "-c", MAIN_ACROSS_HOSTS.format(here=HERE)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    assert "across True" in p.stdout.split("\n"), p.stdout + p.stderr
