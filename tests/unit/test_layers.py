"""The package's three layers import one way: pure torch <- verl/vLLM glue <- recipes, with no cycles."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qurl_verl"
PURE = ("qurl_verl.quant", "qurl_verl.losses.acr")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


# A string naming a project module, as ``importlib.import_module`` or a Hydra ``_target_`` takes it
# ("qurl_verl.losses.config.QurlPolicyLossConfig", "module:qualname"); prose (a docstring) never matches.
DOTTED = re.compile(r"(qurl_verl|qurl_recipes)(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_.]*)?")


def imports_in(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Project modules a source imports anywhere (top level or inside functions), resolved to modules: import
    statements, relative ones included, and strings that name a module (``importlib.import_module("...")``,
    a dotted ``_target_``)."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            names = [node.value.partition(":")[0]]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", known)


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) | {"qurl_recipes"}
    return {m: imports_of(p, known) - {m} for m, p in mods.items()}


def is_pure(m: str) -> bool:
    return any(m == p or m.startswith(p + ".") for p in PURE)


def test_the_graph_sees_known_edges():
    """Guards the tests below: the walk finds imports inside functions and relative ones."""
    graph = import_graph()
    assert "qurl_verl.settings" in graph["qurl_verl.driver"]
    assert "qurl_verl.uaq_checkpoint" in graph["qurl_verl.driver.prepare"]  # imported inside a function
    assert "qurl_verl.settings.keys" in graph["qurl_verl.settings.rollout"]  # relative, inside the package
    assert "qurl_verl.quant.quantizer" in graph["qurl_verl.quant.compressed_tensors_format"]  # relative
    assert "qurl_verl.settings.loss_config" in graph["qurl_verl.settings.loss_requirements"]  # named by a string


def test_the_graph_sees_imports_named_by_strings():
    """An import written as a string is an edge: ``importlib.import_module("...")``, a ``_target_`` naming a class,
    a ``module:qualname`` target; prose that mentions a module is not."""
    known = {"qurl_verl", "qurl_verl.losses", "qurl_verl.losses.config", "qurl_verl.rollout", "qurl_verl.rollout.server"}
    source = textwrap.dedent('''
        """Docstring naming qurl_verl.rollout.server in prose."""
        import importlib
        TARGET = "qurl_verl.losses.config.QurlPolicyLossConfig"
        def f():
            return importlib.import_module("qurl_verl.rollout")
        PATCHED = "qurl_verl.rollout.server:QurlServer.start"
    ''')
    assert imports_in(source, "qurl_verl.settings.loss", False, known) == {
        "qurl_verl.losses.config", "qurl_verl.rollout", "qurl_verl.rollout.server"}
    assert imports_in('"""About qurl_verl.rollout.server."""\n', "qurl_verl.x", False, known) == set()


def unit_of(module: str) -> str:
    """The part of the package a module belongs to: its subpackage (``qurl_verl.rollout``) or, for a module at the
    top (``qurl_verl.model_info``), itself."""
    return ".".join(module.split(".")[:2])


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_the_packages_parts():
    """Subpackages and top-level modules import one way: no two parts of ``qurl_verl`` (``settings`` and
    ``losses``, ``platform`` and ``rollout``, ``driver`` and ``patches``) may reach each other, whatever module
    of each carries the edges. The root package is left out: Python imports it before any of its parts."""
    graph = import_graph()
    units: dict[str, set[str]] = {}
    edges: dict[tuple[str, str], list[str]] = {}
    for m, deps in graph.items():
        if m == "qurl_verl" or not m.startswith("qurl_verl."):
            continue
        for d in deps:
            if d == "qurl_verl" or not d.startswith("qurl_verl.") or unit_of(d) == unit_of(m):
                continue
            units.setdefault(unit_of(m), set()).add(unit_of(d))
            edges.setdefault((unit_of(m), unit_of(d)), []).append(f"{m} -> {d}")
    cycles = strongly_connected(units)
    detail = [f"cycle {' <-> '.join(c)}:\n" + "\n".join(
        f"  {a} -> {b}: {', '.join(sorted(es))}" for (a, b), es in sorted(edges.items()) if a in c and b in c)
        for c in cycles]
    assert not cycles, "\n".join(detail)


def test_pure_layer_imports_only_itself():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if not is_pure(d)) for m, deps in graph.items() if is_pure(m)}
    assert all(not v for v in bad.values()), bad


def test_product_never_imports_the_recipes_package():
    graph = import_graph()
    assert not [m for m, deps in graph.items() if "qurl_recipes" in deps]


def test_settings_is_a_leaf_of_the_glue():
    graph = import_graph()
    package = [m for m in graph if m == "qurl_verl.settings" or m.startswith("qurl_verl.settings.")]
    assert len(package) > 1, package
    bad = {m: sorted(d for d in graph[m] if not is_pure(d) and d.split(".")[:2] != ["qurl_verl", "settings"])
           for m in package}
    assert all(not v for v in bad.values()), bad


def test_the_version_policy_is_a_leaf_every_reader_imports():
    """``qurl_verl.versions`` imports nothing of the project; the driver, the server's gate, the patches and the host
    probe read the version facts from it."""
    graph = import_graph()
    assert not graph["qurl_verl.versions"], graph["qurl_verl.versions"]
    readers = ("qurl_verl.rollout.features.lora_adapters", "qurl_verl.rollout.engine_checks", "qurl_verl.patches.contract",
               "qurl_verl.platform.host")
    assert all("qurl_verl.versions" in graph[m] for m in readers), {m: sorted(graph[m]) for m in readers}


def test_patches_import_nothing_from_the_rollout_backend():
    """``rollout/`` applies patches; a patch that imported ``rollout/`` back would tie the two layers into one."""
    graph = import_graph()
    patches = [m for m in graph if m.startswith("qurl_verl.patches.")]
    assert len(patches) > 10, patches
    bad = {m: sorted(d for d in graph[m] if d.startswith("qurl_verl.rollout")) for m in patches}
    assert all(not v for v in bad.values()), bad
    assert any(d.startswith("qurl_verl.patches") for d in graph["qurl_verl.rollout.worker_extension"])


def test_no_import_cycle_among_product_modules():
    graph = import_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d.startswith("qurl_verl") and m.startswith(d + "."):
                continue  # a submodule's own parent package is imported first by Python, not a design edge
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif state.get(d) is None:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_pure_layer_runs_with_verl_and_vllm_blocked():
    code = textwrap.dedent("""
        import sys
        sys.modules["verl"] = None
        sys.modules["vllm"] = None
        import torch
        import qurl_verl.losses.acr as acr
        from qurl_verl import quant, settings
        w = torch.randn(16, 32)
        q = quant.quantize(w, quant.INT8_CHANNEL)
        assert (q.data.to(torch.float32) * q.scale - w).abs().max() <= q.scale.max() / 2 + 1e-6
        assert settings.RolloutSettings().quantization_config()["ignore"][0] == "lm_head"
        print("PURE OK", sorted(m for m in sys.modules if m.split(".")[0] in ("verl", "vllm") and sys.modules[m]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "PURE OK []" in p.stdout, p.stderr[-3000:]
