"""The Ray-style programs of ``examples/python`` run, and differ from Ray programs in their
import lines only."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")
PROGRAMS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))


def test_there_are_examples():
    assert {
        "quickstart.py",
        "pipeline_parallel.py",
        "asyncio_server.py",
        "vllm_executor.py",
        "nemo_rl_training.py",
        "visualize.py",
        "troubleshooting.py",
        "profiling.py",
    } <= set(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_only_import_lines_name_adag(program):
    """Outside the module's docstring and comments, "adag" (in any case: ``ADAG_...``
    variables too) is named by import lines only, each of them the one a Ray program has with
    ``ray`` in its place."""
    with open(os.path.join(EXAMPLES, program)) as f:
        code = f.read()
    body = code.split('"""', 2)[2] if code.startswith('"""') else code
    imports = 0
    for line in body.splitlines():
        if "adag" in line.split("#")[0].lower():
            assert re.match(r"^(import adag as ray|from adag[.\w]* import )", line), line
            imports += 1
    assert imports, f"{program} imports nothing of adag"


def _run(program, *args, env=None, timeout=180):
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, program), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{program[:-3]}: ok" in out.stdout, out.stdout
    return out


@pytest.mark.parametrize("program", PROGRAMS)
def test_example_runs(program):
    _run(program)


def test_profiling_warns_and_writes_the_timeline(tmp_path):
    env = dict(os.environ, ADAG_TIMELINE=str(tmp_path / "at-teardown.json"))
    written = tmp_path / "timeline.json"
    out = _run("profiling.py", str(written), env=env)
    assert "RAY_CGRAPH_ENABLE_TORCH_PROFILING is set" in out.stdout, out.stdout
    assert f"written to {written}" in out.stdout, out.stdout
    for path in (written, tmp_path / "at-teardown.json"):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        assert sum(e.get("cat") == "compute" for e in events) == 60, path
    # Without the timeline on, nothing is recorded and nothing written.
    env.pop("ADAG_TIMELINE")
    out = _run("profiling.py", str(tmp_path / "none.json"), env=env)
    assert "no timeline recorded" in out.stdout, out.stdout
    assert not (tmp_path / "none.json").exists()


def test_visualize_writes_a_png_or_says_what_to_install(tmp_path):
    out = _run("visualize.py", str(tmp_path))
    assert "[Worker#" in out.stdout and "Worker.combine()" in out.stdout, out.stdout
    try:
        importlib.import_module("graphviz")
        have_graphviz = shutil.which("dot") is not None
    except ImportError:
        have_graphviz = False
    png = tmp_path / "compiled_graph.png"
    if have_graphviz:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "digraph" in (tmp_path / "compiled_graph").read_text()
    else:
        assert "no picture:" in out.stdout and "install graphviz" in out.stdout, out.stdout
        assert not png.exists()


def test_visualize_without_dot_says_what_to_install(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path / "no-programs-here"))
    out = _run("visualize.py", str(tmp_path), env=env)
    assert "no picture:" in out.stdout, out.stdout
    assert "apt-get install graphviz" in out.stdout, out.stdout
    assert "[Worker#" in out.stdout, out.stdout  # the text picture needs no Graphviz
    assert not (tmp_path / "compiled_graph.png").exists()
