"""Ray's ``ray.dag.context``."""

from .._context import DAGContext

__all__ = ["DAGContext"]
