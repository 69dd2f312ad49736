"""Apply UAQ to a HF checkpoint folder on disk: ``python -m qurl_verl.quant.uaq_convert --model IN --out OUT``.

Works on the safetensors files directly (no model instantiation, no hub access), keeps each
tensor's dtype and the shard layout, rewrites config.json with the UAQ record and copies every
other file (tokenizer, chat template, generation config) unchanged. Refuses a checkpoint that
already carries UAQ. Memory: the whole checkpoint is held once, since a layer's norm and its
projections may sit in different shards.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from .uaq import DEFAULT_UAQ_SCALE, DEFAULT_UAQ_TARGETS, apply_uaq_to_state_dict, check_uaq_model_type

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> tuple[list[str], dict | None]:
    """The checkpoint's safetensors shard names, and its shard index (None for a single file)."""
    if (model_dir / INDEX_FILE).exists():
        index = json.loads((model_dir / INDEX_FILE).read_text())
        return sorted(set(index["weight_map"].values())), index
    if (model_dir / SINGLE_FILE).exists():
        return [SINGLE_FILE], None
    raise ValueError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are supported")


def _size_and_time(num_bytes: int, seconds: float) -> str:
    size = f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"
    return f"({size}) in {seconds:.0f} s" if seconds >= 10 else f"({size}) in {seconds:.1f} s"


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path, scale: float = DEFAULT_UAQ_SCALE,
                       targets=DEFAULT_UAQ_TARGETS, progress: Callable[[str], None] | None = None) -> dict:
    """Write the UAQ-folded checkpoint to ``out_dir``; returns the UAQ record stored in its config.

    ``progress`` gets one line per shard read and per shard written (a 7B-32B checkpoint takes minutes),
    e.g. ``read shard 3/8 (4.1 GB) in 12 s``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not a HF checkpoint folder (no config.json)")
    if out_dir.exists() and (out_dir.resolve() == model_dir.resolve() or any(out_dir.iterdir())):
        raise ValueError(f"refusing to write into {out_dir}: it is the input folder or not empty")
    config = json.loads((model_dir / "config.json").read_text())
    targets = list(targets)  # read twice below
    # before a single tensor of a (possibly 60 GB) checkpoint is read
    check_uaq_model_type(config.get("model_type"), targets)
    files, _ = weight_files(model_dir)
    report = progress or (lambda line: None)
    state_dict, file_of, metadata = {}, {}, {}
    for n, fname in enumerate(files, 1):
        t0 = time.perf_counter()
        with safe_open(str(model_dir / fname), framework="pt") as f:
            metadata[fname] = f.metadata()
            for key in f.keys():
                state_dict[key] = f.get_tensor(key)
                file_of[key] = fname
        size = (model_dir / fname).stat().st_size
        report(f"read shard {n}/{len(files)} {_size_and_time(size, time.perf_counter() - t0)}")
    folded, new_config = apply_uaq_to_state_dict(state_dict, config, scale, targets)

    out_dir.mkdir(parents=True, exist_ok=True)
    for n, fname in enumerate(files, 1):
        t0 = time.perf_counter()
        shard = {k: v.contiguous() for k, v in folded.items() if file_of[k] == fname}
        save_file(shard, str(out_dir / fname), metadata=metadata[fname] or {"format": "pt"})
        size = (out_dir / fname).stat().st_size
        report(f"wrote shard {n}/{len(files)} {_size_and_time(size, time.perf_counter() - t0)}")
    (out_dir / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    written = set(files) | {"config.json"}
    for item in model_dir.iterdir():
        if item.name in written:
            continue
        if item.is_dir():
            shutil.copytree(item, out_dir / item.name)
        else:
            shutil.copy2(item, out_dir / item.name)
    return new_config["qurl_uaq"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qurl_verl.quant.uaq_convert", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="input HF checkpoint folder (safetensors)")
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--scale", type=float, default=DEFAULT_UAQ_SCALE,
                        help=f"UAQ scale s (default, the paper's: {DEFAULT_UAQ_SCALE:g})")
    parser.add_argument("--targets", default=",".join(DEFAULT_UAQ_TARGETS),
                        help="comma-separated linears to scale: q_proj,k_proj,v_proj and/or gate_proj,up_proj "
                             "(q_proj,k_proj,v_proj only on MoE models)")
    args = parser.parse_args(argv)
    try:
        record = convert_checkpoint(args.model, args.out, args.scale, [t for t in args.targets.split(",") if t],
                                    progress=lambda line: print(f"UAQ: {line}", flush=True))
    except ValueError as err:
        parser.error(str(err))
    print(f"UAQ applied ({record}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
