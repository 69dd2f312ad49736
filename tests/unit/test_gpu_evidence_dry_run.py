"""bench/gpu/gpu_evidence.py --dry-run: every step runs on CPU with verl and vLLM unimportable.

The GPU box has neither package, so the script must not need them; the dry run executes the same
code paths at toy sizes, and its numbers are checked here against bounds derived from the arithmetic.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu" / "gpu_evidence.py"
U32 = 2.0**-24

# The script's toy model (hidden 128, inter 320, 4 heads, 2 kv heads, head_dim 32): (N, K) per rank.
TOY_SHAPES = {
    "toy": {"qkv": [256, 128], "o": [128, 128], "gate_up": [640, 128], "down": [128, 320]},
    "toy-tp2": {"qkv": [128, 128], "o": [128, 64], "gate_up": [320, 128], "down": [128, 160]},
}
VARIANTS = ("bf16", "int8_gemm", "int8_total", "fp8_gemm", "fp8_total")

RUN_WITHOUT_VERL = (
    "import runpy, sys\n"
    "sys.modules['verl'] = None\n"
    "sys.modules['vllm'] = None\n"
    "sys.argv = [sys.argv[1], '--dry-run', '--out', sys.argv[2]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_evidence") / "evidence.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", RUN_WITHOUT_VERL, str(SCRIPT), str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_step_ok(report):
    assert report["env"]["dry_run"] is True and report["env"]["device"] == "cpu"
    assert list(report["steps"]) == ["numerics", "w8a8_decode", "sync_cost", "acr_loss"]
    for name, step in report["steps"].items():
        assert step["status"] == "ok", (name, step.get("error"))
        assert 0 < step["seconds"] < step["budget_s"]


def test_quantizer_codes_match(report):
    totals = report["steps"]["numerics"]["result"]["quantizer"]["totals"]
    assert totals["elements"] > 0
    assert totals["int8_code_mismatches"] == 0 and totals["fp8_code_mismatches"] == 0
    assert totals["scale_mismatches"] == 0


def test_w8a8_products_match_float64_reference(report):
    cases = report["steps"]["numerics"]["result"]["products"]["cases"]
    assert {(c["layer"], c["m"], c["fmt"]) for c in cases if c["fmt"] != "fp8_block"} == {
        (layer, m, fmt) for layer in TOY_SHAPES["toy"] for m in (1, 8, 32) for fmt in ("int8", "fp8")}
    for c in cases:
        assert "error" not in c, c
        if c["fmt"] == "int8":
            # _int_mm accumulates exactly in int32; the float32 rescale rounds three times (int32 -> float,
            # * x_scale, * w_scale), so every output is within (1+u)^3 - 1 < 3.001u of the exact value,
            # u = 2^-24, and an exact zero stays zero.
            assert c["max_rel_err"] <= 3.001 * U32, c
            assert c["zero_ref_nonzero_out"] == 0, c
        else:
            # E4M3 products are exact in float32; K float32 additions and two scalings give
            # |error| <= (K + 2) u * sum |terms| (blocks: one more scaling and one add per 128-block).
            extra = 3 * math.ceil(c["k"] / 128) if c["fmt"] == "fp8_block" else 2
            assert c["max_err_over_abs_sum"] <= (c["k"] + extra) * U32, c
    # the dry run emulates CUDA's M > 16 rule, so the padded INT8 path the GPU needs ran too
    padded = [c for c in cases if c["fmt"] == "int8" and c["m"] < 17]
    assert padded and all("padded to 32" in c["path"] for c in padded)


def test_decode_timing_tables(report):
    res = report["steps"]["w8a8_decode"]["result"]
    assert res["m_values"] == [1, 8]
    assert res["counters"]["act_quant_code_mismatches"] == 0
    assert res["counters"]["act_quant_scale_mismatches"] == 0
    assert res["counters"]["act_quant_checked"] == 2 * 2 * 4 * 2  # models x layers x M x formats
    assert set(res["models"]) == set(TOY_SHAPES)
    for model, entry in res["models"].items():
        assert entry["shapes_nk"] == TOY_SHAPES[model]
        assert set(entry["layers"]) == set(TOY_SHAPES[model])
        for layer, rows in entry["layers"].items():
            assert [r["m"] for r in rows] == [1, 8]
            for r in rows:
                assert [r["n"], r["k"]] == TOY_SHAPES[model][layer]
                assert "errors" not in r, r
                for v in VARIANTS:
                    assert math.isfinite(r[f"{v}_ms"]) and r[f"{v}_ms"] > 0
                assert set(r["speedup_vs_bf16"]) == set(VARIANTS[1:])
                assert r["int8_rows"] == 32  # M < 17 is padded for _int_mm
        totals = entry["per_decoder_layer"]
        assert set(totals) == {"1", "8"}
        for m, t in totals.items():
            for v in VARIANTS:
                layer_sum = sum(next(r for r in rows if r["m"] == int(m))[f"{v}_ms"] for rows in entry["layers"].values())
                assert t["layer_ms"][v] == pytest.approx(layer_sum)
            assert t["speedup_vs_bf16"]["int8_total"] == pytest.approx(t["layer_ms"]["bf16"] / t["layer_ms"]["int8_total"])


def test_sync_cost_and_tracker_memory(report):
    res = report["steps"]["sync_cost"]["result"]
    toy = res["models"]["toy"]
    assert toy["layers_full"] == 4 and toy["layers_measured"] == 2
    assert set(toy["syncs"]) == {f"{f}_from_{d}" for f in ("int8_channel", "fp8_channel", "fp8_block")
                                 for d in ("float32", "bfloat16")}
    for key, s in toy["syncs"].items():
        assert s["input_bytes_per_layer"] == 172032 * (4 if key.endswith("float32") else 2)  # params per layer
        assert s["full_sync_ms_from_many"] == pytest.approx(s["ms_per_layer_many"] * 4)
        assert s["input_gb_per_s"] > 0
    # row_stride 8 keeps ceil(N/8) rows of each weight (its dtype) and of its int8 codes (1 byte):
    # q 16x128, k 8x128, v 8x128, o 16x128, gate 40x128, up 40x128, down 16x320 = 21504 elements per layer.
    sampled = 21504 * 2
    assert toy["tracker_from_float32"]["resident_bytes"] == sampled * (4 + 1)
    assert toy["tracker_from_bfloat16"]["resident_bytes"] == sampled * (2 + 1)
    assert toy["tracker_from_float32"]["full_model_resident_bytes"] == sampled * 5 * 2
    assert 0 < toy["tracker_from_float32"]["changed_fraction"] < 1


def test_acr_loss_timing(report):
    res = report["steps"]["acr_loss"]["result"]
    assert res["shape"] == [8, 256]
    assert set(res["median_ms"]) == {"vanilla_ppo", "vanilla_tis", "acr", "acr_no_stats"}
    assert all(v > 0 for v in res["median_ms"].values())
    assert res["ratio_to_vanilla_tis"]["vanilla_tis"] == 1.0
    # acr_token_loss(adaptive=False) is TIS: it must equal the hand-written PPO loss times min(w, C)
    assert res["qurl_tis_minus_vanilla_tis"] < 1e-6
