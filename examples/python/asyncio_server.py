"""A request loop of an asyncio server in Ray Compiled Graphs' style, run on adag: a graph
compiled with `enable_asyncio=True`, many requests in flight at once, each awaited twice
(submit, then result). Only the import lines differ from Ray's."""

import asyncio
import time

import adag as ray  # with Ray: import ray
from adag.dag import InputNode  # with Ray: from ray.dag import InputNode


@ray.remote
class Tokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


@ray.remote
class Model:
    def __init__(self):
        self.served = 0

    def predict(self, tokens):
        self.served += 1
        return sum(tokens) % 997


async def handle(dag, text):
    future = await dag.execute_async(text)
    return await future


async def main():
    tok, model = Tokenizer.remote(), Model.remote()
    with InputNode() as inp:
        dag = model.predict.bind(tok.encode.bind(inp))
    compiled = dag.experimental_compile(enable_asyncio=True, _max_inflight_executions=8)
    requests = [f"request {i}" for i in range(200)]
    start = time.perf_counter()
    answers = []
    for i in range(0, len(requests), 8):
        answers += await asyncio.gather(*(handle(compiled, r) for r in requests[i : i + 8]))
    took = time.perf_counter() - start
    assert answers == [sum(map(ord, r)) % 997 for r in requests]
    print(f"served {len(answers)} requests in {took * 1000:.1f} ms ({len(answers) / took:.0f}/s)")
    compiled.teardown()


asyncio.run(main())
print("asyncio_server: ok")
