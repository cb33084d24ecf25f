"""``CompiledDAG.visualize``: the compiled graph as Graphviz DOT named by the program's own
classes and methods, rendered to a file by Graphviz (as Ray does), or drawn as text.

The native picture (``src/exec/viz.rs``) names each node as adag does (``Worker#1.forward#6``)
and gives its Rust type, which for Python values is always the same; here each node's second
line says what the Python program bound (``Worker.forward()``, ``inp[0]``, the value ``i`` of
a method with ``num_returns``, a collective) and its type hint, and the input parts are named
as the program spells them.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: Where to get Graphviz's `dot` program.
_DOT = (
    "Debian/Ubuntu: `apt-get install graphviz`; Fedora: `dnf install graphviz`; macOS: "
    "`brew install graphviz`; conda: `conda install graphviz`"
)
_ASCII = "visualize(format='ascii') draws the graph as text without Graphviz."
NO_PACKAGE = (
    "Please install graphviz to visualize the compiled graph: its Python package "
    f"(`pip install graphviz`) and Graphviz's `dot` program, which the package runs ({_DOT}). "
    + _ASCII
)
NO_DOT = (
    "Graphviz's `dot` program was not found on PATH: the graphviz Python package runs it to "
    f"draw the picture. Install it ({_DOT}) or add its directory to PATH. " + _ASCII
)

_NODE = re.compile(r'^  n(\d+) \[label="((?:[^"\\]|\\.)*)", shape=(\w+)\];$')
_EDGE = re.compile(r'^  (n\d+|driver_out) -> (n\d+|driver_out) \[label="((?:[^"\\]|\\.)*)"\];$')
_NOTE = re.compile(r'^  schedule_(\d+) \[shape=note, label="((?:[^"\\]|\\.)*)"\];$')
_PART = re.compile(r"input\.part(\d+)\b")
_OUTPUT = re.compile(r"^output (\d+)(?: \((.*)\))?$")


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _unesc(s: str) -> str:
    return re.sub(r"\\(.)", r"\1", s)


def _part_text(part: Any) -> str:
    """How the program spells an input part: ``inp``, ``inp[0]``, ``inp.key``."""
    kind = getattr(part, "_kind", None)
    if kind is None:
        return "inp"
    what = part._what
    if kind == "index":
        return f"inp[{what}]"
    return f"inp.{what}" if what.isidentifier() else f"inp[{what!r}]"


def _node_text(node: Any) -> List[str]:
    """What the program bound at ``node`` (a method node), and its type hint."""
    from ._dag import STEP_PREFIX

    cls = getattr(node._actor, "_class_name", type(node._actor).__name__)
    method = node._method
    if not method.startswith(STEP_PREFIX):
        lines = [f"{cls}.{method}()"]
    elif method == STEP_PREFIX + "return_value":
        source = node._args[0]
        lines = [f"value {node._kwargs['index']} of {cls}.{source._method}()"]
    elif getattr(node, "_collective", None) is not None:
        rank, members = node._collective[2], node._collective[3]
        lines = [f"{node._label}: collective, rank {rank} of {len(members)}"]
    else:
        lines = [f"{node._label} (adag's step)"]
    hint = getattr(node, "_type_hint", None)
    if hint is not None:
        lines.append(repr(hint))
    return lines


class _Picture:
    """The native DOT, parsed: nodes, edges and each actor's schedule, renamed."""

    def __init__(self, dot: str, names: Sequence[str], nodes: Sequence[Any], parts: Sequence[Any]):
        by_name = dict(zip(names, nodes))
        part_names = [_part_text(p) for p in parts]

        def rename(text: str) -> str:
            return _PART.sub(
                lambda m: part_names[int(m.group(1))] if int(m.group(1)) < len(part_names) else m.group(0),
                text,
            )

        self.title = "graph"
        #: node id -> (shown name, lines below it, Graphviz shape)
        self.nodes: Dict[str, Tuple[str, List[str], str]] = {}
        #: (from, to, channel kind or None, output index or None)
        self.edges: List[Tuple[str, str, Optional[str], Optional[int]]] = []
        #: (actor id, actor name, steps)
        self.schedules: List[Tuple[str, str, List[str]]] = []
        for line in dot.splitlines():
            if line.startswith("digraph "):
                self.title = _unesc(line[len("digraph ") :].rstrip(" {").strip('"'))
                continue
            m = _NODE.match(line)
            if m:
                label = m.group(2)
                first = _unesc(label.split("\\n", 1)[0])
                node = by_name.get(first)
                if node is not None:
                    self.nodes["n" + m.group(1)] = (first, _node_text(node), m.group(3))
                else:
                    part = _PART.fullmatch(first)
                    below = ["input of execute()"] if part else []
                    self.nodes["n" + m.group(1)] = (rename(first), below, m.group(3))
                continue
            m = _EDGE.match(line)
            if m:
                label = _unesc(m.group(3))
                out = _OUTPUT.match(label) if m.group(2) == "driver_out" else None
                if out:
                    self.edges.append((m.group(1), m.group(2), out.group(2), int(out.group(1))))
                else:
                    self.edges.append((m.group(1), m.group(2), label, None))
                continue
            m = _NOTE.match(line)
            if m:
                rows = [_unesc(r) for r in m.group(2).split("\\l") if r]
                name = rows[0][len("schedule of ") :] if rows[0].startswith("schedule of ") else rows[0]
                self.schedules.append((m.group(1), name, [rename(r) for r in rows[1:]]))

    def dot(self, channel_details: bool, actors: Dict[str, Any]) -> str:
        out = [f'digraph "{_esc(self.title)}" {{', "  rankdir=LR;"]
        out.append('  driver_out [label="output", shape=doublecircle];')
        for nid, (name, below, shape) in self.nodes.items():
            label = "\\n".join(_esc(x) for x in [name] + below)
            out.append(f'  {nid} [label="{label}", shape={shape}];')
        for a, b, kind, index in self.edges:
            if index is not None:
                text = f"output {index}" + (f" ({kind})" if channel_details and kind else "")
                out.append(f'  {a} -> {b} [label="{_esc(text)}"];')
            elif channel_details and kind:
                out.append(f'  {a} -> {b} [label="{_esc(kind)}"];')
            else:
                out.append(f"  {a} -> {b};")
        for aid, name, steps in self.schedules:
            title = f"schedule of {name}"
            handle = actors.get(name)
            if channel_details and handle is not None:
                title += f" (node {handle._node_id}, pid {handle._pid})"
            label = "".join(_esc(r) + "\\l" for r in [title] + steps)  # \l: left-justified lines
            out.append(f'  schedule_{aid} [shape=note, label="{label}"];')
        out.append("}")
        return "\n".join(out) + "\n"

    def ascii(self) -> str:
        """A text picture: the nodes by depth (longest path from the input), each with where
        its value goes, then every actor's schedule."""
        downstream: Dict[str, List[str]] = {n: [] for n in self.nodes}
        upstream: Dict[str, List[str]] = {n: [] for n in self.nodes}
        for a, b, _, index in self.edges:
            if a not in downstream:
                continue
            downstream[a].append(f"output {index}" if index is not None else self.nodes.get(b, (b,))[0])
            if b in upstream:
                upstream[b].append(a)
        # Longest path from the input, in topological order (no recursion: graphs of
        # thousands of nodes are drawn too).
        depth: Dict[str, int] = {n: 0 for n in self.nodes}
        waiting = {n: len(upstream[n]) for n in self.nodes}
        consumers: Dict[str, List[str]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for u in upstream[n]:
                consumers[u].append(n)
        ready = [n for n, k in waiting.items() if k == 0]
        while ready:
            n = ready.pop()
            for c in consumers[n]:
                depth[c] = max(depth[c], depth[n] + 1)
                waiting[c] -= 1
                if waiting[c] == 0:
                    ready.append(c)
        rows = [f"{self.title}: {len(self.nodes)} nodes, {len(self.schedules)} actors"]
        order = sorted(self.nodes, key=lambda n: (depth[n], int(n[1:])))
        current = None
        for n in order:
            if depth[n] != current:
                current = depth[n]
                rows.append(f"-- depth {current} " + "-" * 40)
            name, below, _ = self.nodes[n]
            rows.append(f"[{name}]" + (f"  {' | '.join(below)}" if below else ""))
            targets = downstream[n]
            for i, t in enumerate(targets):
                rows.append(f"   {'└' if i == len(targets) - 1 else '├'}──> {t}")
        rows.append("-- schedules (each actor runs its steps in this order) " + "-" * 10)
        for _, name, steps in self.schedules:
            rows.append(f"{name}:")
            rows.extend(f"   {s}" for s in steps)
        return "\n".join(rows) + "\n"


def picture(native: Any, nodes: Sequence[Any], parts: Sequence[Any]) -> _Picture:
    return _Picture(native.visualize(), native.node_names(), nodes, parts)


_dot_missing: Dict[int, type] = {}


def _dot_missing_class(graphviz: Any) -> type:
    """A subclass of graphviz's ``ExecutableNotFound`` (so that what catches graphviz's
    error catches this one) whose message is ours."""
    base = graphviz.ExecutableNotFound
    cls = _dot_missing.get(id(base))
    if cls is None:

        def __init__(self: Any, message: str) -> None:
            RuntimeError.__init__(self, message)

        cls = type("DotNotFound", (base,), {"__init__": __init__, "__module__": __name__})
        _dot_missing[id(base)] = cls
    return cls


def render(source: str, filename: str, format: str, view: bool) -> None:
    """Write ``filename`` (the DOT source) and ``filename.format`` (the picture) through the
    ``graphviz`` package and its ``dot`` program, as Ray does."""
    try:
        import graphviz
    except ImportError as e:
        raise ImportError(NO_PACKAGE) from e
    try:
        graphviz.Source(source).render(filename=filename, format=format, view=view)
    except graphviz.ExecutableNotFound as e:
        raise _dot_missing_class(graphviz)(f"{NO_DOT} ({e})") from e
