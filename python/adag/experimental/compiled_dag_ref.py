"""Ray's ``ray.experimental.compiled_dag_ref``: the refs of a compiled graph's executions."""

from .._dag import CompiledDAGFuture, CompiledDAGRef

__all__ = ["CompiledDAGFuture", "CompiledDAGRef"]
