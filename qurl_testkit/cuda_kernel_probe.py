"""Test engines' worker extensions with vLLM's CUDA INT8 or FP8 kernel classes forced through vLLM's selector
(``qurl_testkit.cuda_kernel_stand_ins``), and the probes the tests of ``tests/integration/
test_forced_cuda_int8_kernels.py`` and ``test_forced_cuda_fp8_kernels.py`` read them with."""
from __future__ import annotations

import contextlib
import io
import os

import torch

from qurl_testkit import cuda_kernel_stand_ins
from qurl_testkit.reload_probe import Int8GemmProbeWorkerExtension, Level2SleepProbe
from qurl_verl import versions
from qurl_verl.rollout import int8_gemm_report
from qurl_verl.rollout.worker_extension import QurlWorkerExtension

# The scale tensors of a vLLM attention layer that its kernels read: on CUDA the device scales inside captured
# graphs (``_q_scale`` when the backend takes FP8 queries, ``_prob_scale`` where one quantizes probabilities), and
# 0.32's host tensors (``_k_scale_cpu``/``_v_scale_cpu``); a sync writes all of them in place. The host floats
# (``_q_scale_float``, ...) hold no storage a graph could keep.
ATTENTION_SCALES = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu")


class TensorRecordsProbe:
    """What a captured CUDA graph holds, read in the engine (a mix-in of worker extensions)."""

    def probe_tensor_records_with_a_copy(self, module_name: str, param: str) -> dict[str, tuple]:
        """The records as ``probe_tensor_records`` makes them while one parameter is a copy in new storage (what a
        reload that re-registers its parameters leaves); the parameter is put back."""
        module = dict(self.model_runner.model.named_modules())[module_name]
        original = getattr(module, param)
        try:
            setattr(module, param, torch.nn.Parameter(original.detach().clone(), requires_grad=False))
            return self.probe_tensor_records()
        finally:
            setattr(module, param, original)

    def probe_tensor_records(self) -> dict[str, tuple]:
        """(data_ptr, shape, stride, dtype) of every parameter and buffer of the model, of each attention layer's
        scales (``ATTENTION_SCALES``, whatever they are on this vLLM) and of each LoRA layer's adapter slots
        (``lora_a_stacked``/``lora_b_stacked``: a tensor, or a tuple of them): what a captured CUDA graph holds."""
        model = self.model_runner.model
        records = {}

        def add(label, t):
            if isinstance(t, torch.Tensor):
                records[label] = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))

        for name, p in model.named_parameters(remove_duplicate=False):
            add(f"parameter {name}", p)
        for name, b in model.named_buffers(remove_duplicate=False):
            add(f"buffer {name}", b)
        for name, module in model.named_modules():
            for attr in ATTENTION_SCALES:
                if hasattr(module, attr):
                    add(f"attention {name}.{attr}", getattr(module, attr))
            for attr in ("lora_a_stacked", "lora_b_stacked"):
                slots = getattr(module, attr, None)
                for i, t in enumerate(slots if isinstance(slots, (tuple, list)) else (slots,)):
                    add(f"lora {name}.{attr}[{i}]", t)
        return records


