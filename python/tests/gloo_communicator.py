"""A user's communicator written on ``torch.distributed`` with the gloo backend (CPU,
loopback), as a Ray user writes one: adag must call it in each actor as Ray does. It records
every call, so that the tests can see who called what."""
import datetime
import socket

import torch
import torch.distributed as dist

from adag.experimental.channel.communicator import Communicator
from adag.experimental.util.types import ReduceOp

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # divided by the world size after
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooCommunicator(Communicator):
    def __init__(self, actors, port=None):
        self._actors = list(actors)
        self._port = port or free_port()
        self._rank = None
        self.calls = []

    def initialize(self, rank):
        self.calls.append(("initialize", rank))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{self._port}",
            rank=rank,
            world_size=len(self._actors),
            timeout=datetime.timedelta(seconds=60),
        )
        self._rank = rank

    def get_actor_handles(self):
        return list(self._actors)

    def get_rank(self, actor):
        names = [a._actor_name for a in self._actors]
        return names.index(actor._actor_name)

    def get_self_rank(self):
        return self._rank

    def get_world_size(self):
        return len(self._actors)

    def send(self, value, peer_rank):
        self.calls.append(("send", peer_rank, tuple(value.shape)))
        dist.send(value, dst=peer_rank)

    def recv(self, shape, dtype, peer_rank, allocator=None):
        self.calls.append(("recv", peer_rank, tuple(shape)))
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src=peer_rank)
        return t

    def allreduce(self, send_buf, recv_buf, op=ReduceOp.SUM):
        self.calls.append(("allreduce", op.name))
        recv_buf.copy_(send_buf)
        dist.all_reduce(recv_buf, op=_OPS[op])
        if op == ReduceOp.AVG:
            recv_buf /= len(self._actors)

    def allgather(self, send_buf, recv_buf):
        self.calls.append(("allgather",))
        dist.all_gather(list(recv_buf.chunk(len(self._actors))), send_buf.contiguous())

    def reducescatter(self, send_buf, recv_buf, op=ReduceOp.SUM):
        # gloo has no reduce_scatter: an allreduce, then this rank's part.
        self.calls.append(("reducescatter", op.name))
        total = send_buf.clone()
        dist.all_reduce(total, op=_OPS[op])
        recv_buf.copy_(total.chunk(len(self._actors))[self._rank])

    def destroy(self):
        self.calls.append(("destroy",))
        dist.destroy_process_group()

    def get_transport_name(self):
        return "gloo"

    @property
    def recv_stream(self):
        return None

    @property
    def send_stream(self):
        return None
