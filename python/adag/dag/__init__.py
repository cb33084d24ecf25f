"""Ray's ``ray.dag``: the nodes of a graph and the context of compiled graphs, at Ray's
import paths (``from adag.dag import InputNode, MultiOutputNode``). The same objects as
:mod:`adag`'s."""

from .._context import DAGContext
from .._dag import (
    ClassMethodNode,
    CompiledDAG,
    DAGNode,
    FunctionNode,
    InputAttributeNode,
    InputNode,
    MultiOutputNode,
)
from . import class_node, compiled_dag_node, context, dag_node, input_node, output_node

__all__ = [
    "ClassMethodNode",
    "CompiledDAG",
    "DAGContext",
    "DAGNode",
    "FunctionNode",
    "InputAttributeNode",
    "InputNode",
    "MultiOutputNode",
    "class_node",
    "compiled_dag_node",
    "context",
    "dag_node",
    "input_node",
    "output_node",
]
