"""The model a run trains, as its ``config.json`` describes it, read once, and the layouts qurl-verl knows.

The checks need the architecture, the head size, the MoE shape, the largest streamed tensor and the
share of linear weights in 8 bits. All of it comes from ``config.json``: a local folder's, or for a
hub id that file fetched alone (from the cache only in a dry run), so that a model qurl-verl
refuses is refused before any weight is downloaded.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qurl_verl.quant.compressed_tensors_format import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, is_ignored
from qurl_verl.quant.uaq import CONFIG_KEY as UAQ_CONFIG_KEY
from qurl_verl.quant.uaq import MOE_MODEL_TYPES
from qurl_verl.settings import MODEL_PATH_KEY, QurlConfigError, dry_run

if TYPE_CHECKING:
    from qurl_verl.settings import RolloutSettings

# Dense decoders whose linear layers are the seven *_proj projections the weight stream quantizes
# and that vLLM fuses as qkv_proj / gate_up_proj. The CPU tests exercise Qwen2.
DENSE_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# The same attention, and an MoE block: a router (mlp.gate; Qwen2-MoE adds a shared expert and its
# gate) and routed experts named mlp.experts.<e>.{gate,up,down}_proj. The CPU tests exercise Qwen3-MoE.
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_MLA = ("its attention is MLA (low-rank q/kv projections with norms between them, no q/k/v linears fed by "
        "input_layernorm), a layout neither the weight stream nor UAQ knows")
REFUSED_ARCHITECTURES = {
    "MixtralForCausalLM": "its experts are block_sparse_moe.experts.<e>.w1/w2/w3 and its router block_sparse_moe.gate, "
                          "names the weight stream does not map",
    "DeepseekV2ForCausalLM": _MLA,
    "DeepseekV3ForCausalLM": _MLA,
}
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "16": 2}


# ---------------------------------------------------------------------------------- where config.json is
def hub_id(model_path: Any) -> str | None:
    """``model_path`` when it names a hub repository (``org/name``, not a local path or URL), else None."""
    text = str(model_path or "")
    p = Path(os.path.expanduser(text))
    if not text or "://" in text or p.exists() or p.is_absolute() or text.startswith(".") or text.count("/") != 1:
        return None
    return text


def hub_id_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)


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


def hf_config_of(model_path: Any) -> dict | None:
    """The model's ``config.json``: read from a local folder, or for a hub id fetched alone (one small
    file, from the cache with ``HF_HUB_OFFLINE=1``). None for a URL or a folder without one."""
    if not model_path:
        return None
    repo = hub_id(model_path)
    if repo is None:
        cfg_file = Path(os.path.expanduser(str(model_path))) / "config.json"
        return json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
    found = fetch_hub_config(repo)
    return json.loads(Path(found).read_text()) if found else None


# ---------------------------------------------------------------------------------- shape arithmetic
def text_config(hf_config: Mapping) -> Mapping:
    """The language model's part of a config (``text_config`` of a multimodal one)."""
    return hf_config.get("text_config", hf_config)


def head_dim(hf_config: Mapping) -> int | None:
    """``head_dim``, else ``hidden_size / num_attention_heads``; None when neither is given."""
    hf = text_config(hf_config)
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def moe_experts(hf_config: Mapping | None) -> tuple[int, int] | None:
    """(routed experts per layer, experts per token) of a supported MoE ``config.json``; None for a dense model."""
    hf = text_config(hf_config or {})
    archs = hf.get("architectures") or (hf_config or {}).get("architectures") or []
    if hf.get("model_type") not in MOE_MODEL_TYPES and not any(a in MOE_ARCHITECTURES for a in archs):
        return None
    # config.json names the count num_experts (as published) or num_local_experts (transformers >= 5 writes it)
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0), int(hf.get("num_experts_per_tok") or 0)


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a verl precision name; 4 (fp32, the default) for anything else."""
    return _DTYPE_BYTES.get(str(dtype).lower(), 4)


def largest_weight(hf_config: Mapping, element_bytes: int) -> tuple[str, int]:
    """(what, bytes) of the largest tensor the trainer streams for a dense decoder's HF ``config.json``."""
    hf = text_config(hf_config)
    hidden = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 0)
    dim = head_dim(hf) or 0
    candidates = {
        "embed_tokens / lm_head (vocab_size x hidden_size)": int(hf.get("vocab_size") or 0) * hidden,
        "MLP projection (intermediate_size x hidden_size)": int(hf.get("intermediate_size") or 0) * hidden,
        "q_proj (num_attention_heads * head_dim x hidden_size)": heads * dim * hidden,
    }
    what = max(candidates, key=candidates.get)
    return what, candidates[what] * element_bytes


