"""Ray's ``ray.dag.dag_node``."""

from .._dag import DAGNode

__all__ = ["DAGNode"]
