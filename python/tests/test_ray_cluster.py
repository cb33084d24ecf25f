"""adag on a Ray cluster: `adag.init(ray_address=...)` starts one adag agent per Ray node as
a Ray actor pinned there, actors are placed by Ray node id (and by the Ray resources they ask
for), a Ray node that goes is a lost adag host, and shutdown (or the driver's death) leaves
no agent, no worker and nothing in /dev/shm.

The cluster is `ray.cluster_utils.Cluster` on this machine: three Ray nodes (the head, where
this driver runs, and two more, one of them with a fake GPU), every one bound to 127.0.0.1,
so all traffic stays on loopback. One cluster for the module: starting one costs seconds.
"""
import os

# Before Ray is imported: keep Ray from rewriting 127.0.0.1 to the machine's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

import adag  # noqa: E402
from adag import InputNode, _ray  # noqa: E402
from adag.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from actors import Where  # noqa: E402
from procs import alive, wait_gone  # noqa: E402

try:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy as RayNodeAffinity,
    )
except ImportError:
    if os.environ.get("CI") or os.environ.get("ADAG_REQUIRE_RAY"):
        raise  # CI installs Ray (.ci/run): these tests must run there
    pytest.skip("Ray is not installed (pip install 'ray==2.60.0')", allow_module_level=True)

W = adag.remote(Where)
HERE = os.path.dirname(os.path.abspath(__file__))
ADAG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(adag.__file__)))
REPO = os.path.dirname(os.path.dirname(HERE))
LAUNCHER = os.path.join(REPO, "deploy", "ray", "launch.py")
LOOPBACK = "127.0.0.1"


