"""What vLLM's DeepGEMM post-processing would do to the codes the trainer streams for ``fp8_block``.

On Hopper and Blackwell vLLM 0.24 prefers DeepGEMM block kernels, whose weight post-processing calls
``requant_weight_ue8m0_inplace`` when ``VLLM_USE_DEEP_GEMM_E8M0`` is on (its default): it dequantizes the
block-FP8 codes and re-quantizes them with power-of-two (UE8M0) block scales. The qurl server turns DeepGEMM
off for ``fp8_block`` (``qurl_verl/rollout/cuda_kernel_env.py``); this measures what that avoids, with vLLM's
own function (pure torch, the same Python as the CUDA wheel) on the project's codes:

* the share of FP8 code bytes the re-rounding changes (a new block scale re-encodes nearly every code, so this
  mostly says that the engine holds other codes than the ones the stream checksums and the tracker samples);
* the weight error against the fp32 master, ``||Q(w) - w|| / ||w||``, before and after;
* how many of the codes that one small update moves (``w + 1e-3 * std(w) * sign(N(0,1))``, a step of an Adam-like
  size) stay moved after the engine re-rounds both syncs: the update visibility that UAQ is about.

Weights: Qwen2.5-0.5B's linear shapes, drawn as Student-t (4 degrees of freedom, the heavy tails of trained
weights) scaled to std 0.02, seeded. Synthetic, so the numbers place the effect, they do not measure a model.
Writes ``bench/results/e8m0_drift.{json,md}``.

    .venv-vllm024/bin/python bench/bench_e8m0_drift.py
"""
from __future__ import annotations

import os
import platform

import bench_harness
import torch

from qurl_verl.quant import FP8_BLOCK
from qurl_verl.quant.quantizer import quantize

SHAPES = {  # Qwen2.5-0.5B, one decoder layer: [out, in]
    "q_proj": (896, 896), "k_proj": (128, 896), "o_proj": (896, 896),
    "gate_proj": (4864, 896), "down_proj": (896, 4864),
}
STEP = 1e-3  # update size, relative to the weights' std


def synthetic_weight(shape) -> torch.Tensor:
    t = torch.distributions.StudentT(4.0).sample(shape)
    return (t / t.std() * 0.02).float()


def engine_codes(q, requant) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine would hold: the streamed codes and scales, re-rounded to UE8M0 where DeepGEMM runs."""
    data, scale = q.data.clone(), q.scale.clone().float()
    requant(data, scale, (q.block_size, q.block_size))
    return data, scale


def dequantize(data, scale, block) -> torch.Tensor:
    s = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: data.shape[0], : data.shape[1]]
    return data.float() * s


def measure(name, shape, requant) -> dict:
    torch.manual_seed(sum(map(ord, name)))
    w = synthetic_weight(shape)
    update = STEP * w.std() * torch.sign(torch.randn(shape))
    q0, q1 = quantize(w, FP8_BLOCK), quantize(w + update, FP8_BLOCK)
    e0, e1 = engine_codes(q0, requant), engine_codes(q1, requant)
    b = q0.block_size
    norm = w.norm()
    moved_stream = q1.data.view(torch.uint8) != q0.data.view(torch.uint8)
    moved_engine = e1[0].view(torch.uint8) != e0[0].view(torch.uint8)
    return {
        "shape": list(shape),
        "codes_changed_by_e8m0": float((e0[0].view(torch.uint8) != q0.data.view(torch.uint8)).float().mean()),
        "rel_error_streamed": float((dequantize(q0.data, q0.scale.float(), b) - w).norm() / norm),
        "rel_error_e8m0": float((dequantize(*e0, b) - w).norm() / norm),
        "update_moves_streamed_codes": float(moved_stream.float().mean()),
        "update_moves_e8m0_codes": float(moved_engine.float().mean()),
    }


def main() -> int:
    import vllm
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    rows = {name: measure(name, shape, requant_weight_ue8m0_inplace) for name, shape in SHAPES.items()}
    record = {
        "what": "vLLM's requant_weight_ue8m0_inplace on the project's block-FP8 codes (synthetic Student-t weights)",
        "vllm": vllm.__version__, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "cpu_model": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
        if os.path.exists("/proc/cpuinfo") else None,
        "step_relative_to_std": STEP, "layers": rows, "environment": bench_harness.environment(),
    }
    out = bench_harness.RESULTS
    bench_harness.write_json(out / "e8m0_drift.json", record, indent=2)
    lines = ["# E8M0 re-rounding of the streamed block-FP8 codes (what `VLLM_USE_DEEP_GEMM=0` avoids)", "",
             f"vLLM {record['vllm']}'s `requant_weight_ue8m0_inplace` on `qurl_verl.quant` block-FP8 codes of synthetic "
             f"Student-t weights (std 0.02) at Qwen2.5-0.5B's shapes; CPU: {record['cpu_model']}; torch {record['torch']}.", "",
             "| layer | codes changed by E8M0 | error streamed | error after E8M0 | update moves codes (streamed) | (after E8M0) |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} {tuple(r['shape'])} | {r['codes_changed_by_e8m0']:.1%} | {r['rel_error_streamed']:.4f} | "
                     f"{r['rel_error_e8m0']:.4f} | {r['update_moves_streamed_codes']:.2%} | {r['update_moves_e8m0_codes']:.2%} |")
    (out / "e8m0_drift.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
