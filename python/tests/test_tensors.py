"""torch tensors on graph edges: a CPU tensor travels as its bytes (no pickling; nested
tensors out of band through the codec's own pickler), arrives as a tensor over the memory it
came in (shared memory between processes), every dtype exact; `with_tensor_transport` and
`TorchTensorType` place the received tensors as Ray documents; Ray's profiling switches
warn."""
import copyreg
import dataclasses
import os
import subprocess
import sys
import warnings
from typing import Dict

import numpy as np
import pytest
import torch

import adag
from adag import InputNode
from adag.experimental.channel.cpu_communicator import CPUCommunicator
from adag.experimental.channel.torch_tensor_type import TorchTensorType
from adag.experimental.util.types import Device
from actors import Echo

EchoActor = adag.remote(Echo)


@dataclasses.dataclass
class Intermediate:
    """vLLM's IntermediateTensors: a dataclass holding a dict of tensors."""

    tensors: Dict[str, torch.Tensor]
    step: int = 0


class Holder:
    """A user object holding a tensor."""

    def __init__(self, t):
        self.t = t


class Tagged(torch.Tensor):
    """A tensor subclass: pickled by torch itself, arrives as itself."""


class Probe:
    """What an actor sees of a received tensor."""

    def describe(self, t):
        return str(t.device), t.dtype, tuple(t.shape), _memory_of(t)

    def devices(self, value):
        return {k: str(v.device) for k, v in value.items()}


ProbeActor = adag.remote(Probe)


