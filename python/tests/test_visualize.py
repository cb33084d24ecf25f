"""``CompiledDAG.visualize``: Ray's behaviour (Graphviz writes ``filename`` and
``filename.format``, the DOT source is returned), the error that says what to install when
Graphviz is missing, the text picture, and nodes named by the program's classes and methods."""

import importlib
import os
import shutil
import sys

import pytest

import adag
from adag import InputNode, MultiOutputNode
from adag.collective import allreduce
from actors import Echo

EchoActor = adag.remote(Echo)

PNG = b"\x89PNG\r\n\x1a\n"


def _have_graphviz():
    try:
        importlib.import_module("graphviz")
    except ImportError:
        return False
    return shutil.which("dot") is not None


@pytest.fixture(scope="module")
def compiled():
    a, b = EchoActor.remote(), EchoActor.remote()
    with InputNode() as inp:
        first = a.echo.bind(inp[0])
        dag = MultiOutputNode([b.add.bind(first, inp.y).with_tensor_transport(), first])
    graph = dag.experimental_compile()
    assert adag.get(graph.execute(1, y=2)) == [3, 1]
    yield graph
    graph.teardown()


def test_writes_the_picture_or_says_what_to_install(compiled, tmp_path):
    """With Graphviz (CI installs it): the DOT source and a PNG are written and the source is
    returned. Without it: the error names what to install, and nothing is drawn."""
    target = tmp_path / "graph"
    if _have_graphviz():
        dot = compiled.visualize(filename=str(target))
        assert (tmp_path / "graph.png").read_bytes()[:8] == PNG
        assert (tmp_path / "graph").read_text() == dot
        assert dot.startswith("digraph") and "Echo.add()" in dot
        svg = compiled.visualize(filename=str(target), format="svg")
        assert svg == dot
        assert b"<svg" in (tmp_path / "graph.svg").read_bytes()
    else:
        with pytest.raises((ImportError, RuntimeError)) as e:
            compiled.visualize(filename=str(target))
        assert "pip install graphviz" in str(e.value) or "apt-get install graphviz" in str(e.value)
        assert not (tmp_path / "graph.png").exists()


def test_no_dot_program_says_what_to_install(compiled, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises((ImportError, RuntimeError)) as e:
        compiled.visualize(filename=str(tmp_path / "graph"))
    message = str(e.value)
    assert "apt-get install graphviz" in message, message
    assert "format='ascii'" in message, message
    try:
        import graphviz
    except ImportError:
        assert isinstance(e.value, ImportError)
    else:
        # graphviz's own class, so that code written for Ray catches it.
        assert isinstance(e.value, graphviz.ExecutableNotFound)
        assert "`dot` program was not found on PATH" in message, message
    assert not (tmp_path / "graph.png").exists()


def test_no_graphviz_package_says_what_to_install(compiled, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)  # `import graphviz` raises ImportError
    with pytest.raises(ImportError) as e:
        compiled.visualize(filename=str(tmp_path / "graph"))
    message = str(e.value)
    assert message.startswith("Please install graphviz to visualize the compiled graph")
    assert "pip install graphviz" in message and "apt-get install graphviz" in message, message
    assert not os.listdir(tmp_path)


def test_ascii_needs_no_graphviz(compiled, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    text = compiled.visualize(format="ascii")
    assert not os.listdir(tmp_path)
    lines = text.splitlines()
    assert lines[0].endswith(": 4 nodes, 2 actors"), lines[0]
    # The input parts as the program spells them; each node with where its value goes.
    assert any(line.startswith("[inp[0]]") for line in lines), text
    assert any(line.startswith("[inp.y]") for line in lines), text
    assert "Echo.echo()" in text and "Echo.add()" in text
    assert "──> output 0" in text and "──> output 1" in text
    assert "read inp[0]" in text  # the schedules
    assert "_native" not in text and "PyValue" not in text
    with pytest.raises(ValueError, match="not compatible with 'ascii'"):
        compiled.visualize(format="ascii", channel_details=True)


def test_dot_names_the_programs_classes_and_methods(compiled, monkeypatch):
    """What goes to Graphviz, whether or not it is installed here."""
    from adag import _visualize

    drawn = []
    monkeypatch.setattr(_visualize, "render", lambda *args: drawn.append(args))
    dot = compiled.visualize(filename="g", format="pdf", view=False)
    assert drawn == [(dot, "g", "pdf", False)]
    assert "_native::value::PyValue" not in dot and "PyInput" not in dot and "part0" not in dot
    assert "Echo#" in dot and ".echo#" in dot and ".add#" in dot
    assert "Echo.echo()" in dot and "Echo.add()" in dot
    assert "TorchTensorType(transport='auto'" in dot  # the type hint of the annotated node
    assert '"inp[0]\\ninput of execute()"' in dot and '"inp.y\\ninput of execute()"' in dot
    assert "schedule of Echo#" in dot and "read inp[0]" in dot
    assert "shared memory" not in dot  # channel details only when asked
    detailed = compiled.visualize(channel_details=True)
    assert "shared memory" in detailed and "output 0 (" in detailed
    assert "pid " in detailed


def test_steps_of_adag_are_named_by_what_the_program_bound(tmp_path, monkeypatch):
    from adag import _visualize

    monkeypatch.setattr(_visualize, "render", lambda *args: None)
    a, b = EchoActor.remote(), EchoActor.remote()
    with InputNode() as inp:
        summed = allreduce.bind([a.echo.bind(inp), b.echo.bind(inp)])
        dag = MultiOutputNode(summed)
    graph = dag.experimental_compile()
    try:
        assert adag.get(graph.execute(2)) == [4, 4]
        dot = graph.visualize()
        assert "allreduce.sum: collective, rank 0 of 2" in dot, dot
        assert "allreduce.sum: collective, rank 1 of 2" in dot, dot
        assert "PyValue" not in dot
    finally:
        graph.teardown()
    with pytest.raises(adag.exceptions.RayChannelError):
        graph.visualize(format="ascii")
