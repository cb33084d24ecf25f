"""Ray Compiled Graphs conformance: the behaviour Ray 2.60 documents for its Python API, as a
program written for Ray sees it through ``import adag as ray``. Each test names the point of
Ray's behaviour it checks."""

import copy
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import adag as ray
from adag.dag import DAGContext, InputNode, MultiOutputNode
from adag.exceptions import (
    ActorDiedError,
    GetTimeoutError,
    RayActorError,
    RayCgraphCapacityExceeded,
    RayChannelError,
    RayChannelTimeoutError,
    RayTaskError,
)

from actors import Echo


@ray.remote
class Worker:
    """A pipeline stage that logs what it ran, in order."""

    def __init__(self, rank=0):
        self.rank = rank
        self.log = []

    def fwd(self, x):
        self.log.append(f"F{x}")
        return x + 1

    def bwd(self, x):
        self.log.append(f"B{x}")
        return x * 10

    def history(self):
        return self.log

    @ray.method(num_returns=2)
    def split(self, x):
        return x, -x

    @ray.method(num_returns=2)
    def three(self, x):
        return x, x, x

    def two(self, a, b=0, *, c=1):
        return a + b + c

    def crash(self, x):
        return [1, 2, 3][x]

    def call_other(self, other, x):
        return ray.get(other.two.remote(x, 1))

    def die(self, x):
        os._exit(1)


@ray.remote
class Holder:
    def __init__(self, other):
        self.other = other

    def ask(self, x):
        return ray.get(self.other.two.remote(x))


def _compile(dag, **kw):
    return dag.experimental_compile(**kw)


# 1. num_returns -------------------------------------------------------------------------


def test_num_returns_nodes_feed_actors_and_outputs():
    a, b = Worker.remote(), Worker.remote()
    with InputNode() as inp:
        pos, neg = a.split.bind(inp)
        dag = MultiOutputNode([pos, b.fwd.bind(neg), neg])
    compiled = _compile(dag)
    try:
        for i in range(5):
            assert ray.get(compiled.execute(i)) == [i, -i + 1, -i]
    finally:
        compiled.teardown()


def test_num_returns_by_options_and_one_off_calls():
    a = Worker.remote()
    x, y = a.two.options(num_returns=1).remote(1), None
    assert ray.get(x) == 2 and y is None
    r1, r2 = a.split.remote(4)
    assert ray.get([r1, r2]) == [4, -4]
    with InputNode() as inp:
        p, q = a.fwd.options(num_returns=2).bind(inp)
        dag = MultiOutputNode([p, q])
    compiled = _compile(dag)
    try:
        # fwd returns one int: the count check fails, in both refs, and the graph lives on.
        for _ in range(2):
            refs = compiled.execute(3)
            with pytest.raises(ValueError, match="Expected 2 outputs, but got one int"):
                ray.get(refs)
    finally:
        compiled.teardown()


def test_num_returns_wrong_count_is_rays_error():
    a = Worker.remote()
    with InputNode() as inp:
        x, y = a.three.options(num_returns=2).bind(inp)
        dag = MultiOutputNode([x, y])
    compiled = _compile(dag)
    try:
        with pytest.raises(RayTaskError, match="Expected 2 outputs, but got 3 outputs") as e:
            ray.get(compiled.execute(1))
        assert isinstance(e.value, ValueError)
    finally:
        compiled.teardown()


def test_method_decorator_checks_its_options():
    with pytest.raises(ValueError):
        ray.method(num_returns=0)
    with pytest.raises(ValueError, match="unknown method options"):
        ray.method(colour="red")
    assert ray.method(num_returns=3)(lambda self: 0).__ray_num_returns__ == 3


# 2. Ray's modules and names -------------------------------------------------------------