def _memory_of(t):
    """The file behind the mapping that holds `t`'s first byte ("" for anonymous memory):
    adag's shared memory is a memfd named `adag:...`."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5] if len(fields) > 5 else ""
    return "?"


def _in_shared_memory(t):
    return _memory_of(t).startswith("/memfd:adag")


def _same(a, b):
    """Bit for bit: dtype, shape and bytes (torch.equal on the bytes: every dtype has them,
    NaNs included)."""
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return True


#: Quantized dtypes: a tensor of one is not plain bytes (its quantizer goes with it), and
#: torch pickles it (test_tensors_torch_pickles_itself).
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _dtypes():
    """Every torch dtype a tensor of plain bytes can have."""
    out = {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED
    return sorted(out, key=str)


def _random(dtype, nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    return t.reshape(2, -1)


@pytest.fixture(scope="module")
def pair():
    return EchoActor.remote(), EchoActor.remote()


@pytest.fixture(scope="module")
def chain():
    """actor -> actor -> driver, on actors of its own (an actor serves one live graph)."""
    a, b = EchoActor.remote(), EchoActor.remote()
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp))
    compiled = dag.experimental_compile()
    yield compiled
    compiled.teardown()


def test_every_dtype_round_trips_exactly(chain):
    dtypes = _dtypes()
    assert len(dtypes) >= 30 and torch.bfloat16 in dtypes and torch.bool in dtypes
    for i, d in enumerate(dtypes):
        # Small (copied) and large (read in place, out of band).
        for nbytes in (64, 64 << 10):
            t = _random(d, nbytes, i)
            out = chain.execute(t).get(timeout=30)
            assert _same(out, t), d
            # Nested: through the codec's pickler (torch's own refuses uint16, float8, ...).
            back = chain.execute((t, [t[0]], {"k": t})).get(timeout=30)
            assert _same(back[0], t) and _same(back[1][0], t[0]) and _same(back[2]["k"], t)
    # Values, where torch compares them.
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.int64, torch.uint8, torch.complex64, torch.complex128):
        t = (torch.arange(5000) % 97).to(d)
        assert torch.equal(chain.execute(t).get(), t)
    b = torch.arange(5000) % 3 == 0
    assert torch.equal(chain.execute(b).get(), b)


def test_non_contiguous_zero_size_and_zero_dim(chain):
    cases = [
        torch.arange(24.0).reshape(4, 6).T,
        torch.arange(40_000, dtype=torch.int32).reshape(200, 200)[:, ::3],
        torch.ones(3, 1).expand(3, 5000),
        torch.arange(10_000, dtype=torch.bfloat16).reshape(100, 100).T,
        torch.zeros(0),
        torch.zeros(3, 0, 2, dtype=torch.int64),
        torch.empty(0, dtype=torch.bfloat16),
        torch.tensor(3.5),
        torch.tensor(True),
        torch.tensor(7, dtype=torch.bfloat16),
    ]
    for t in cases:
        for value in (t, (t,)):
            out = chain.execute(value).get()
            out = out[0] if isinstance(value, tuple) else out
            assert out.is_contiguous()
            assert out.dtype == t.dtype and out.shape == t.shape
            assert torch.equal(out, t)
    # Conjugate and negative views arrive with their values, not their bits.
    z = torch.tensor([1 + 2j, 3 - 4j] * 3000, dtype=torch.complex64)
    assert torch.equal(chain.execute(z.conj()).get(), z.conj().resolve_conj())
    neg = z.conj().imag
    assert neg.is_neg()
    assert torch.equal(chain.execute(neg).get(), neg.resolve_neg())


def test_requires_grad_and_parameters(chain):
    t = torch.ones(3, requires_grad=True)
    out = chain.execute(t).get()
    assert out.requires_grad and out.is_leaf and torch.equal(out.detach(), t.detach())
    nonleaf = t * 2
    out = chain.execute(nonleaf).get()
    assert out.requires_grad and out.is_leaf
    p = torch.nn.Parameter(torch.arange(8000.0))
    out = chain.execute(p).get()
    assert type(out) is torch.nn.Parameter and out.requires_grad
    assert torch.equal(out.detach(), p.detach())
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    back = chain.execute({"p": frozen}).get()["p"]
    assert type(back) is torch.nn.Parameter and not back.requires_grad
    assert not chain.execute(torch.ones(3)).get().requires_grad


def test_nested_tensors(chain):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    small = torch.tensor([1, 2, 3])
    inter = Intermediate({"hidden_states": big, "residual": big * 2}, step=3)
    out = chain.execute(inter).get()
    assert type(out) is Intermediate and out.step == 3
    assert torch.equal(out.tensors["hidden_states"], big)
    assert torch.equal(out.tensors["residual"], big * 2)
    assert _in_shared_memory(out.tensors["hidden_states"])
    value = [(big, small), {"s": small, "n": None}, Holder(big), "text"]
    back = chain.execute(value).get()
    assert torch.equal(back[0][0], big) and torch.equal(back[0][1], small)
    assert torch.equal(back[1]["s"], small) and back[1]["n"] is None
    assert type(back[2]) is Holder and torch.equal(back[2].t, big)
    assert back[3] == "text"
    # One tensor twice is one tensor on arrival (pickle's memo).
    twice = chain.execute([big, big]).get()
    assert twice[0] is twice[1]
    # numpy arrays beside tensors.
    arr = np.arange(100_000)
    mixed = chain.execute({"a": arr, "t": big}).get()
    assert np.array_equal(mixed["a"], arr) and torch.equal(mixed["t"], big)


# torch's own warnings: its pickling of a quantized tensor uses the deprecated TypedStorage.
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_tensors_torch_pickles_itself(chain):
    """Subclasses, sparse and quantized tensors have no plain bytes (or state of their own):
    torch pickles them, and they arrive as themselves."""
    tagged = torch.arange(6.0).as_subclass(Tagged)
    out = chain.execute(tagged).get()
    assert type(out) is Tagged and torch.equal(out.as_subclass(torch.Tensor), torch.arange(6.0))
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    assert torch.equal(chain.execute(sparse).get().to_dense(), sparse.to_dense())
    q = torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.qint8)
    back = chain.execute((q,)).get()[0]
    assert back.is_quantized and torch.equal(back.dequantize(), q.dequantize())


def test_received_tensor_is_shared_memory_read_in_place(pair):
    """The receiving side's tensor is a view of the channel's shared memory (not a copy on
    the heap), valid as long as the tensor lives, through later executions and teardown."""
    a, _ = pair
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    size = 16 << 20
    compiled = dag.experimental_compile(_buffer_size_bytes=size + (1 << 16))
    try:
        big = torch.arange(size // 4, dtype=torch.float32)
        out = compiled.execute(big).get()
        assert _in_shared_memory(out), _memory_of(out)
        assert not out.untyped_storage().resizable()  # torch does not own the memory
        nested = compiled.execute({"w": big}).get()["w"]
        assert _in_shared_memory(nested), _memory_of(nested)
        kept = out
        for i in range(4):
            other = compiled.execute(torch.full((size // 4,), float(i))).get()
            assert other[0] == i
        del other
        assert torch.equal(kept, big)
    finally:
        compiled.teardown()
    assert torch.equal(kept, big) and torch.equal(nested, big)


def test_actor_reads_tensors_in_place(pair):
    a, _ = pair
    probe = ProbeActor.remote()
    with InputNode() as inp:
        dag = probe.describe.bind(a.echo.bind(inp))
    compiled = dag.experimental_compile(_buffer_size_bytes=(4 << 20) + (1 << 16))
    try:
        device, dtype, shape, memory = compiled.execute(torch.ones(1 << 20)).get()
        assert (device, dtype, shape) == ("cpu", torch.float32, (1 << 20,))
        assert memory.startswith("/memfd:adag"), memory
    finally:
        compiled.teardown()


def test_sender_never_pickles_a_tensor_with_torch(chain, monkeypatch):
    """The writer sends a tensor's own bytes: torch's __reduce_ex__ (a torch.save of the
    storage into the stream, the old path) is never called, top level or nested."""
    calls = []
    original = torch.Tensor.__reduce_ex__

    def counting(self, proto):
        calls.append(proto)
        return original(self, proto)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counting)
    t = torch.arange(100_000, dtype=torch.float32)
    assert torch.equal(chain.execute(t).get(), t)
    back = chain.execute((t, {"x": t[:10]}, Intermediate({"h": t}))).get()
    assert torch.equal(back[0], t) and torch.equal(back[2].tensors["h"], t)
    assert calls == []
    # The codec's table is its own: the global one is untouched.
    assert torch.Tensor not in copyreg.dispatch_table


def test_codec_takes_tensor_bytes_out_of_band():
    from adag import _codec

    t = torch.arange(1 << 16, dtype=torch.float32)
    stream, buffers = _codec.dumps({"t": t, "u": (t[:4], 5)})
    assert len(stream) < 1024  # no tensor bytes in the stream
    assert sum(memoryview(b).nbytes for b in buffers) == t.nbytes + 16
    out = _codec.loads(stream, buffers)
    assert torch.equal(out["t"], t) and torch.equal(out["u"][0], t[:4]) and out["u"][1] == 5
    # The bytes were not copied on the way: the rebuilt tensor is a view of the sent one.
    assert out["t"].data_ptr() == t.data_ptr()
    # A lambda goes by value (cloudpickle), its tensors still out of band.
    stream, buffers = _codec.dumps((lambda x: x + 1, t))
    f, back = _codec.loads(stream, buffers)
    assert f(1) == 2 and torch.equal(back, t) and len(buffers) == 1


def test_codec_device_override():
    """A value says where its tensors go (the sender's device, or its node's annotation);
    a reading edge's own annotation overrides it."""
    from adag import _codec

    t = torch.arange(5000.0)
    stream, buffers = _codec.dumps([t], device="cuda")
    # Here (no GPU) placing on CUDA fails, with Ray's words and the fix.
    with pytest.raises(RuntimeError, match="No CUDA GPUs are available.*device=\"cpu\""):
        _codec.loads(stream, buffers)
    back = _codec.loads(stream, buffers, device="cpu")
    assert back[0].device.type == "cpu" and torch.equal(back[0], t)


