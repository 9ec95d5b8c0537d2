"""The layout's rules: imports inside ``qlib`` point one way (no cycle, lazy imports counted),
the engine does not import the suite's packages, and every engine implements ``Engine``."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic import write_tiny_llama

import qlib

PACKAGE = Path(qlib.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the qlib modules it imports, anywhere in its body (functions included).

    ``from pkg import mod`` counts as an import of ``pkg.mod`` only, not of ``pkg``'s
    ``__init__``, as Python resolves it.
    """
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        base = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = base.split(".")[: len(base.split(".")) - node.level + 1]
                    target = ".".join(up + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths]
                targets = subs if len(subs) == len(node.names) else [target, *subs]
            else:
                continue
            graph[mod].update(t for t in targets if t in paths and t != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50, "the graph should cover the whole package"
    found = cycles(graph)
    assert not found, "import cycles (lazy imports counted): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


LAYERS = {  # a module may import its own layer and those below it, never one above
    "qlib.cli": 5,
    "qlib.suite": 4,
    "qlib.chat": 3, "qlib.generate": 3, "qlib.convert": 3, "qlib.models": 3, "qlib.tokenizer": 3,
    "qlib.llama": 2,
    "qlib.gguf": 1,
    "qlib.quants": 0, "qlib.devices": 0, "qlib.spans": 0,
}  # fmt: skip


def layer(mod: str) -> int | None:
    best = max((k for k in LAYERS if mod == k or mod.startswith(k + ".")), key=len, default=None)
    return LAYERS.get(best) if best else None


def test_imports_point_down():
    upward = [
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        for t in targets
        if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)
    ]
    assert not upward, "imports pointing up the layers: " + ", ".join(sorted(upward))


def test_engine_does_not_import_the_suite_packages():
    """Everything but qlib.suite runs with the base dependencies (pyproject's dependencies)."""
    code = (
        "import sys, qlib.llama.engine, qlib.llama.faithful, qlib.llama.fast_cpu, qlib.generate,"
        " qlib.tokenizer, qlib.convert, qlib.models, qlib.cli;"
        " qlib.cli.build_parser();"
        " bad = sorted(m for m in ('papermill', 'pandas', 'matplotlib', 'nbconvert',"
        " 'transformers', 'accelerate', 'jupyterlab', 'gguf', 'llama_cpp') if m in sys.modules);"
        " print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the engine imported suite/reference packages: {out.stdout}"


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "m.gguf", weight_type="Q8_0")


def test_every_engine_implements_the_protocol(tiny_model_path):
    from qlib.llama import engine
    from qlib.llama.fast_cuda import CudaFastModel

    faithful, _ = engine.load(tiny_model_path, "cpu", form="f32")
    fast, _ = engine.load(tiny_model_path, "cpu", engine="fast")
    for model in (faithful, fast):
        assert isinstance(model, engine.Engine), type(model).__name__
    for cls in (type(faithful), type(fast), CudaFastModel):
        params = inspect.signature(cls.forward).parameters
        assert list(params)[:3] == ["self", "x", "index_pos"], cls.__name__
        assert params["all_logits"].kind is inspect.Parameter.KEYWORD_ONLY, cls.__name__
        assert isinstance(inspect.getattr_static(cls, "kv_len"), property), cls.__name__
        assert callable(cls.clear_kv_cache)


@pytest.mark.parametrize(
    ("engine_name", "form", "message"),
    [
        ("fast", "f32", "the fast engine keeps the weights quantized"),
        ("turbo", None, "unknown engine 'turbo'"),
        (None, "q5", "unknown form 'q5'"),
        ("faithful", "fast", "cannot go with engine 'faithful'"),
    ],
)
def test_engine_and_form_are_checked(engine_name, form, message):
    from qlib.llama.engine import resolve
    from qlib.llama.errors import ModelError

    with pytest.raises(ModelError, match=message):
        resolve(engine_name, form)


def test_form_fast_is_the_fast_engine():
    from qlib.llama.engine import resolve

    assert resolve(None, "fast") == ("fast", None)
    assert resolve(None, None) == ("faithful", None)
    assert resolve("fast", "quantized") == ("fast", "quantized")


def package_edges() -> set[tuple[str, str]]:
    """Arrows between the top-level parts of qlib (packages and the lone modules)."""

    def part(mod: str) -> str | None:
        top = mod.split(".")[1] if mod.count(".") else None
        return None if top in (None, "__main__") else top

    return {
        (part(m), part(t))
        for m, targets in import_graph().items()
        for t in targets
        if part(m) and part(t) and part(m) != part(t)
    }


def test_design_picture_matches_the_code():
    doc = (PACKAGE.parent / "docs" / "design.md").read_text()
    picture = doc.split("```mermaid", 1)[1].split("```", 1)[0]
    drawn = {
        tuple(side.strip() for side in line.split("-->"))
        for line in picture.splitlines()
        if "-->" in line
    }
    code = package_edges()
    assert not code - drawn, f"arrows in the code missing from docs/design.md: {code - drawn}"
    assert not drawn - code, f"arrows in docs/design.md the code no longer has: {drawn - code}"


def test_suite_finds_the_checkout():
    """The suite's default folders are the checkout's (a module move once broke this)."""
    from qlib.suite.catalogue import NOTEBOOKS_DIR, discover
    from qlib.suite.machine import REPO_ROOT
    from qlib.suite.results import results_dir

    assert (REPO_ROOT / "pyproject.toml").is_file()
    assert NOTEBOOKS_DIR == REPO_ROOT / "notebooks"
    assert len(discover()) >= 10
    assert results_dir().resolve().parent == REPO_ROOT