class ForcedCudaInt8WorkerExtension(TensorRecordsProbe, Int8GemmProbeWorkerExtension):
    """The production extension (with the INT8 GEMM recorder) on a CPU where vLLM's selector may choose its CUDA
    INT8 classes: Cutlass, unless the environment disables it (``VLLM_DISABLED_KERNELS``), then Triton."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        super()._install_cpu_patches()
        cuda_kernel_stand_ins.install()

    def _int8_layers(self):
        for name, module in self.model_runner.model.named_modules():
            kernel = int8_gemm_report.int8_kernel(module)
            if kernel is not None:
                yield name, module, kernel

    def probe_int8_kernel_classes(self) -> dict[str, str]:
        """{module name: the class of the INT8 kernel object it holds (``scheme.kernel``)}."""
        return {name: type(kernel).__name__ for name, _, kernel in self._int8_layers()}

    def probe_scramble_int8_weight(self, module_name: str) -> list[int]:
        """The codes of one INT8 linear reversed along K, in place: a mis-packed weight in the right storage,
        layout and dtype (the next sync writes the right one). Its (K, N) strides."""
        layer = dict(self.model_runner.model.named_modules())[module_name]
        with torch.no_grad():
            layer.weight.copy_(layer.weight.flip(0))
        return list(layer.weight.stride())

    def probe_row_major_weight_gemm(self, module_name: str) -> str:
        """The layer's kernel applied (vLLM's wrapper, then the op) to its weight re-laid row-major, the layout
        vLLM's post-processing does not leave: what the op's layout check says ("" if it ran). The layer's own
        weight is left as it was."""
        layer = dict(self.model_runner.model.named_modules())[module_name]
        kernel = layer.scheme.kernel
        weight = layer.weight
        k = weight.shape[0]
        x = torch.randn(4, k, generator=torch.Generator().manual_seed(0)).to(_act_dtype(layer))
        try:
            layer.weight = torch.nn.Parameter(weight.detach().contiguous(), requires_grad=False)
            kernel.apply_weights(layer, x)
            return ""
        except AssertionError as e:
            return f"AssertionError: {e}"
        finally:
            layer.weight = weight

class FullGraphWrapperProbe:
    """vLLM's own ``CUDAGraphWrapper`` around a live engine's model (a mix-in of worker extensions)."""

    def probe_wrap_model_for_full_graphs(self, wrap: bool) -> str:
        """Put vLLM's ``CUDAGraphWrapper`` in FULL mode around the model runner's model, as a GPU model runner does
        under verl's default ``cudagraph_mode`` (``FULL_AND_PIECEWISE``), or take it off; the type the runner holds
        now. The wrapper is no ``nn.Module``: it forwards attribute reads to the model and calls it whenever the
        forward context says no graph (always here: the engines run eager). The one CUDA object it asks for at
        construction, the platform's graph pool handle (read only when a graph is captured), is a placeholder."""
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.config import CUDAGraphMode
        from vllm.platforms import current_platform

        runner = self.model_runner
        if not wrap:
            if isinstance(runner.model, CUDAGraphWrapper):
                runner.model = runner.model.unwrap()
            return type(runner.model).__name__
        platform = type(current_platform)
        pool = platform._global_graph_pool
        platform._global_graph_pool = pool if pool is not None else object()
        try:
            runner.model = CUDAGraphWrapper(runner.model, runner.vllm_config, runtime_mode=CUDAGraphMode.FULL)
        finally:
            platform._global_graph_pool = pool
        return type(runner.model).__name__


class ForcedCudaInt8Level2SleepProbe(FullGraphWrapperProbe, ForcedCudaInt8WorkerExtension, Level2SleepProbe):
    """The forced CUDA INT8 extension with the simulated level-2 sleep of the reload tests
    (``Level2SleepProbe.probe_level2_sleep``): what a GPU engine's weights hold after verl's level-2 sleep; and
    vLLM's full-graph wrapper around its model on request."""


class ForcedCudaFp8WorkerExtension(TensorRecordsProbe, QurlWorkerExtension):
    """The production extension on a CPU where vLLM's selector may choose its Cutlass FP8 classes: the per-channel
    one for ``fp8``, the block-scaled one for ``fp8_block``."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        super()._install_cpu_patches()
        cuda_kernel_stand_ins.install_fp8()

    def probe_fp8_kernel_classes(self) -> dict[str, str]:
        """{module name: the class of the FP8 kernel object its compressed-tensors scheme holds (``fp8_linear``)}."""
        return {name: type(module.scheme.fp8_linear).__name__ for name, module in self.model_runner.model.named_modules()
                if hasattr(getattr(module, "scheme", None), "fp8_linear")}

    def probe_fp8_weights(self) -> bytes:
        """``torch.save``d {module name: (weight, weight_scale)} of every FP8 linear, as its kernel holds them (copies
        with their strides)."""
        held = {name: (module.weight.detach().clone(), module.weight_scale.detach().clone())
                for name, module in self.model_runner.model.named_modules()
                if hasattr(getattr(module, "scheme", None), "fp8_linear")}
        buffer = io.BytesIO()
        torch.save(held, buffer)
        return buffer.getvalue()

    def probe_stand_in_calls(self) -> dict[str, int]:
        """The stand-in ops' calls in this worker so far (the Cutlass op's by scaling and code dtype, the Triton
        block FP8 launch's)."""
        return dict(cuda_kernel_stand_ins.CALLS)

    def probe_use_deep_gemm(self) -> bool:
        """``VLLM_USE_DEEP_GEMM`` as vLLM reads it in this worker."""
        import vllm.envs as envs

        return bool(envs.VLLM_USE_DEEP_GEMM)