def test_worker_without_tensors_never_imports_torch():
    fresh = EchoActor.remote()
    with InputNode() as inp:
        dag = fresh.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        for v in (1, "x", [1, 2], {"a": np.arange(10_000)}, np.ones(100), b"bytes"):
            compiled.execute(v).get()
    finally:
        compiled.teardown()
    assert "torch" in sys.modules  # the driver has it
    assert adag.get(fresh.loaded.remote("torch")) is False
    # ...and one that does receive a tensor has it.
    with InputNode() as inp:
        dag = fresh.echo.bind(inp)
    compiled = dag.experimental_compile()
    try:
        compiled.execute(torch.ones(2)).get()
    finally:
        compiled.teardown()
    assert adag.get(fresh.loaded.remote("torch")) is True


def test_receiving_warns_nothing():
    """torch warns once that a buffer is not writable; adag's rule says so instead
    (documented), and no warning reaches the program."""
    code = (
        "import sys, warnings; sys.path.insert(0, %r)\n"
        "warnings.filterwarnings('error', message='.*not writable')\n"
        "import torch, adag\n"
        "from actors import Echo\n"
        "a = adag.remote(Echo).remote()\n"
        "with adag.InputNode() as inp:\n"
        "    dag = a.echo.bind(inp)\n"
        "c = dag.experimental_compile()\n"
        "assert torch.equal(c.execute(torch.ones(100_000)).get(), torch.ones(100_000))\n"
        "assert torch.equal(c.execute([torch.ones(9)]).get()[0], torch.ones(9))\n"
        "c.teardown()\n"
        "print('ok')\n"
    ) % os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "not writable" not in r.stderr