def test_rays_module_layout_holds_the_same_objects():
    import adag.dag
    import adag.exceptions as exc
    import adag.experimental.collective as coll
    from adag.dag.compiled_dag_node import CompiledDAG
    from adag.experimental.channel.cpu_communicator import CPUCommunicator
    from adag.experimental.compiled_dag_ref import CompiledDAGFuture, CompiledDAGRef
    from adag.experimental.util.types import ReduceOp

    assert adag.dag.InputNode is ray.InputNode
    assert adag.dag.MultiOutputNode is ray.MultiOutputNode
    assert adag.dag.ClassMethodNode is ray.ClassMethodNode
    assert CompiledDAG is ray.CompiledDAG
    assert CompiledDAGRef is ray.CompiledDAGRef and CompiledDAGFuture is ray.CompiledDAGFuture
    assert ReduceOp is coll.ReduceOp is ray.collective.ReduceOp
    assert coll.allreduce is ray.collective.allreduce
    assert exc.RayTaskError is ray.TaskError
    assert exc.RayCgraphCapacityExceeded is ray.CapacityExceededError
    assert exc.RayError is ray.AdagError
    assert issubclass(exc.ActorDiedError, exc.RayActorError)
    assert issubclass(exc.ChannelClosedError, exc.RayChannelError)
    assert issubclass(exc.GetTimeoutError, exc.RayChannelTimeoutError)
    assert issubclass(exc.RayChannelTimeoutError, TimeoutError)
    assert CPUCommunicator(1, [object()]).get_transport_name() == "cpu"


def test_dag_context_defaults_and_use():
    ctx = DAGContext.get_current()
    assert ctx is DAGContext.get_current()
    assert (ctx.submit_timeout, ctx.get_timeout, ctx.max_inflight_executions) == (10, 10, 10)
    assert ctx.buffer_size_bytes == 1_000_000 and ctx.max_buffered_results == 1000
    a = Worker.remote()
    old = ctx.max_inflight_executions
    ctx.max_inflight_executions = 2
    try:
        with InputNode() as inp:
            dag = a.fwd.bind(inp)
        compiled = _compile(dag)
    finally:
        ctx.max_inflight_executions = old
    try:
        refs = [compiled.execute(i) for i in range(2)]
        with pytest.raises(RayCgraphCapacityExceeded):
            compiled.execute(3)
        assert ray.get(refs) == [1, 2]
    finally:
        compiled.teardown()


def test_put_wait_and_remote_functions():
    @ray.remote
    def square(x):
        return x * x, os.getpid()

    @ray.remote(num_returns=2)
    def pair(x):
        return x, x + 1

    ref = ray.put([1, 2])
    assert ray.get(ref) == [1, 2]
    value, pid = ray.get(square.remote(ray.put(7)))
    assert value == 49 and pid != os.getpid()
    p, q = pair.remote(1)
    assert ray.get([p, q]) == [1, 2]
    with pytest.raises(TypeError, match="cannot be called directly"):
        square(2)
    slow = Worker.remote()
    sleepy = ray.remote(Echo).remote()
    late = sleepy.sleep.remote(5)
    ready, not_ready = ray.wait([late, ref], num_returns=1, timeout=3)
    assert ready == [ref] and not_ready == [late]
    with pytest.raises(ValueError, match="num_returns cannot be greater"):
        ray.wait([ref], num_returns=2)
    with InputNode() as inp:
        dag = slow.fwd.bind(inp)
    compiled = _compile(dag)
    try:
        cref = compiled.execute(1)
        with pytest.raises(TypeError, match="wait\\(\\) expected a list of ray.ObjectRef"):
            ray.wait([cref])
        with pytest.raises(ValueError, match="must be a list of CompiledDAGRefs"):
            ray.get([cref, ref])
        assert ray.get(cref) == 2
    finally:
        compiled.teardown()
    # A graph of a remote function is refused at compile, as in Ray.
    with InputNode() as inp:
        fnode = square.bind(inp)
    with pytest.raises(NotImplementedError, match="only support actor method nodes"):
        fnode.experimental_compile()
    # ... and runs without compiling (Ray's classic dag.execute).
    assert ray.get(fnode.execute(3))[0] == 9


def test_classic_execute_runs_in_bind_order():
    a = Worker.remote()
    with InputNode() as inp:
        x, y = a.split.bind(inp)
        dag = MultiOutputNode([a.fwd.bind(x), y])
    assert ray.get(dag.execute(2)) == [3, -2]