class ForcedTritonFp8BlockWorkerExtension(ForcedCudaFp8WorkerExtension):
    """The production extension on a CPU where vLLM's selector may choose Triton's block FP8 class as on an Ada GPU
    (Cutlass's block class ahead of it declines: no Cutlass block FP8 below sm90)."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        super(ForcedCudaFp8WorkerExtension, cls)._install_cpu_patches()  # not the Cutlass FP8 choice
        cuda_kernel_stand_ins.install_fp8_triton_block()


def _act_dtype(layer) -> torch.dtype:
    """The engine's activation dtype, as vLLM's linear layers keep it (``params_dtype``)."""
    return getattr(layer, "params_dtype", torch.bfloat16)


# vLLM's CUDA-path Python is forced on the vLLM GPU users run (verl 0.9.1 declares 0.24): on another stack the same
# classes would cost the suite engine starts again (the stand-ins' unit tests run on both)
ON_GPU_USERS_VLLM = versions.vllm_release(versions.installed_vllm_version()) == (0, 24)
FORCED_CUDA_INT8_EXTENSION = f"{__name__}.ForcedCudaInt8WorkerExtension"
BLACKWELL = (10, 0)


@contextlib.contextmanager
def engine_env_restored():
    """Every variable ``engine_policy.set_engine_env`` may set, as it was before the block: an engine's workers
    inherit them while it starts, later engines and ``main_ppo`` runs of the test process must not (a runner pin
    already in the environment would hide the server's own)."""
    from qurl_verl.rollout.engine_policy import ENGINE_ENV_VARS

    saved = {name: os.environ.get(name) for name in ENGINE_ENV_VARS}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_triton_int8_engine(model_dir, settings, environment, **engine_args):
    """An engine whose INT8 linears run vLLM's CUDA ``TritonInt8ScaledMMLinearKernel``, chosen by vLLM's selector
    under the rollout server's own environment for a Blackwell GPU (``engine_policy.set_engine_env``: Cutlass disabled),
    set while the engine's workers start (``environment``: the test module's ``MonkeyPatch``, which restores what
    was there). Triton takes fp32 outputs, so an fp32 engine keeps the fp32 bounds. Returns (engine, its tensor
    records at the start: what a GPU engine's captured graphs hold)."""
    from qurl_testkit.reload_harness import start_engine
    from qurl_verl.rollout.cuda_kernel_env import DISABLED_KERNELS_ENV
    from qurl_verl.rollout.engine_policy import set_engine_env

    environment.delenv(DISABLED_KERNELS_ENV, raising=False)
    with engine_env_restored():
        set_engine_env(settings, BLACKWELL)
        llm = start_engine(model_dir, settings, extension=FORCED_CUDA_INT8_EXTENSION, **engine_args)
    (records,) = llm.collective_rpc("probe_tensor_records")
    return llm, records


def moved_records(llm, at_start: dict[str, tuple]) -> dict[str, tuple]:
    """{label: (record at the start, record now)} of every tensor whose pointer, shape, stride or dtype differs from
    ``at_start`` (or that appeared or vanished) on the engine's first rank: empty when a captured graph still
    holds the model."""
    (now,) = llm.collective_rpc("probe_tensor_records")
    return {k: (at_start.get(k), now.get(k)) for k in at_start.keys() | now.keys() if at_start.get(k) != now.get(k)}

