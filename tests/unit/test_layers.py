"""The package's three layers import one way: pure torch <- verl/vLLM glue <- recipes, with no cycles."""
from __future__ import annotations

import ast
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


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules a file imports anywhere (top level or inside functions), resolved to modules."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


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
        q = quant.quantize(w, "int8", "channel")
        assert (q.data.to(torch.float32) * q.scale - w).abs().max() <= q.scale.max() / 2 + 1e-6
        assert settings.RolloutSettings().quantization_config()["ignore"][0] == "lm_head"
        print("PURE OK", sorted(m for m in sys.modules if m.split(".")[0] in ("verl", "vllm") and sys.modules[m]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "PURE OK []" in p.stdout, p.stderr[-3000:]