def test_device_cpu(pair):
    a, _ = pair
    probe = ProbeActor.remote()
    # Actor to actor, and the driver's input, and an output the driver reads.
    with InputNode() as inp:
        dag = probe.devices.bind(a.echo.bind(inp).with_tensor_transport(device="cpu"))
    compiled = dag.experimental_compile()
    try:
        assert compiled.execute({"x": torch.ones(3)}).get() == {"x": "cpu"}
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = probe.describe.bind(inp.with_tensor_transport(device=Device.CPU))
    compiled = dag.experimental_compile()
    try:
        assert compiled.execute(torch.ones(3)).get()[0] == "cpu"
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = a.echo.bind(inp).with_tensor_transport("auto", device="cpu")
    compiled = dag.experimental_compile()
    try:
        out = compiled.execute(torch.ones(3)).get()
        assert out.device.type == "cpu" and torch.equal(out, torch.ones(3))
    finally:
        compiled.teardown()


def test_device_cuda_without_a_gpu_says_which_value_and_the_fix(pair):
    """Ray's behaviour on a reader without a GPU: RuntimeError "No CUDA GPUs are available"
    as the task's error; adag's message names the value and the fix."""
    assert not torch.cuda.is_available()
    a, b = pair
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp).with_tensor_transport(device="cuda"))
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(RuntimeError) as info:
            compiled.execute({"w": torch.ones(3)}).get()
        msg = str(info.value)
        assert "RuntimeError: No CUDA GPUs are available" in msg
        assert "dtype=float32, shape=(3,)" in msg
        assert "argument 0 of echo" in msg and "ClassMethodNode(Echo.echo" in msg
        assert "has no GPU" in msg and 'with_tensor_transport(device="cpu")' in msg
        assert isinstance(info.value, adag.exceptions.RayTaskError)
    finally:
        compiled.teardown()
    # The graph's input annotated for the GPU ("gpu" is the same as "cuda").
    with InputNode() as inp:
        dag = a.echo.bind(inp.with_tensor_transport(device="gpu"))
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(RuntimeError, match="No CUDA GPUs are available.*InputNode"):
            compiled.execute(torch.ones(2)).get()
        # The graph lives on: a value without tensors passes.
        assert compiled.execute(5).get() == 5
    finally:
        compiled.teardown()
    # An output the driver reads.
    with InputNode() as inp:
        dag = a.echo.bind(inp).with_tensor_transport(device="cuda")
    compiled = dag.experimental_compile()
    try:
        with pytest.raises(RuntimeError, match="No CUDA GPUs are available.*has no GPU"):
            compiled.execute(torch.ones(2)).get()
    finally:
        compiled.teardown()


