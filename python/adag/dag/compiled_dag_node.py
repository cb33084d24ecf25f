"""Ray's ``ray.dag.compiled_dag_node``."""

from .._dag import CompiledDAG

__all__ = ["CompiledDAG"]