def decoder_linears(hf: Mapping) -> list[tuple[str, int, float]]:
    """(HF module name, weights, weights read per token) of every linear layer of a supported decoder."""
    hidden, layers = int(hf.get("hidden_size") or 0), int(hf.get("num_hidden_layers") or 0)
    heads, kv_heads = int(hf.get("num_attention_heads") or 0), int(hf.get("num_key_value_heads") or hf.get("num_attention_heads") or 0)
    dim = head_dim(hf) or 0
    experts = moe_experts(hf)
    out = [("lm_head", int(hf.get("vocab_size") or 0) * hidden, int(hf.get("vocab_size") or 0) * hidden)]
    mlp_only = set(hf.get("mlp_only_layers") or ())
    sparse_step = int(hf.get("decoder_sparse_step") or 1)
    attention_heads = dict(zip(ATTENTION_PROJECTIONS, (heads, kv_heads, kv_heads, heads)))  # q, k, v, o
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for proj, n in attention_heads.items():
            out.append((f"{prefix}.self_attn.{proj}", hidden * n * dim, hidden * n * dim))
        if experts is None or i in mlp_only or (i + 1) % sparse_step:
            inter = int(hf.get("intermediate_size") or 0)
            out += [(f"{prefix}.mlp.{p}", hidden * inter, hidden * inter) for p in MLP_PROJECTIONS]
            continue
        count, per_token = experts
        inter = int(hf.get("moe_intermediate_size") or 0)
        out.append((f"{prefix}.mlp.gate", hidden * count, hidden * count))
        out += [(f"{prefix}.mlp.experts.0.{p}", count * hidden * inter, per_token * hidden * inter) for p in MLP_PROJECTIONS]
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared:
            out += [(f"{prefix}.mlp.shared_expert.{p}", hidden * shared, hidden * shared) for p in MLP_PROJECTIONS]
            out.append((f"{prefix}.mlp.shared_expert_gate", hidden, hidden))
    return out


def quantized_share(hf_config: Mapping, settings: RolloutSettings) -> dict[str, float]:
    """What the rollout runs in 8 bits, from a dense or MoE ``config.json``: the share of the linear
    layers' weights (``weights``) and of the linear FLOPs one token costs (``active_flops``: each
    token reads the attention, the router and ``num_experts_per_tok`` experts of an MoE layer). All
    experts of a layer share one verdict (``compressed_tensors_format.experts_ignored``)."""
    linears = decoder_linears(text_config(hf_config))
    patterns = settings.ignore_patterns
    eight_bit = [settings.quantized and not is_ignored(name, patterns) for name, _, _ in linears]
    total_w, total_f = sum(w for _, w, _ in linears), sum(f for _, _, f in linears)
    return {
        "weights": sum(w for (_, w, _), q in zip(linears, eight_bit) if q) / total_w if total_w else 0.0,
        "active_flops": sum(f for (_, _, f), q in zip(linears, eight_bit) if q) / total_f if total_f else 0.0,
    }


# ---------------------------------------------------------------------------------- one run's model
class ModelInfo:
    """The model at ``path``: its ``config.json`` read on first use and kept (None where it cannot be
    read here: a URL, a folder without one), and what the checks ask of it."""

    def __init__(self, path: Any, config: Mapping | None = None):
        self.path = path
        if config is not None:
            self.__dict__["config"] = dict(config)

    @classmethod
    def of_config(cls, config: Mapping, path: Any = None) -> ModelInfo:
        """A model known by its config alone (an engine's ``hf_config``, a test's dict)."""
        return cls(path, config)

    @functools.cached_property
    def config(self) -> dict | None:
        return hf_config_of(self.path)

    @property
    def is_local(self) -> bool:
        """A folder on this machine (not a hub id or URL)."""
        return bool(self.path) and Path(os.path.expanduser(str(self.path))).exists()

    @property
    def text(self) -> Mapping:
        return text_config(self.config or {})

    @property
    def architectures(self) -> list[str] | None:
        """``architectures``; None when the config cannot be read here."""
        return None if self.config is None else self.config.get("architectures") or []

    @property
    def head_dim(self) -> int | None:
        return None if self.config is None else head_dim(self.config)

    @property
    def moe_experts(self) -> tuple[int, int] | None:
        return None if self.config is None else moe_experts(self.config)

    @property
    def uses_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the cache holds a compressed latent, not K and V."""
        return self.text.get("kv_lora_rank") is not None

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text.get("num_hidden_layers") or 0)

    @property
    def uaq_record(self) -> dict | None:
        """The UAQ a converted checkpoint carries (``qurl_uaq`` in its config)."""
        return None if self.config is None else self.config.get(UAQ_CONFIG_KEY)

    def largest_weight(self, element_bytes: int) -> tuple[str, int] | None:
        return None if self.config is None else largest_weight(self.config, element_bytes)

    def quantized_share(self, settings: RolloutSettings) -> dict[str, float] | None:
        return None if self.config is None else quantized_share(self.config, settings)