def test_torch_tensor_type_validation(pair):
    a, b = pair
    t = TorchTensorType()
    assert (t.transport, t.device, t.static_shape, t.direct_return) == (
        "auto", Device.DEFAULT, False, False)
    assert TorchTensorType.AUTO == "auto" and TorchTensorType.ACCELERATOR == "accelerator"
    assert TorchTensorType.CPU == "cpu"
    assert TorchTensorType(transport="nccl").transport == "accelerator"
    assert TorchTensorType(device="cuda").device == Device.CUDA
    with pytest.raises(ValueError, match="`transport` must be TorchTensorType.AUTO, "
                                         "TorchTensorType.ACCELERATOR or TorchTensorType.CPU"):
        TorchTensorType(transport="gloo")
    with pytest.raises(ValueError, match="accelerator transport is not supported with CPU "
                                         "target device."):
        TorchTensorType(transport="accelerator", device=Device.CPU)
    comm = CPUCommunicator(2, [a, b])
    assert TorchTensorType(transport=comm).get_custom_communicator() is comm

    class Gloo(CPUCommunicator):
        def get_transport_name(self):
            return "gloo"

    # A communicator of its own kind keeps its name (it moves the tensors its own way).
    gloo = Gloo(2, [a, b])
    typed = TorchTensorType(transport=gloo)
    assert typed.transport == "gloo" and typed.get_custom_communicator() is gloo
    import copy

    assert copy.deepcopy(typed).get_custom_communicator() is gloo
    with InputNode() as inp:
        node = a.echo.bind(inp)
    with pytest.raises(ValueError, match="Invalid device 'tpu'"):
        node.with_tensor_transport(device="tpu")
    with pytest.raises(ValueError, match="Invalid transport type: 'ucx'"):
        node.with_tensor_transport(transport="ucx")
    with pytest.raises(ValueError, match="accelerator transport is not supported"):
        node.with_tensor_transport(transport="nccl", device="cpu")
    with pytest.raises(TypeError, match="with_type_hint takes a TorchTensorType"):
        node.with_type_hint("nccl")
    assert node.with_tensor_transport(transport=comm, device="cpu") is node
    assert node.type_hint.transport == "cpu" and node.type_hint.device == Device.CPU
    hint = TorchTensorType(device="cpu")
    assert node.with_type_hint(hint) is node and node.type_hint is not hint


def test_accelerator_transport_checks_at_compile(pair):
    a, b = pair
    # Ray's rule: the driver takes part in no communicator.
    with InputNode() as inp:
        dag = a.echo.bind(inp.with_tensor_transport("nccl"))
    with pytest.raises(adag.exceptions.CompileError, match="DAG inputs cannot be transferred via NCCL"):
        dag.experimental_compile()
    with InputNode() as inp:
        dag = a.echo.bind(inp.with_tensor_transport(transport=CPUCommunicator(2, [a, b])))
    with pytest.raises(adag.exceptions.CompileError, match="DAG inputs cannot be transferred"):
        dag.experimental_compile()
    # An actor without a GPU cannot send over an accelerator.
    with InputNode() as inp:
        dag = b.echo.bind(a.echo.bind(inp).with_tensor_transport("accelerator"))
    with pytest.raises(adag.exceptions.CompileError,
                       match="does not have an accelerator assigned by Ray.*num_gpus=1"):
        dag.experimental_compile()
    # With one, the program runs (tensors through host memory), as do a CPUCommunicator's.
    g = EchoActor.options(num_gpus=1).remote()
    with InputNode() as inp:
        dag = b.echo.bind(g.echo.bind(inp).with_tensor_transport("nccl"))
    compiled = dag.experimental_compile()
    try:
        assert torch.equal(compiled.execute(torch.ones(4)).get(), torch.ones(4))
    finally:
        compiled.teardown()
    with InputNode() as inp:
        dag = b.echo.bind(
            a.echo.bind(inp).with_tensor_transport(transport=CPUCommunicator(2, [a, b])))
    compiled = dag.experimental_compile()
    try:
        assert torch.equal(compiled.execute(torch.ones(4)).get(), torch.ones(4))
    finally:
        compiled.teardown()


@pytest.mark.parametrize(
    "variable", ["RAY_CGRAPH_ENABLE_TORCH_PROFILING", "RAY_CGRAPH_ENABLE_NVTX_PROFILING"])
def test_profiling_variables_warn(pair, monkeypatch, variable):
    a, _ = pair
    monkeypatch.setenv(variable, "1")
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    with pytest.warns(UserWarning, match=f"{variable} is set, but adag does not support it.*"
                                         "ADAG_TIMELINE.*docs/observability.md"):
        compiled = dag.experimental_compile()
    compiled.teardown()
    monkeypatch.setenv(variable, "0")
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = dag.experimental_compile()
    compiled.teardown()
