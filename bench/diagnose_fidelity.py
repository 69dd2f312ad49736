"""Where does the INT8 log-prob error of a random-weight model come from: the kernel, or the model?

On the ~100M random model built as the reload tests build the tiny one (weights x4), vLLM INT8 vs
BF16 showed a mean |delta log p| of ~0.5 nat, against ~0.02 on the tiny model. This scores the
same token sequences with

* vLLM-CPU engines, BF16 and INT8 (the product's engine and weight sync), and
* pure-torch HF forwards: fp32, bf16, W8A8 INT8 (``qurl_verl.quant.W8A8Linear``: same codes and
  scales as the engine, real ``_int_mm``, bf16 activations), W8A8 FP8 (fake-quantized, same
  function) -- no vLLM involved,

for each weight init of ``bench_models``. If vLLM INT8 ~= torch W8A8 the error is the model's,
not the kernel's; bf16-vs-fp32 alone then shows how strongly the model amplifies rounding.
Sequences are sampled (T=1, fixed seed) from the fp32 HF model, so mean(logp_fp32 - logp_x) over
them is the k1 estimate of KL(fp32 || x). Writes ``bench/results/fidelity_diagnosis.{json,md}``.

    .venv/bin/python bench/diagnose_fidelity.py [--inits gain4 default fanin] [--engine-inits gain4 fanin]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import bench_harness
import torch
from bench_models import INITS, build_model, param_count
from rollout_engines import chat_prompts, score, start_engine

REPO = bench_harness.REPO

PAIRS = [  # (x, reference): what each comparison isolates
    ("hf_bf16", "hf_fp32", "bf16 rounding alone (model sensitivity)"),
    ("hf_int8", "hf_fp32", "W8A8 INT8 quantization, pure torch"),
    ("hf_int8", "hf_bf16", "W8A8 INT8 vs BF16, pure torch"),
    ("hf_fp8", "hf_bf16", "W8A8 FP8 vs BF16, pure torch (fake-quant)"),
    ("vllm_bf16", "hf_bf16", "vLLM BF16 kernels vs torch BF16"),
    ("vllm_int8", "hf_int8", "vLLM INT8 kernels vs torch W8A8 (kernel check)"),
    ("vllm_int8", "vllm_bf16", "what the throughput bench reports"),
    ("hf_int8_fp32", "hf_fp32", "W8A8 INT8 with fp32 activations, pure torch"),
    ("vllm_bf16_fp32", "hf_fp32", "vLLM fp32 kernels vs torch fp32"),
    ("vllm_int8_fp32", "hf_int8_fp32", "vLLM INT8 kernels vs torch W8A8, fp32 activations (kernel check)"),
    ("hf_fp32_eps", "hf_fp32", "1e-6 relative jitter of the RMSNorm weights, fp32, pure torch"),
    ("hf_int8_fp32_eps", "hf_int8_fp32", "the same jitter under W8A8 INT8: activation codes near a rounding boundary flip"),
]
EPS = 1e-6  # about what two fp32 implementations of the same layer differ by


def hf_models(model_dir: Path, master: dict):
    """The fp32, bf16, W8A8 INT8 and W8A8 FP8 HF models, all from the same fp32 weights."""
    from transformers import AutoModelForCausalLM

    from qurl_verl.quant.linear import quantize_linear_modules_
    from qurl_verl.settings import RolloutSettings

    g = torch.Generator().manual_seed(3)
    jitter = {k: 1 + EPS * torch.randn(v.shape, generator=g) for k, v in master.items() if k.endswith("norm.weight")}

    def load(dtype, eps=False):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        m.load_state_dict({k: (v * jitter[k] if eps and k in jitter else v).to(dtype) for k, v in master.items()})
        return m.eval()

    models = {"hf_fp32": load(torch.float32), "hf_bf16": load(torch.bfloat16), "hf_fp32_eps": load(torch.float32, True)}
    for name, fmt, fake, dtype, eps in (("hf_int8", "int8", False, torch.bfloat16, False),
                                        ("hf_fp8", "fp8", True, torch.bfloat16, False),
                                        ("hf_int8_fp32", "int8", False, torch.float32, False),
                                        ("hf_int8_fp32_eps", "int8", False, torch.float32, True)):
        s = RolloutSettings(format=fmt)
        m = load(dtype, eps)
        # codes from the fp32 masters, exactly what the engine's sync quantizes
        quantize_linear_modules_(m, s.quant_scheme, ignore=s.ignore_patterns, fake=fake)
        for mod_name, module in m.named_modules():
            if hasattr(module, "load_weight_"):
                module.load_weight_(master[f"{mod_name}.weight"], name=mod_name)
        models[name] = m
    return models


@torch.no_grad()
def hf_logprobs(model, seqs, prompt_lens) -> list[list[float]]:
    out = []
    for seq, n in zip(seqs, prompt_lens):
        ids = torch.tensor([seq])
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp[n - 1:].double().tolist())
    return out


@torch.no_grad()
def model_stats(model, seqs) -> dict:
    """Residual-stream RMS per layer and logit std: is the signal preserved, blown up, or flattened?"""
    out = model(torch.tensor([seqs[0]]), output_hidden_states=True)
    rms = [float(h.float().pow(2).mean().sqrt()) for h in out.hidden_states[:-1]]  # the last one is after the final norm
    return {"hidden_rms_per_layer": rms, "logit_std": float(out.logits.float().std())}


def gemm_check(shapes=((80, 1024, 1024), (80, 1024, 5632), (80, 2816, 1024))) -> list[dict]:
    """Op-level: vLLM-CPU's INT8 linear (per-token activation quantization + the split oneDNN GEMM of
    kernels/cpu_int8_paths.py, as ``_apply_split`` runs it) vs the exact product of
    ``qurl_verl.quant``'s codes, fp32 activations, the ~100M model's shapes (M tokens, K in, N out)."""
    from vllm import _custom_ops as ops

    from qurl_verl.kernels.cpu_int8_paths import split_codes
    from qurl_verl.quant import INT8_CHANNEL, INT8_TOKEN, quantize

    g, rows = torch.Generator().manual_seed(0), []
    for m, k, n in shapes:
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        qw, qx = quantize(w, INT8_CHANNEL), quantize(x, INT8_TOKEN)
        # the handler keeps pointing at the scale tensor (see patches/vllm_cpu_onednn_scale_keepalive.py): keep both alive
        split, split_scale = split_codes(qw.data), torch.cat([qw.scale, qw.scale]).contiguous()
        handler = ops.create_onednn_scaled_mm(split.t(), split_scale, torch.float32, True, False, 32)
        xq, xs, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty(m, 2 * n, dtype=torch.float32)
        ops.onednn_scaled_mm(handler, xq, out, xs, None, None, None)
        y = (out[:, :n] + out[:, n:]).double()
        ref = (qx.data.double() @ qw.data.double().t()) * qx.scale.double() * qw.scale.double().t()
        rows.append({"shape_mkn": [m, k, n], "activation_codes_differing": int((xq != qx.data).sum()),
                     "max_rel_err_vs_exact": float((y - ref).abs().max() / ref.abs().max())})
    return rows


def compare(x: list[list[float]], ref: list[list[float]]) -> dict:
    a = torch.tensor([v for r in x for v in r], dtype=torch.float64)
    b = torch.tensor([v for r in ref for v in r], dtype=torch.float64)
    d = (a - b).abs()
    return {"tokens": int(d.numel()), "mean_abs_dlogp": float(d.mean()), "median_abs_dlogp": float(d.median()), "p95_abs_dlogp": float(torch.quantile(d, 0.95)),
            "max_abs_dlogp": float(d.max()), "k1_kl_ref_to_x": float((b - a).mean())}


def run_init(init: str, model: str, tmp: Path, n_seqs: int, gen_tokens: int, engines: bool,
             engine_dtypes: list[str]) -> dict:
    from qurl_testkit import reload_harness as harness

    model_dir = build_model(tmp / f"{model}_{init}", model, init)
    trainer = harness.TrainerWeights(model_dir)
    prompts = chat_prompts(model_dir, n_seqs)
    models = hf_models(model_dir, trainer.master)
    ref = models["hf_fp32"]
    g = torch.Generator().manual_seed(7)
    seqs = []
    with torch.no_grad():  # T=1 samples of the fp32 model, one sequence at a time (no padding)
        for p in prompts:
            ids, step, past = torch.tensor([p]), torch.tensor([p]), None
            for _ in range(gen_tokens):
                out = ref(step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                step = torch.multinomial(torch.softmax(out.logits[0, -1].float(), -1), 1, generator=g)[None]
                ids = torch.cat([ids, step], 1)
            seqs.append(ids[0].tolist())
    lens = [len(p) for p in prompts]
    scores = {name: hf_logprobs(m, seqs, lens) for name, m in models.items()}
    result = {"params": param_count(trainer.master, True), "stats": model_stats(ref, seqs),
              "fp32_mean_logp": float(torch.tensor([v for r in scores["hf_fp32"] for v in r]).mean())}
    del models
    gc.collect()
    for dtype in engine_dtypes if engines else ():
        for fmt in ("bf16", "int8"):
            llm = start_engine(model_dir, fmt, max_model_len=max(len(s) for s in seqs) + 8, dtype=dtype)
            try:
                harness.sync_weights(llm, trainer.named_tensors(), bucket_mb=256)
                scores[f"vllm_{fmt}" + ("" if dtype == "bfloat16" else "_fp32")] = score(llm, seqs, lens)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
    result["pairs"] = {f"{x} vs {r}": {"what": what, **compare(scores[x], scores[r])}
                       for x, r, what in PAIRS if x in scores and r in scores}
    return result


def markdown(report: dict) -> str:
    lines = ["# Log-prob fidelity diagnosis: kernel or model?", "",
             f"Model: Qwen2-shaped, random weights ({report['spec']}); {report['n_seqs']} sequences, "
             f"{report['gen_tokens']} tokens each sampled at T=1 from the fp32 HF model; every row scores the same tokens. "
             f"1-min load average at start: {bench_harness.start_loadavg(report)[0]:.2f}.", "",
             "| init | params | fp32 mean log p | logit std | residual RMS (emb -> before final norm) | comparison | mean abs dlogp | median | p95 | max | k1 KL(ref, x) |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for init, r in report["inits"].items():
        rms = r["stats"]["hidden_rms_per_layer"]
        head = (f"| {init} | {r['params'] / 1e6:.1f}M | {r['fp32_mean_logp']:.2f} | {r['stats']['logit_std']:.2f} "
                f"| {rms[0]:.3g} -> {rms[-1]:.3g} ")
        for i, (pair, c) in enumerate(r["pairs"].items()):
            lead = head if i == 0 else "| | | | | "
            med = f"{c['median_abs_dlogp']:.1e}" if "median_abs_dlogp" in c else "-"
            lines.append(f"{lead}| {pair} | {c['mean_abs_dlogp']:.4f} | {med} | {c['p95_abs_dlogp']:.4f} | "
                         f"{c['max_abs_dlogp']:.4f} | {c['k1_kl_ref_to_x']:.2e} |")
    if report.get("gemm_check"):
        lines += ["", "## Op-level check: vLLM-CPU INT8 linear vs exact", "",
                  "| M x K x N | activation codes differing from qurl_verl.quant | max rel. error vs exact |", "|---|---:|---:|"]
        lines += [f"| {' x '.join(map(str, r['shape_mkn']))} | {r['activation_codes_differing']} | {r['max_rel_err_vs_exact']:.1e} |"
                  for r in report["gemm_check"]]
    lines += ["", "## Finding", ""] + [f"- {n}" for n in report["finding"]]
    return "\n".join(lines) + "\n"


def finding(report: dict) -> list[str]:
    """Plain statements derived from the numbers above (no hand-entered figures)."""
    out = []
    for init, r in report["inits"].items():
        p = r["pairs"]
        bf = p["hf_bf16 vs hf_fp32"]["mean_abs_dlogp"]
        q = p["hf_int8 vs hf_bf16"]["mean_abs_dlogp"]
        s = f"{init}: torch bf16-vs-fp32 {bf:.3f}, torch INT8-vs-BF16 {q:.3f}"
        if "vllm_int8_fp32 vs hf_int8_fp32" in p:
            c = p["vllm_int8_fp32 vs hf_int8_fp32"]
            s += (f", fp32 engines: vLLM INT8 vs torch W8A8 mean {c['mean_abs_dlogp']:.2e} max {c['max_abs_dlogp']:.2e} "
                  f"(vLLM fp32 vs torch fp32: {p['vllm_bf16_fp32 vs hf_fp32']['mean_abs_dlogp']:.2e})")
        if "vllm_int8 vs hf_int8" in p:
            k, e = p["vllm_int8 vs hf_int8"]["mean_abs_dlogp"], p["vllm_int8 vs vllm_bf16"]["mean_abs_dlogp"]
            kb = p["vllm_bf16 vs hf_bf16"]["mean_abs_dlogp"]
            s += (f", vLLM INT8-vs-BF16 {e:.3f}; vLLM INT8 vs torch W8A8 {k:.3f} "
                  f"(vLLM BF16 vs torch BF16: {kb:.3f}, the kernel-noise floor of this model)")
        if "hf_int8_fp32_eps vs hf_int8_fp32" in p:
            e8, e32 = p["hf_int8_fp32_eps vs hf_int8_fp32"], p["hf_fp32_eps vs hf_fp32"]
            s += (f"; a {EPS:.0e} jitter of the norm weights moves torch fp32 by {e32['mean_abs_dlogp']:.1e} but torch "
                  f"W8A8 by {e8['mean_abs_dlogp']:.1e} (median {e8['median_abs_dlogp']:.1e})")
        out.append(s + " (mean |dlogp|, nats).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mid")
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS)
    parser.add_argument("--engine-inits", nargs="*", default=["gain4", "fanin"], help="inits also scored by vLLM")
    parser.add_argument("--engine-dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                        help="float32: the engine exactly as the reload tests check it, vs torch W8A8 in fp32")
    parser.add_argument("--n-seqs", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fidelity_diagnosis"))
    args = parser.parse_args()

    from bench_models import SPECS
    from verl.plugin.platform import platform_manager

    from qurl_testkit import reload_harness as harness
    from qurl_verl.platform.cpu import PlatformCPU

    os.environ.update(harness.engine_env())
    platform_manager._current_platform = PlatformCPU()
    report = {"spec": SPECS[args.model] or "tiny default", "n_seqs": args.n_seqs, "gen_tokens": args.gen_tokens,
              "environment": bench_harness.environment(), "inits": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for init in args.inits:
            report["inits"][init] = run_init(init, args.model, Path(tmp), args.n_seqs, args.gen_tokens,
                                             init in args.engine_inits, args.engine_dtypes)
            print(init, json.dumps({k: round(v["mean_abs_dlogp"], 4) for k, v in report["inits"][init]["pairs"].items()}),
                  flush=True)
    report["gemm_check"] = gemm_check()
    report["elapsed_s"] = time.perf_counter() - start
    report["finding"] = finding(report)
    out = Path(args.out)
    bench_harness.write_result(out, report, markdown(report))
    print("written", out.with_suffix(".json"), out.with_suffix(".md"))


if __name__ == "__main__":
    main()