def _processes_with(needle: bytes):
    """Pids of this user's processes whose environment holds ``needle`` (e.g.
    ``ADAG_TOKEN=<secret>``: the agents of one driver and their workers)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0") and alive(int(pid)):
                    found.append(int(pid))
        except OSError:  # gone, or another user's
            pass
    return found


def _bound_child(pid_of_parent: int, keep_thread: bool):
    """`sleep 60` started as the agents are (adag._ray's bootstrap); with ``keep_thread``
    the forking thread waits for the child (as the agent's actor does), else it ends once
    the child has set PR_SET_PDEATHSIG."""
    box, started = {}, threading.Event()

    def run():
        box["p"] = subprocess.Popen(
            [sys.executable, "-c", _ray._BOOT, str(pid_of_parent), "/bin/sleep", "60"]
        )
        started.set()
        if keep_thread:
            box["p"].wait()
        else:
            time.sleep(1.0)  # long enough for the child's prctl; then the thread ends

    t = threading.Thread(target=run, daemon=True)
    t.start()
    started.wait(30)
    if not keep_thread:
        t.join(30)
    return box["p"]


def test_an_agent_child_dies_with_its_forking_thread_not_before():
    """Why the agent's actor forks from a thread that waits: PR_SET_PDEATHSIG fires when the
    thread that forked the child ends, not only when the process does."""
    early = _bound_child(os.getpid(), keep_thread=False)
    assert early.wait(timeout=30) == -signal.SIGKILL  # killed when its thread ended
    kept = _bound_child(os.getpid(), keep_thread=True)
    time.sleep(1.0)
    assert kept.poll() is None  # alive while its thread waits for it
    kept.kill()
    kept.wait(timeout=30)
    # A parent that is gone before the child's prctl: the child exits at once.
    orphan = subprocess.run(
        [sys.executable, "-c", _ray._BOOT, "1", "/bin/sleep", "60"], timeout=30
    )
    assert orphan.returncode == 1


@pytest.fixture(scope="module")
def cluster():
    shm_before = set(os.listdir("/dev/shm"))
    # Ray's processes inherit this environment: programs that the launcher of deploy/ray
    # starts on the nodes (python -m adag.agent) import this adag.
    old_path = os.environ.get("PYTHONPATH")
    if os.path.basename(ADAG_ROOT) not in ("site-packages", "dist-packages"):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [ADAG_ROOT, old_path] if p)
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        c.add_node(num_cpus=1, num_gpus=1, node_ip_address=LOOPBACK)
        c.wait_for_nodes(timeout=60)
        started = time.monotonic()
        addr = adag.init(ray_address=c.address, log_to_driver=False, timeout=60)
        c.adag_init_s = time.monotonic() - started
        c.adag_address = addr
        yield c
    finally:
        adag.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
    assert set(os.listdir("/dev/shm")) <= shm_before


def _ray_nodes(c):
    """(driver's, plain, with a GPU): the three Ray node ids of the module's cluster."""
    alive_nodes = [n for n in ray.nodes() if n["Alive"]]
    head = c.head_node.node_id
    gpu = [n["NodeID"] for n in alive_nodes if n["Resources"].get("GPU")]
    plain = [
        n["NodeID"]
        for n in alive_nodes
        if n["NodeID"] != head and not n["Resources"].get("GPU")
    ]
    return head, plain[0], gpu[0]


def test_every_ray_node_has_an_adag_host(cluster):
    head, plain, gpu = _ray_nodes(cluster)
    ns = [n for n in adag.nodes() if n["Alive"]]  # hosts lost earlier stay listed, not alive
    by_ray = {n["RayNodeID"]: n for n in ns}
    assert set(by_ray) == {head, plain, gpu}, ns
    # The driver's own Ray node is the driver's host; the others run an agent each.
    assert by_ray[head]["NodeID"] == "0" and by_ray[head]["IsDriver"]
    assert by_ray[head]["AgentPid"] == os.getpid()
    token = adag.cluster._token
    for node_id in (plain, gpu):
        n = by_ray[node_id]
        assert n["NodeName"] == f"ray-{node_id[:12]}" and not n["IsDriver"]
        assert n["NodeManagerAddress"] == LOOPBACK
        # The Ray node's resources, as Ray lists them.
        assert n["Resources"]["CPU"] == 1.0
        with open(f"/proc/{n['AgentPid']}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
        assert b"adag.agent" in argv
        # The secret is in the agent's environment, never on a command line.
        assert not any(token.encode() in a for a in argv), argv
        assert n["AgentPid"] in _processes_with(f"ADAG_TOKEN={token}".encode())
    assert by_ray[gpu]["Resources"]["GPU"] == 1.0
    assert "GPU" not in by_ray[plain]["Resources"]
    assert cluster.adag_address.startswith(LOOPBACK + ":")
    with pytest.raises(adag.AdagError, match="already ran"):
        adag.init(ray_address=cluster.address)
    assert adag.init(ray_address=cluster.address, ignore_reinit_error=True) == cluster.adag_address
    print(f"adag.init(ray_address=...) took {cluster.adag_init_s:.2f} s for 2 agents")


def test_chain_over_three_ray_nodes_placed_by_ray_node_id(cluster):
    head, plain, gpu = _ray_nodes(cluster)
    # Ray's own strategy class and adag's place alike.
    a = W.options(scheduling_strategy=RayNodeAffinity(head, soft=False)).remote(1)
    b = W.options(scheduling_strategy=NodeAffinitySchedulingStrategy(plain, soft=False)).remote(10)
    c = W.options(scheduling_strategy=RayNodeAffinity(gpu, soft=False)).remote(100)
    hosts = {n["RayNodeID"]: n for n in adag.nodes() if n["Alive"]}
    assert [x._node_id for x in (a, b, c)] == [hosts[r]["NodeID"] for r in (head, plain, gpu)]
    where = [x.where.remote().get(timeout=30) for x in (a, b, c)]
    # The driver's host has no ADAG_HOST_NAME; the others are the agents of their Ray nodes.
    assert [w[0] for w in where] == [None, hosts[plain]["NodeName"], hosts[gpu]["NodeName"]]
    assert len({w[1] for w in where}) == 3  # three worker processes
    with InputNode() as inp:
        dag = c.step.bind(b.step.bind(a.step.bind(inp)))
    compiled = dag.experimental_compile()
    try:
        for i in range(20):
            assert compiled.execute(i).get(timeout=30) == i + 111
        refs = [compiled.execute(i) for i in range(8)]  # pipelined across the nodes
        assert adag.get(refs, timeout=30) == [i + 111 for i in range(8)]
    finally:
        compiled.teardown()


def test_resources_choose_the_ray_node_and_refuse_when_none_has_them(cluster):
    head, plain, gpu = _ray_nodes(cluster)
    hosts = {n["RayNodeID"]: n["NodeID"] for n in adag.nodes() if n["Alive"]}
    g = W.options(num_gpus=1, name="gpu-one").remote(0)
    assert g._node_id == hosts[gpu]
    # The only GPU is held: a second actor asking for one is refused, naming what is free.
    with pytest.raises(adag.PlacementError) as e:
        W.options(num_gpus=1, name="gpu-two").remote(0)
    msg = str(e.value)
    assert "gpu-two" in msg and "GPU: 1" in msg and "add_ray_nodes" in msg, msg
    # Pinned to a node without a GPU: refused; soft=True: any node that has one free.
    del g
    gc.collect()  # the handle is gone: its GPU is free again
    with pytest.raises(adag.PlacementError, match="pinned-gpu"):
        W.options(
            num_gpus=1, name="pinned-gpu", scheduling_strategy=RayNodeAffinity(plain, soft=False)
        ).remote(0)
    s = W.options(num_gpus=1, scheduling_strategy=RayNodeAffinity(plain, soft=True)).remote(0)
    assert s._node_id == hosts[gpu]
    adag.kill(s)  # a killed actor frees its GPU too
    custom = W.options(resources={"node:__internal_head__": 0.5}).remote(0)
    assert custom._node_id == "0"
    # Without resources an actor runs on the driver's host, as without Ray.
    assert W.remote(0)._node_id == "0"


def test_placement_on_a_ray_node_without_a_host_is_a_clear_error(cluster):
    with pytest.raises(adag.PlacementError) as e:
        W.options(
            name="nowhere", scheduling_strategy=RayNodeAffinity("ab" * 28, soft=False)
        ).remote()
    msg = str(e.value)
    assert "nowhere" in msg and "ab" * 28 in msg and "RayNodeID" in msg, msg
    assert W.options(scheduling_strategy=RayNodeAffinity("ab" * 28, soft=True)).remote()._node_id == "0"


def test_a_ray_node_added_later_joins_and_its_removal_fails_the_graph(cluster):
    """A Ray node added after init joins with adag.add_ray_nodes(); removed mid-run, its
    host is lost: the graph fails with ActorDiedError naming it, at once, and its agent and
    worker are gone."""
    node = cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes(timeout=60)
    # An agent that cannot join (here: handed another secret) is a clear error naming the
    # Ray node, at once rather than at the timeout; nothing of it stays.
    token = adag.cluster._token
    adag.cluster._token = "not-the-secret"
    try:
        with pytest.raises(adag.AdagError) as e:
            adag.add_ray_nodes(timeout=60)
    finally:
        adag.cluster._token = token
    msg = str(e.value)
    assert node.node_id in msg and "status 3" in msg and "add_ray_nodes" in msg, msg
    assert node.node_id not in [n["RayNodeID"] for n in adag.nodes()]  # never joined
    started = time.monotonic()
    ns = adag.add_ray_nodes(timeout=60)
    print(f"adag.add_ray_nodes() took {time.monotonic() - started:.2f} s for 1 agent")
    new = next(n for n in ns if n["RayNodeID"] == node.node_id)
    assert new["NodeName"] == f"ray-{node.node_id[:12]}"
    assert len(adag.add_ray_nodes(timeout=60)) == len(ns)  # nothing more to add
    a = W.remote(1)
    b = W.options(
        name="on-leaving-node", scheduling_strategy=RayNodeAffinity(node.node_id, soft=False)
    ).remote(10)
    worker = b.where.remote().get(timeout=30)[1]
    with InputNode() as inp:
        dag = b.step.bind(a.step.bind(inp))
    compiled = dag.experimental_compile()
    assert compiled.execute(1).get(timeout=30) == 12
    refs = [compiled.execute(i) for i in range(4)]
    removed = time.monotonic()
    cluster.remove_node(node)
    with pytest.raises(adag.ActorDiedError) as e:
        adag.get(refs, timeout=30)
        for _ in range(200):
            compiled.execute(1).get(timeout=30)
            time.sleep(0.05)
    took = time.monotonic() - removed
    msg = str(e.value)
    assert "on-leaving-node" in msg and new["NodeName"] in msg and "lost" in msg, msg
    assert took < 15, f"the lost host was reported {took:.1f} s after the node went"
    print(f"ActorDiedError {took * 1000:.0f} ms after the Ray node was removed: {msg}")
    compiled.teardown()
    # Listed as Ray lists a dead node: not alive, with why.
    (gone,) = [n for n in adag.nodes() if n["RayNodeID"] == node.node_id]
    assert not gone["Alive"] and gone["NodeID"] == new["NodeID"], gone
    assert "closed" in gone["DeathReasonMessage"], gone
    assert wait_gone([new["AgentPid"], worker]), "the agent or its worker outlived the Ray node"
    with pytest.raises(adag.PlacementError, match="lost"):
        W.options(scheduling_strategy=RayNodeAffinity(node.node_id, soft=False)).remote()
    # The node is gone from Ray too: nothing to add back.
    assert node.node_id not in [
        n["RayNodeID"] for n in adag.add_ray_nodes(timeout=60) if n["Alive"]
    ]


DRIVER = textwrap.dedent(
    """
    import os, sys, time
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.path.insert(0, {here!r})
    import adag
    from actors import Where
    import ray
    ray.init(address={address!r}, log_to_driver=False)
    adag.init(ray_address="auto")  # takes the connection of ray.init() above
    W = adag.remote(Where)
    far = [n for n in adag.nodes() if not n["IsDriver"] and n["Alive"]]
    actors = [W.options(host=n["NodeID"]).remote(1) for n in far]
    pids = [n["AgentPid"] for n in far] + [a.where.remote().get()[1] for a in actors]
    print(adag.cluster._token, " ".join(map(str, pids)), flush=True)
    time.sleep(600)
    """
)


def test_a_killed_driver_leaves_no_agent_or_worker(cluster):
    """The driver dies: Ray kills the actors it owned, the agents die with them (and see
    their driver go anyway), and their workers with them."""
    shm_before = set(os.listdir("/dev/shm"))
    p = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(here=HERE, address=cluster.address)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline().split()
        assert len(line) == 5, line
        token, pids = line[0], [int(x) for x in line[1:]]
        assert all(alive(x) for x in pids)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert wait_gone(pids), "agents or workers outlived their driver"
        assert _processes_with(f"ADAG_TOKEN={token}".encode()) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    assert set(os.listdir("/dev/shm")) <= shm_before


LAUNCHED = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {here!r})
    import adag
    from adag import InputNode
    from actors import Where
    # What a Rust driver does under deploy/ray/launch.py: listen where ADAG_LISTEN says, with
    # ADAG_TOKEN, and wait for ADAG_HOSTS hosts.
    assert adag.init() == os.environ["ADAG_LISTEN"]
    hosts = adag.wait_for_nodes(int(os.environ["ADAG_HOSTS"]), timeout=60)[1:]
    W = adag.remote(Where)
    actors = [W.options(host=h["NodeID"]).remote(10 ** i) for i, h in enumerate(hosts)]
    with InputNode() as inp:
        node = inp
        for a in actors:
            node = a.step.bind(node)
    compiled = node.experimental_compile()
    values = [compiled.execute(i).get(timeout=30) for i in range(5)]
    pids = [h["AgentPid"] for h in hosts] + [a.where.remote().get()[1] for a in actors]
    names = [h["NodeName"] for h in hosts]
    print("RESULT", json.dumps(dict(values=values, names=names, pids=pids)), flush=True)
    """
)


def test_the_ray_launcher_runs_a_driver_and_an_agent_per_node(cluster):
    """deploy/ray/launch.py (the recipe for Rust programs), with a Python driver that reads
    ADAG_LISTEN/ADAG_TOKEN/ADAG_HOSTS as the Rust driver is to, and `python -m adag.agent`
    as the agents' program (--agent; a Rust binary is its own agent)."""
    shm_before = set(os.listdir("/dev/shm"))
    ray_nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    p = subprocess.run(
        [sys.executable, LAUNCHER, "--ray-address", cluster.address,
         "--agent", f"{sys.executable} -m adag.agent",
         "--", sys.executable, "-c", LAUNCHED.format(here=HERE)],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
    got = json.loads(line[len("RESULT"):])
    values, names, pids = got["values"], got["names"], got["pids"]
    assert len(names) == len(ray_nodes) - 1  # every node but the driver's
    assert sorted(names) == sorted(f"ray-{n[:12]}" for n in ray_nodes if n != cluster.head_node.node_id)
    assert values == [i + sum(10 ** k for k in range(len(names))) for i in range(5)]
    assert wait_gone(pids), "the launcher left an agent or a worker"
    assert set(os.listdir("/dev/shm")) <= shm_before


# Built by `cargo test --workspace --release` (CI runs it before the Python suite): a driver
# that listens where ADAG_LISTEN says and runs a chain over the hosts; with ADAG_JOIN, an agent.
RUST_PROGRAM = os.path.join(
    os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target"),
    "release", "examples", "launched",
)


@pytest.mark.skipif(
    not os.path.exists(RUST_PROGRAM) and not os.environ.get("ADAG_REQUIRE_RAY"),
    reason="cargo build --release --example launched first",
)
def test_the_ray_launcher_runs_a_rust_program_as_driver_and_agents(cluster):
    """deploy/ray/launch.py with a Rust program (examples/launched.rs): the binary is the
    driver here (ADAG_LISTEN) and every other Ray node's agent (ADAG_JOIN, its start-up
    hook); the chain over the hosts answers right, and nothing with the secret is left."""
    token = "launch-" + os.urandom(8).hex()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != cluster.head_node.node_id]
    p = subprocess.run(
        [sys.executable, LAUNCHER, "--ray-address", cluster.address,
         "--", RUST_PROGRAM, str(len(others))],
        capture_output=True, text=True, timeout=180, env=dict(os.environ, ADAG_TOKEN=token),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"{len(others)} hosts joined" in p.stdout and "(correct)" in p.stdout, p.stdout
    for n in others:
        assert f"stage on ray-{n[:12]}: worker pid" in p.stdout, p.stdout
    deadline = time.monotonic() + 30
    while _processes_with(f"ADAG_TOKEN={token}".encode()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(f"ADAG_TOKEN={token}".encode()) == [], "a Rust agent or worker stayed"


def test_shutdown_leaves_no_agent_worker_or_shared_memory(cluster):
    """Last: adag.shutdown() kills every agent's Ray actor; nothing of adag is left."""
    shm_before = set(os.listdir("/dev/shm"))
    token = adag.cluster._token
    far = [n for n in adag.nodes() if not n["IsDriver"] and n["Alive"]]
    actors = [W.options(host=n["NodeID"]).remote(1) for n in far]
    with InputNode() as inp:
        node = inp
        for x in actors:
            node = x.step.bind(node)
    compiled = node.experimental_compile()
    assert compiled.execute(0).get(timeout=30) == len(actors)
    pids = [n["AgentPid"] for n in far] + [x.where.remote().get(timeout=30)[1] for x in actors]
    assert set(pids) <= set(_processes_with(f"ADAG_TOKEN={token}".encode()))
    adag.shutdown()
    assert not ray.is_initialized()  # adag.init connected to Ray, so shutdown disconnects
    assert [n for n in adag.nodes() if not n["IsDriver"] and n["Alive"]] == []
    assert wait_gone(pids), "an agent or a worker outlived adag.shutdown()"
    assert _processes_with(f"ADAG_TOKEN={token}".encode()) == []
    assert set(os.listdir("/dev/shm")) <= shm_before
    with pytest.raises(adag.AdagError, match="adag.init"):
        adag.add_ray_nodes()