# 3. Bind order --------------------------------------------------------------------------


def test_an_actor_runs_its_tasks_in_bind_order():
    """A pipeline-parallel schedule: forward micro-batches bound before the backward ones,
    the outputs listed the other way round. Ray runs F0 F1 F2 B1 B2 B3 on the stage."""
    stage = Worker.remote()
    with InputNode() as inp:
        f = [stage.fwd.bind(inp[i]) for i in range(3)]
        b = [stage.bwd.bind(x) for x in f]
        dag = MultiOutputNode(list(reversed(b)))
    compiled = _compile(dag)
    try:
        assert ray.get(compiled.execute(0, 1, 2)) == [30, 20, 10]
    finally:
        compiled.teardown()
    assert ray.get(stage.history.remote()) == ["F0", "F1", "F2", "B1", "B2", "B3"]


# 4. Ray's checks ------------------------------------------------------------------------


def test_bind_checks_the_signature():
    a = Worker.remote()
    with InputNode() as inp:
        with pytest.raises(TypeError, match="got an unexpected keyword argument 'd'"):
            a.two.bind(inp, d=1)
        with pytest.raises(TypeError, match="too many positional arguments"):
            a.two.bind(inp, 1, 2)
        with pytest.raises(TypeError, match="missing a required argument: 'a'"):
            a.two.bind()
        with pytest.raises(TypeError, match="has a signature `\\(a, b=0, \\*, c=1\\)`"):
            a.two.bind(inp, z=3)
    with pytest.raises(TypeError, match="signature"):
        a.two.remote(1, 2, 3)


@pytest.mark.parametrize("wrap", [lambda n: [n], lambda n: (n,), lambda n: {"k": n}, lambda n: [n, n]])
def test_nodes_inside_containers_are_refused(wrap):
    a = Worker.remote()
    with InputNode() as inp:
        dag = a.history.bind() if False else a.two.bind(wrap(inp))
    with pytest.raises(ValueError, match="DAGNodes from the arg .* not allowed to be placed inside any type of container"):
        dag.experimental_compile()


def test_leaf_nodes_are_refused():
    a, b = Worker.remote(), Worker.remote()
    with InputNode() as inp:
        out = a.fwd.bind(inp)
        b.bwd.bind(inp)  # reaches no output
    with pytest.raises(ValueError, match="doesn't support leaf nodes.*\\['bwd'\\]"):
        out.experimental_compile()
    # An unused value of a num_returns method counts as a leaf too.
    with InputNode() as inp:
        x, _unused = a.split.bind(inp)
    with pytest.raises(ValueError, match="leaf nodes"):
        x.experimental_compile()


def test_execute_checks_its_arguments():
    a = Worker.remote()
    with InputNode() as inp:
        dag = MultiOutputNode([a.two.bind(inp[0], inp[1]), a.two.bind(inp[0], inp.k)])
    compiled = _compile(dag)
    try:
        with pytest.raises(ValueError, match="must be called with 2 positional args, got 1"):
            compiled.execute(1)
        with pytest.raises(ValueError, match="must be called with kwarg `k`"):
            compiled.execute(1, 2)
        assert ray.get(compiled.execute(1, 2, k=3)) == [4, 5]
    finally:
        compiled.teardown()


def test_graph_shape_checks():
    a, b = Worker.remote(), Worker.remote()
    with pytest.raises(ValueError, match="Invalid input type for `args`"):
        MultiOutputNode(a)
    with pytest.raises(ValueError, match="InputNode should not take any args"):
        InputNode(1)
    with InputNode() as inp:
        dag = MultiOutputNode([a.fwd.bind(inp), b.fwd.bind(inp[0])])
    with pytest.raises(ValueError, match="All tasks must either use InputNode\\(\\) directly"):
        dag.experimental_compile()
    with InputNode() as inp:
        dag = a.fwd.bind(1)
    with pytest.raises(ValueError, match="No InputNode found in the DAG"):
        dag.experimental_compile()
    with InputNode() as inp:
        dag = MultiOutputNode([a.fwd.bind(inp[0]), b.two.bind(inp[1], inp[1])])
        b.bwd.bind(inp[2])  # inp[2] feeds no output
    with pytest.raises(ValueError, match="attributes 0, 1, 2, but 2 is unused"):
        dag.experimental_compile()


