"""Ray's ``ray.experimental.channel.torch_tensor_type``: ``TorchTensorType``, the type hint
of a node whose value holds torch tensors (``node.with_type_hint(TorchTensorType(...))``, or
``node.with_tensor_transport(...)``, which builds one).

In adag's Python package every tensor travels as its bytes through the graph's channels
(shared memory on a host, TCP between hosts; a CUDA tensor through host memory), whatever
the transport. What the hint changes is where the reader places the tensors: ``device``
(``Device.DEFAULT``: the sender's device type; ``CPU``: host memory; ``GPU``/``CUDA``: the
reader's current CUDA device, Ray's ``RuntimeError`` "No CUDA GPUs are available" where
it has none). Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ..util.types import Device
from .communicator import Communicator


def _device(device: Any) -> Device:
    """``device`` as a :class:`Device` (Ray's names: ``"default"``, ``"cpu"``, ``"gpu"``,
    ``"cuda"``, or the enum); ``ValueError`` with Ray's words otherwise."""
    if isinstance(device, Device):
        return device
    try:
        return Device(device.lower() if isinstance(device, str) else device)
    except ValueError:
        valid = ", ".join(f"'{d.value}'" for d in Device)
        raise ValueError(f"Invalid device '{device}'. Valid options are: {valid}.") from None


class TorchTensorType:
    """A node's value holds torch tensors (Ray's ``TorchTensorType``).

    Args:
        transport: ``"auto"`` (default), ``"cpu"``, ``"accelerator"`` (``"nccl"``, Ray's
            older name, is the same), or a :class:`Communicator` (kept as
            :meth:`get_custom_communicator`; its ``get_transport_name()`` is the transport,
            whatever it is). Without a communicator, values travel through adag's channels;
            ``"accelerator"`` is checked at compile as Ray checks it (the writing actor must
            have a GPU, the driver cannot take part) and then travels through host memory
            like ``"auto"``.
        device: where the reader places the tensors (see the module's docstring).
        _static_shape: accepted (adag sends each tensor's shape with its bytes).
        _direct_return: accepted (there is no separate data channel to skip).

    Raises ``ValueError`` with Ray's messages for another transport name, or for
    ``"accelerator"`` with ``device=Device.CPU``.
    """

    AUTO = "auto"
    CPU = "cpu"
    ACCELERATOR = "accelerator"
    #: Ray's name of ``ACCELERATOR`` before 2.44, accepted as the same.
    NCCL = "nccl"

    def __init__(
        self,
        transport: Optional[Union[str, Communicator]] = AUTO,
        device: Union[Device, str] = Device.DEFAULT,
        _static_shape: bool = False,
        _direct_return: Optional[bool] = False,
    ) -> None:
        self._device = _device(device)
        self._static_shape = bool(_static_shape)
        self._direct_return = bool(_direct_return)
        self._communicator: Optional[Communicator] = None
        custom = isinstance(transport, Communicator)
        if custom:
            self._communicator = transport  # type: ignore[assignment]
            transport = transport.get_transport_name()  # type: ignore[union-attr]
        if transport == self.NCCL:
            transport = self.ACCELERATOR
        # A communicator of another kind ("gloo", ...) keeps its own name: it moves the
        # tensors its own way.
        if not custom and transport not in (self.AUTO, self.CPU, self.ACCELERATOR):
            raise ValueError(
                "`transport` must be TorchTensorType.AUTO, TorchTensorType.ACCELERATOR or "
                f"TorchTensorType.CPU (got {transport!r}; 'nccl' is accepted as ACCELERATOR, "
                "and a Communicator instance for its own transport)"
            )
        if self._device == Device.CPU and transport == self.ACCELERATOR:
            raise ValueError(
                "accelerator transport is not supported with CPU target device. Use "
                'transport="auto" to receive the tensors in host memory, or device="default" '
                "or \"cuda\" with the accelerator transport"
            )
        self.transport: str = transport  # type: ignore[assignment]

    @property
    def device(self) -> Device:
        """Where the reader places the tensors."""
        return self._device

    @property
    def static_shape(self) -> bool:
        return self._static_shape

    @property
    def direct_return(self) -> bool:
        return self._direct_return

    def requires_accelerator(self) -> bool:
        """Whether the hint asks for the accelerator transport (Ray's method)."""
        return self.transport == self.ACCELERATOR

    def get_custom_communicator(self) -> Optional[Communicator]:
        """The communicator given as ``transport``, if any (Ray's method)."""
        return self._communicator

    def _target(self) -> Optional[str]:
        """The device type the reader places tensors on, as the codec names it (``None``:
        the sender's)."""
        if self._device == Device.CPU:
            return "cpu"
        if self._device in (Device.GPU, Device.CUDA):
            return "cuda"
        return None

    def __deepcopy__(self, memo: Any) -> "TorchTensorType":
        # The communicator is shared, never copied (Ray's rule).
        copy = TorchTensorType(
            transport=self._communicator or self.transport,
            device=self._device,
            _static_shape=self._static_shape,
            _direct_return=self._direct_return,
        )
        copy._communicator = self._communicator
        return copy

    def __repr__(self) -> str:
        transport = (
            f"communicator {type(self._communicator).__name__}"
            if self._communicator is not None
            else repr(self.transport)
        )
        return f"TorchTensorType(transport={transport}, device={self._device.value!r})"


__all__ = ["TorchTensorType"]
