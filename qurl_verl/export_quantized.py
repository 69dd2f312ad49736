"""Write the W8A8 checkpoint the rollout ran: ``python -m qurl_verl.export_quantized --model IN --out OUT``.

Reads a trained HF checkpoint's safetensors files directly (no model instantiation, no hub
access) and quantizes its targeted linears with the weight stream's own code path:
``quantize_state_dict`` with ``RolloutSettings.ignore_patterns`` (lm_head and embeddings stay in
full precision), in ``RolloutSettings.quant_scheme`` (``weight_bits`` included). config.json gets
``quantization_config = RolloutSettings.quantization_config()``, the config the rollout engine
is built with, so vLLM loads exactly the codes and scales a qurl sync of the same weights puts
into a live engine. Every other tensor keeps its dtype and shard; every other file (tokenizer,
chat template, generation config) is copied unchanged.

A checkpoint that carries UAQ (the ``qurl_uaq`` config record) is exported as it is: UAQ is an
exact re-parametrisation of the same function (RMSNorm x s, the projections after it / s), and the
rollout quantized these scaled weights, so exporting them is deploying what was trained against.

Refused before any tensor is read: a non-empty output folder, a format other than int8, fp8 or
fp8_block, a model the rollout does not quantize (``settings.SUPPORTED_ARCHITECTURES``), a
checkpoint that is already quantized. Shards are processed one at a time (a weight and its scale
share a shard), and the result is written to a temporary sibling folder renamed when complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from qurl_verl.model_info import moe_experts
from qurl_verl.quant.compressed_tensors_format import experts_ignored, quantize_state_dict
from qurl_verl.quant.uaq_convert import INDEX_FILE, weight_files
from qurl_verl.rollout.engine_checks import check_architecture
from qurl_verl.settings import RolloutSettings

EXPORT_FORMATS = ("int8", "fp8", "fp8_block")


def export_quantized_checkpoint(model_dir: str | Path, out_dir: str | Path, format: str = "int8",
                                ignore: Iterable[str] = (), weight_bits: int = 8, experts: str = "bf16") -> dict:
    """Write ``model_dir`` quantized as the rollout quantizes it to ``out_dir``; returns the ``quantization_config``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not a HF checkpoint folder (no config.json)")
    if out_dir.exists() and (out_dir.resolve() == model_dir.resolve() or any(out_dir.iterdir())):
        raise ValueError(f"refusing to write into {out_dir}: it is the input folder or not empty")
    if str(format).lower() not in EXPORT_FORMATS:
        raise ValueError(f"format={format!r}: export writes one of {', '.join(EXPORT_FORMATS)}")
    settings = RolloutSettings(format=format, ignore=tuple([ignore] if isinstance(ignore, str) else ignore),
                               weight_bits=weight_bits, experts=experts)
    config = json.loads((model_dir / "config.json").read_text())
    check_architecture(config.get("architectures"), str(model_dir))
    moe = moe_experts(config)
    if moe is not None:  # vLLM decides a layer's experts from expert 0: a split list would not load
        for i in range(int(config.get("num_hidden_layers") or 0)):
            experts_ignored(f"model.layers.{i}.mlp.experts", moe[0], settings.ignore_patterns)
    if config.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized (config.json has a quantization_config)")
    files, index = weight_files(model_dir)

    quant_config = settings.quantization_config()
    scheme, patterns = settings.quant_scheme, settings.ignore_patterns
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        weight_map, total = {}, 0
        for fname in files:
            with safe_open(str(model_dir / fname), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
                tensors = ((k, f.get_tensor(k)) for k in f.keys())
                shard = {k: v.contiguous() for k, v in quantize_state_dict(tensors, scheme, ignore=patterns)}
            save_file(shard, str(partial / fname), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, fname))
            total += sum(t.numel() * t.element_size() for t in shard.values())
        if index is not None:
            index = {**index, "metadata": {**index.get("metadata", {}), "total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (partial / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config},
                                                        indent=2, sort_keys=True) + "\n")
        written = {*files, INDEX_FILE, "config.json"}
        for item in model_dir.iterdir():
            if item.name not in written:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, partial / item.name)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above
        os.replace(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return quant_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qurl_verl.export_quantized",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="input HF checkpoint folder (safetensors)")
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--format", default="int8",
                        help=f"one of {', '.join(EXPORT_FORMATS)} (the rollout's quantization)")
    parser.add_argument("--ignore", nargs="*", default=[],
                        help="linears kept in full precision, as custom.qurl.ignore (lm_head always is)")
    parser.add_argument("--weight-bits", type=int, default=8,
                        help="int8 only: codes within +-(2^(b-1)-1), as custom.qurl.weight_bits")
    parser.add_argument("--experts", default="bf16", choices=("bf16", "quantized"),
                        help="MoE models: routed experts in full precision or quantized, as custom.qurl.experts")
    args = parser.parse_args(argv)
    try:
        config = export_quantized_checkpoint(args.model, args.out, args.format, args.ignore, args.weight_bits,
                                             args.experts)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.out} ({args.format}, ignore={config['ignore']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
