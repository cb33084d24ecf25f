"""Where an actor runs (Ray's ``ray.util.scheduling_strategies``).

Pass a strategy as ``.options(scheduling_strategy=...)`` of an actor class::

    from adag.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = adag.nodes()[1]["NodeID"]
    a = Stage.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    ).remote()

The strings ``"DEFAULT"`` (the driver's host) and ``"SPREAD"`` (the live hosts in turn,
the driver's included) are accepted too.
"""

from __future__ import annotations

from typing import Union


class NodeAffinitySchedulingStrategy:
    """Run the actor on one host (Ray's ``NodeAffinitySchedulingStrategy``).

    Args:
        node_id: the host's ``"NodeID"`` in :func:`adag.nodes` (its id: ``"0"`` is the
            driver's host, joined hosts count from ``"1"``); an ``int`` id is accepted too.
        soft: when the host is not (or no longer) among the live hosts, run the actor on the
            driver's host instead of failing (Ray's ``soft=True``). With ``soft=False`` such
            a placement raises :class:`adag.exceptions.PlacementError`.
    """

    def __init__(
        self,
        node_id: Union[str, int],
        soft: bool = False,
        _spill_on_unavailable: bool = False,
        _fail_on_unavailable: bool = False,
    ) -> None:
        if not isinstance(node_id, (str, int)) or isinstance(node_id, bool):
            raise TypeError(f"node_id must be a NodeID string (or an int id), not {node_id!r}")
        self.node_id = node_id
        self.soft = bool(soft)
        self._spill_on_unavailable = _spill_on_unavailable
        self._fail_on_unavailable = _fail_on_unavailable

    def __repr__(self) -> str:
        return f"NodeAffinitySchedulingStrategy(node_id={self.node_id!r}, soft={self.soft})"


__all__ = ["NodeAffinitySchedulingStrategy"]
