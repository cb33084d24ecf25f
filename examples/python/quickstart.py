"""A Ray Compiled Graphs program, run on adag: only the import lines differ from Ray's
(`import ray` and `from ray.exceptions import ...`). An echo actor called the classic way,
then as a compiled graph; a chain and a graph of several outputs; an actor that dies."""

import time

import adag as ray  # with Ray: import ray
from adag.exceptions import ActorDiedError, RayActorError  # with Ray: from ray.exceptions import ...


@ray.remote
class Echo:
    def __init__(self):
        self.seen = 0

    def echo(self, value):
        self.seen += 1
        return value

    def seen_so_far(self):
        return self.seen


def timed(label, call, rounds=200):
    for _ in range(10):
        call()
    start = time.perf_counter()
    for _ in range(rounds):
        call()
    took = (time.perf_counter() - start) / rounds
    print(f"{label:<34} {took * 1e6:9.1f} us per round trip")
    return took


first = Echo.remote()
classic = timed("one-off actor call (.remote)", lambda: ray.get(first.echo.remote("hi")))

with ray.dag.InputNode() as inp:
    graph = first.echo.bind(inp)
assert ray.get(graph.execute("not compiled")) == "not compiled"

compiled = graph.experimental_compile()
fast = timed("compiled graph (execute + get)", lambda: ray.get(compiled.execute("hi")))
print(f"compiled graph is {classic / fast:.0f}x faster than a one-off call")
compiled.teardown()

second = Echo.remote()
with ray.dag.InputNode() as inp:
    chain = second.echo.bind(first.echo.bind(inp))
compiled = chain.experimental_compile()
assert ray.get(compiled.execute("through two actors")) == "through two actors"
compiled.teardown()

actors = [Echo.remote() for _ in range(3)]
with ray.dag.InputNode() as inp:
    fan_out = ray.dag.MultiOutputNode([a.echo.bind(inp) for a in actors])
compiled = fan_out.experimental_compile()
assert ray.get(compiled.execute(7)) == [7, 7, 7]

ray.kill(actors[0])
ref = compiled.execute(8)
try:
    ray.get(ref)
    raise SystemExit("the graph ran with a dead actor")
except ActorDiedError as e:
    print("after a kill:", str(e).splitlines()[0])
alive = []
for a in actors:
    try:
        ray.get(a.seen_so_far.remote(), timeout=10)
        alive.append(a)
    except RayActorError:
        pass
assert alive == actors[1:], alive
print(f"{len(alive)} of {len(actors)} actors live on after the death; the graph is torn down")
compiled.teardown()
print("quickstart: ok")
