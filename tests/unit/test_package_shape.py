"""The package's shape as the architecture page describes it: module size, the layout table, one version."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import qurl_verl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qurl_verl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"  # its `## Layout` section holds the layout table
# Past this a module holds two concerns (DESIGN.md): split it rather than raise the number.
MAX_MODULE_LINES = 400


def layout_section() -> str:
    """The architecture page's `## Layout` section, up to the next section."""
    return ARCHITECTURE.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def layout_table() -> list[str]:
    """The paths in the first column of the layout table (``| `path` | what |`` rows)."""
    paths = []
    for line in layout_section().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first)
    return paths


def test_no_module_of_the_package_is_over_the_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sizes, "no module found"
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_every_path_in_the_layout_table_exists():
    paths = layout_table()
    assert len(paths) >= 10, paths  # the table was found and read
    missing = []
    for entry in paths:
        base = entry.split("<")[0].rstrip("/")  # `qurl_recipe/` rows name a folder beside the previous one
        if not (ROOT / base).exists() and not (PACKAGE / "hydra_configs" / base).exists():
            missing.append(entry)
    assert missing == []


def test_the_layout_table_names_every_part_of_the_package():
    """Each module and subpackage directly under qurl_verl/ has a row (a private module may be named
    inside another row's text)."""
    text = layout_section()
    parts = [p for p in PACKAGE.iterdir() if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").exists())]
    unnamed = [p.name for p in parts if f"qurl_verl/{p.name}" not in text]
    assert unnamed == []


def test_one_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["version"] and "version" not in project["project"]
    # the build reads the package's version
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qurl_verl.__version__"}
    assert importlib.metadata.version("qurl-verl") == qurl_verl.__version__


def test_the_build_is_declared_in_pyproject_alone():
    """PEP 621 metadata, built by setuptools; setup.py is a shim that passes nothing to setup(), no setup.cfg,
    and the licence it names is there."""
    assert not (ROOT / "setup.cfg").exists()
    shim = ast.parse((ROOT / "setup.py").read_text())
    calls = [n for n in ast.walk(shim) if isinstance(n, ast.Call)]
    assert [(c.func.id, c.args, c.keywords) for c in calls] == [("setup", [], [])]
    assert any(isinstance(n, ast.ImportFrom) and n.module == "setuptools" for n in shim.body)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert project["project"]["entry-points"]["verl.plugins"] == {"qurl": "qurl_verl._verl_plugin"}


def test_setup_py_reports_pyproject_name_and_version():
    """What `python setup.py --name --version` prints, for tools that still ask it, is pyproject's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    done = subprocess.run([sys.executable, "setup.py", "--name", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [project["name"], qurl_verl.__version__]