def test_compile_once_and_one_graph_per_node():
    a, b = Worker.remote(), Worker.remote()
    with InputNode() as inp:
        x = a.fwd.bind(inp)
        dag = b.fwd.bind(x)
    compiled = _compile(dag)
    compiled.teardown()
    with pytest.raises(ValueError, match="not allowed to call `experimental_compile` on the same DAG"):
        dag.experimental_compile()
    with pytest.raises(ValueError, match="The DAG was compiled more than once"):
        x.experimental_compile()


# 5. Messages and where errors surface ---------------------------------------------------


def test_closed_channel_says_so_in_rays_words():
    a = Worker.remote()
    with InputNode() as inp:
        dag = a.fwd.bind(inp)
    compiled = _compile(dag)
    ref = compiled.execute(1)
    assert ray.get(ref) == 2
    pending = compiled.execute(2)
    compiled.teardown()
    with pytest.raises(RayChannelError, match="^Channel closed."):
        compiled.execute(3)
    with pytest.raises(RayChannelError, match="^Channel closed."):
        ray.get(pending)


def test_actor_death_raises_from_get_as_ray_does():
    """Ray's quickstart: an actor is killed, the next execution's get raises
    ActorDiedError, and the other actors can be asked whether they live."""
    actors = [Worker.remote() for _ in range(3)]
    with InputNode() as inp:
        dag = MultiOutputNode([w.fwd.bind(inp) for w in actors])
    compiled = _compile(dag)
    assert ray.get(compiled.execute(1)) == [2, 2, 2]
    ray.kill(actors[0])
    ref = compiled.execute(1)  # no error here: the get raises, as in Ray
    with pytest.raises(ActorDiedError, match="^The actor died unexpectedly before finishing this task.") as e:
        ray.get(ref)
    assert isinstance(e.value, RayActorError)
    live = []
    for w in actors:
        try:
            ray.get(w.history.remote(), timeout=10)
            live.append(w)
        except RayActorError:
            pass
    assert live == actors[1:]
    compiled.teardown()


def test_timeouts_are_channel_timeouts():
    a = ray.remote(Echo).remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp, 1)
    compiled = _compile(dag)
    try:
        ref = compiled.execute(0.5)
        with pytest.raises(RayChannelTimeoutError):
            ray.get(ref, timeout=0.05)
        assert isinstance(GetTimeoutError("x"), TimeoutError)
        assert ray.get(ref, timeout=30) == 1  # adag: a timed-out ref stays valid
    finally:
        compiled.teardown()


# 6. Tracebacks --------------------------------------------------------------------------


def test_task_error_shows_the_actors_source_lines():
    a = Worker.remote()
    with InputNode() as inp:
        dag = a.crash.bind(inp)
    compiled = _compile(dag)
    try:
        with pytest.raises(IndexError) as e:
            ray.get(compiled.execute(7))
        text = str(e.value)
        assert "test_ray_compat.py" in text and "return [1, 2, 3][x]" in text, text
        assert isinstance(e.value, RayTaskError)
    finally:
        compiled.teardown()


def test_classes_pickled_by_value_keep_their_source(tmp_path):
    """A class of a script's ``__main__`` travels by value; its methods' lines still show
    in tracebacks, even where the file cannot be read."""
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import adag as ray
            from adag.dag import InputNode

            @ray.remote
            class Stage:
                def __init__(self, fail=False):
                    if fail:
                        raise RuntimeError("constructor refuses")
                def run(self, x):
                    return 1 // x  # the line the traceback shows

            s = Stage.remote()
            os.unlink(__file__)  # the worker can no longer read the file
            with InputNode() as inp:
                dag = s.run.bind(inp)
            compiled = dag.experimental_compile()
            try:
                ray.get(compiled.execute(0))
            except ZeroDivisionError as e:
                print("TASK", str(e))
            compiled.teardown()
            refused = Stage.remote(True)
            try:
                ray.get(refused.run.remote(1))
            except ray.exceptions.ActorDiedError as e:
                print("CTOR", str(e))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    assert "return 1 // x  # the line the traceback shows" in out.stdout, out.stdout
    ctor = out.stdout[out.stdout.index("CTOR"):]
    assert 'raise RuntimeError("constructor refuses")' in ctor, ctor
    assert "Traceback" in ctor


# 7. Small ones ---------------------------------------------------------------------------


def test_refs_in_rays_form_once_and_not_copied():
    a = Worker.remote()
    with InputNode() as inp:
        dag = MultiOutputNode([a.fwd.bind(inp)])
    compiled = _compile(dag)
    try:
        gid = compiled.get_id()
        assert len(gid) == 32 and str(compiled) == f"CompiledDAG({gid})"
        (ref,) = compiled.execute(1)
        assert str(ref) == f"CompiledDAGRef({gid}, execution_index=0, channel_index=0)"
        with pytest.raises(ValueError, match="CompiledDAGRef cannot be copied."):
            copy.copy(ref)
        with pytest.raises(ValueError, match="CompiledDAGRef cannot be deep copied."):
            copy.deepcopy(ref)
        with pytest.raises(ValueError, match="CompiledDAGRef cannot be pickled."):
            pickle.dumps(ref)
        with pytest.raises(TypeError, match="CompiledDAGRef cannot be used as Ray task/actor argument."):
            a.fwd.remote(ref)
        assert ray.get(ref) == 2
        with pytest.raises(ValueError, match="can only be called once on a CompiledDAGRef"):
            ray.get(ref)
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = a.fwd.bind(inp)
    compiled = _compile(dag)
    try:
        assert str(compiled.execute(1)).endswith("execution_index=0, channel_index=None)")
    finally:
        compiled.teardown()


def test_actor_handles_travel_to_other_actors():
    target = Worker.remote()
    holder = Holder.remote(target)  # a constructor argument
    assert ray.get(holder.ask.remote(5)) == 6
    caller = Worker.remote()
    assert ray.get(caller.call_other.remote(target, 3)) == 5  # a method argument
    with pytest.raises(AttributeError):
        target.no_such_method


def test_ctrl_c_interrupts_a_blocking_get():
    a = ray.remote(Echo).remote()
    with InputNode() as inp:
        dag = a.sleep.bind(inp)
    compiled = _compile(dag)
    try:
        ref = compiled.execute(3)
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            ray.get(ref, timeout=20)
        waited = time.monotonic() - start
        assert waited < 2.5, f"Ctrl-C took {waited:.2f} s to end the get"
        assert ray.get(ref, timeout=30) is None  # the ref is still good
    finally:
        compiled.teardown()


def test_init_refuses_unknown_keywords():
    assert ray.init(num_cpus=2, ignore_reinit_error=True, namespace="x") is None
    with pytest.raises(TypeError, match="unknown keyword arguments: colour"):
        ray.init(colour="red")


# 8. Python names ------------------------------------------------------------------------


def test_python_names_in_pictures_stats_and_timeline(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAG_TIMELINE", str(tmp_path / "trace.json"))
    a, b = Worker.remote(), Worker.remote()
    with InputNode() as inp:
        x, y = a.split.bind(inp)
        dag = MultiOutputNode([b.fwd.bind(x), y])
    compiled = _compile(dag)
    try:
        for i in range(3):
            ray.get(compiled.execute(i))
        dot = compiled.visualize(format="ascii")
        assert ".split#" in dot and ".split[1]#" in dot and ".fwd#" in dot, dot
        assert "call1" not in dot
        stats = compiled.stats()
        assert stats["executions_submitted"] == 3
        assert {s["actor"] for s in stats["actors"]} >= {a._actor_name, b._actor_name}
        assert any("fwd" in e["label"] for e in stats["edges"])
    finally:
        compiled.teardown()
    events = compiled.timeline()
    names = {e["name"] for e in events if e["kind"] == "compute"}
    assert {"split", "fwd"} <= names, names
    assert (tmp_path / "trace.json").exists()
