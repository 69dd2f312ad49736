"""Test-only worker extension: QurlWorkerExtension with its vLLM-CPU patches off until a test
installs them, and a direct feeder (tensors over collective_rpc instead of verl's ZMQ stream)."""
from __future__ import annotations

import io

import torch

from qurl_verl.kernels import cpu_int8_paths
from qurl_verl.kernels.cpu_int8_paths import INT8_PATH_ATTR, PACKED_ATTR, SPLIT_SCALE_ATTR
from qurl_verl.patches.vllm_cpu_worker import (
    vllm_cpu_int8_kernels,
    vllm_cpu_onednn_scale_keepalive,
    vllm_cpu_tied_lm_head_refresh,
)
from qurl_verl.rollout import int8_gemm_report
from qurl_verl.rollout.worker_extension import QurlWorkerExtension
from qurl_verl.tied_lm_head import tied_output_embedding


def force_amx_int8_choice() -> None:
    """vLLM decides its sgl (AMX) paths as on an AMX CPU, with ``qurl_testkit/sgl_stand_in.py`` for their ops,
    and the AMX INT8 kernel class's predicate (AMX tiles present, ``cpu_int8_paths.amx_tiles``) answers as there."""
    from qurl_testkit import sgl_stand_in

    sgl_stand_in.install_ops()
    sgl_stand_in.force_choice()
    cpu_int8_paths.amx_tiles = lambda: True


class SettingsProbe:
    """Mixed into a probe extension: other settings for an engine the tests already started."""

    def probe_use_settings(self, additional_config: dict) -> dict:
        """This engine's settings replaced (``RolloutSettings.additional_config``) for the syncs that follow, as
        if it had been started with them; the features are built anew. Only what the sync reads can change."""
        self.model_runner.vllm_config.additional_config.update(additional_config)
        self._qurl_features = None
        return self.model_runner.vllm_config.additional_config


class ProbeWorkerExtension(SettingsProbe, QurlWorkerExtension):
    """The reload patches off until a test installs them; the INT8 GEMM is vLLM's oneDNN kernel on every
    CPU. vLLM's choice is forced to what an AMX CPU gets (its sgl kernel, which refuses the fp32 engine
    these tests run), and the AMX INT8 kernel class (``vllm_cpu_int8_kernels``) gives the fp32 layers
    oneDNN, as on a real AMX CPU: the oneDNN handles whose scales the keep-alive patch protects. Without
    that kernel choice an AMX CPU's engine died at the first generate, before the tests could show
    anything. The saturating CPU's class answers no until ``probe_install("saturation")``."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        force_amx_int8_choice()
        if not hasattr(cls, "_probe_saturates"):  # once per process: keep the real probe for probe_install
            cls._probe_saturates = staticmethod(cpu_int8_paths.onednn_int8_saturates)
            cpu_int8_paths.onednn_int8_saturates = lambda: False
        vllm_cpu_int8_kernels.apply()

    def _refresh_after_reload(self, model) -> None:
        if getattr(self, "_probe_refresh", False):
            super()._refresh_after_reload(model)

    def probe_install(self, name: str) -> str:
        if name == "keepalive":
            return vllm_cpu_onednn_scale_keepalive.apply()
        if name == "saturation":
            cpu_int8_paths.onednn_int8_saturates = self._probe_saturates
            return self._reselect_int8_kernels()
        if name == "refresh":
            self._probe_refresh = True
            return "refresh after reload"
        raise ValueError(name)

    def _reselect_int8_kernels(self) -> str:
        """vLLM's selector asked again for every INT8 linear's kernel, now that the saturating CPU's class
        may answer yes: a kernel object of another class takes the chosen class, as if vLLM had chosen it
        when it built the model (the next reload post-processes the layer with it). What changed, or ""."""
        import inspect

        from vllm.model_executor.kernels.linear import _POSSIBLE_INT8_KERNELS, choose_scaled_mm_linear_kernel

        # vLLM 0.32's selector also takes the quantization its backend override is keyed by; 0.24's does not
        by_quantization = "quantization" in inspect.signature(choose_scaled_mm_linear_kernel).parameters
        extra = {"quantization": "int8_w8a8"} if by_quantization else {}
        vllm_cpu_int8_kernels.apply()
        changed = set()
        for module in self.model_runner.model.modules():
            kernel = int8_gemm_report.int8_kernel(module)
            if kernel is None:
                continue
            chosen = choose_scaled_mm_linear_kernel(kernel.config, _POSSIBLE_INT8_KERNELS, **extra)
            if type(kernel) is not chosen:
                changed.add(f"{type(kernel).__name__} -> {chosen.__name__}")
                kernel.__class__ = chosen
        return ", ".join(sorted(changed))

    def probe_refresh_lm_head(self) -> bool:
        return bool(vllm_cpu_tied_lm_head_refresh.refresh(self.model_runner.model))

    def probe_sync(self, blob: bytes, bucket_size: int = 4):
        """One reload from ``torch.save``d (name, tensor) pairs, ``bucket_size`` tensors per bucket."""
        named_tensors = torch.load(io.BytesIO(blob))
        with self.qurl_weight_reload() as load_bucket:
            for i in range(0, len(named_tensors), bucket_size):
                load_bucket(named_tensors[i : i + bucket_size])
        return self.qurl_last_sync()

    def probe_zero_kv_cache(self) -> int:
        """A NaN reload leaves NaN in the CPU KV cache, which later requests read; clear it."""
        caches = self.model_runner.kv_caches
        for t in caches:
            t.zero_()
        return len(caches)

    def probe_int8_saturates(self) -> bool:
        return getattr(self, "_probe_saturates", cpu_int8_paths.onednn_int8_saturates)()


class ForcedSaturationWorkerExtension(QurlWorkerExtension):
    """The production extension on a CPU that looks like one without VNNI: the saturation probe
    answers yes, so vLLM chooses the saturating CPU's INT8 kernel class and the INT8 linears take its
    path (the packed AVX2 GEMM)."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        cpu_int8_paths.onednn_int8_saturates = lambda: True
        super()._install_cpu_patches()

    def probe_int8_paths(self) -> list[str]:
        """The GEMM path each INT8 linear holds now (the dummy weights of the first load may differ)."""
        kernels = [getattr(getattr(m, "scheme", None), "kernel", None) for m in self.model_runner.model.modules()]
        return sorted({getattr(k, INT8_PATH_ATTR, "none") for k in kernels if k is not None})


class MoeProbeWorkerExtension(QurlWorkerExtension):
    """The production extension, plus a read-out of the MoE layers' full-precision parts, and a switch
    that leaves out the MoE experts' re-packing after a reload (to show what it fixes)."""

    def _refresh_after_reload(self, model) -> None:
        if getattr(self, "_probe_skip_moe_refresh", False):
            vllm_cpu_tied_lm_head_refresh.refresh(model)
        else:
            super()._refresh_after_reload(model)

    def probe_skip_moe_refresh(self, skip: bool) -> bool:
        self._probe_skip_moe_refresh = skip
        return skip

    def probe_moe_tensors(self, probe_input: bytes) -> bytes:
        """``torch.save``d {name: tensor}: every fused expert parameter as the engine holds it, the
        packing its CPU kernel expects (``<layer>.isa``: absent where it reads the checkpoint layout),
        and every router's output for ``probe_input`` (vLLM-CPU keeps a router's weight only inside
        its GEMM handle)."""
        x = torch.load(io.BytesIO(probe_input))
        model = self.model_runner.model
        out = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n.endswith((".w13_weight", ".w2_weight"))}
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(".mlp.gate"):
                    logits = module(x.to(next(module.parameters()).dtype))
                    out[f"{name}(x)"] = (logits[0] if isinstance(logits, tuple) else logits).detach().cpu().clone()
                isa = _packed_isa(getattr(module, "quant_method", None))
                if isa is not None:
                    out[f"{name}.isa"] = isa
        buf = io.BytesIO()
        torch.save(out, buf)
        return buf.getvalue()


def _packed_isa(method) -> str | None:
    """The ISA vLLM-CPU's full-precision MoE kernel packs expert weights for (0.32: the CPU experts;
    0.24: the grouped-GEMM path of its CPU MoE), None where it reads them unpacked."""
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if kernel is not None and hasattr(kernel, "isa") and not getattr(kernel, "_use_zentorch", False):
        return kernel.isa
    legacy = getattr(method, "cpu_fused_moe", None)
    if legacy is not None and getattr(getattr(legacy, "forward_method", None), "__name__", "") == "forward_grouped_gemm":
        return legacy.isa
    return None


class Int8GemmProbeWorkerExtension(QurlWorkerExtension):
    """The production extension, plus a recorder of what each INT8 linear's GEMM received and returned."""

    def probe_record_int8_gemms(self) -> int:
        """From now on, keep the first call of every INT8 linear's GEMM: its input, bias and output."""
        self._probe_calls = {}
        armed = 0
        for name, module in self.model_runner.model.named_modules():
            kernel = int8_gemm_report.int8_kernel(module)
            if kernel is None:
                continue
            if "apply_weights" in vars(kernel):  # the recorder of an earlier call: record anew
                del kernel.apply_weights
            kernel.apply_weights = self._recorder(name, kernel.apply_weights)
            armed += 1
        return armed

    def _recorder(self, name, apply_weights):
        def apply_and_record(layer, x, bias=None):
            out = apply_weights(layer, x, bias)
            if name not in self._probe_calls:
                self._probe_calls[name] = {"x": x.detach().clone(), "out": out.detach().clone()}
            return out

        return apply_and_record

    def probe_recorded_int8_gemms(self) -> bytes:
        """``torch.save``d {module name: {"x", "out", "gemm"}} of the calls kept since the last arming."""
        gemms = int8_gemm_report.int8_gemms(self.model_runner.model)
        calls = {name: {**call, "gemm": gemms[name]} for name, call in self._probe_calls.items()}
        buf = io.BytesIO()
        torch.save(calls, buf)
        return buf.getvalue()


class ForcedAmxInt8WorkerExtension(Int8GemmProbeWorkerExtension):
    """The same, on a CPU that looks like one with AMX to vLLM's INT8 kernel and unquantized GEMM dispatch
    alone: vLLM takes its sgl paths (``qurl_testkit/sgl_stand_in.py`` stands in for the AMX ops: the INT8
    linears' and the small bf16 GEMMs', such as the tied lm_head) and the fp32 patch applies."""

    @classmethod
    def _install_cpu_patches(cls) -> None:
        force_amx_int8_choice()
        super()._install_cpu_patches()


class ShardProbeWorkerExtension(QurlWorkerExtension):
    """The production extension, plus a copy of what each INT8 linear holds on this rank right before
    vLLM post-processes it (the oneDNN kernel then packs the codes and drops ``layer.weight``)."""

    _probe_shards: dict = {}

    def probe_record_shards(self) -> int:
        """From now on, keep each INT8 layer's ``weight`` codes and ``weight_scale`` as loaded; the rank's TP index."""
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8 import (
            CompressedTensorsW8A8Int8,
        )

        scheme = CompressedTensorsW8A8Int8
        if not getattr(scheme.process_weights_after_loading, "_probe_shards", False):
            original = scheme.process_weights_after_loading

            def record_then_process(self_scheme, layer):
                ShardProbeWorkerExtension._probe_shards[layer.prefix] = {
                    "weight": layer.weight.detach().clone(), "weight_scale": layer.weight_scale.detach().clone()}
                return original(self_scheme, layer)

            record_then_process._probe_shards = True
            scheme.process_weights_after_loading = record_then_process
        ShardProbeWorkerExtension._probe_shards = {}
        return get_tensor_model_parallel_rank()

    def probe_recorded_shards(self) -> bytes:
        buf = io.BytesIO()
        torch.save(ShardProbeWorkerExtension._probe_shards, buf)
        return buf.getvalue()

    def probe_broken(self) -> str | None:
        """Why this rank refuses syncs (an earlier one failed), or None."""
        return self._qurl_broken


# ---------------------------------------------------------------------------------------------
# a level-2 sleep simulated on vLLM-CPU (tests/integration/test_qurl_vllm_reload.py)

# Objects hanging off a module that may keep tensors outside its parameters and buffers.
_TENSOR_OWNERS = ("quant_method", "scheme")
# The INT8 kernel's tensors for each CPU GEMM path (``cpu_int8_paths``): those of a path
# the kernel no longer runs (the split path, chosen at start-up for the dummy weights' -128 codes)
# stay behind, never read again.
_PATH_TENSORS = {SPLIT_SCALE_ATTR: "onednn_split", PACKED_ATTR: "avx2_packed"}


def _read_by_forward(owner, attr: str) -> bool:
    """False only for an INT8 kernel's tensor of a GEMM path the kernel no longer runs."""
    path = _PATH_TENSORS.get(attr)
    return path is None or getattr(owner, INT8_PATH_ATTR, None) == path


def _held_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds but its KV cache, by a readable label: ``parameter <name>``,
    ``buffer <name>``, and ``attribute``/``unread`` for tensor attributes (also inside tuples) of
    the modules, their quantization method and scheme and the scheme's kernel (``unread``: left by
    a GEMM path the kernel no longer runs). Each tensor once (a tied Parameter under its first
    name). The KV cache is not weights: each request writes its blocks before reading them."""
    held: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def add(label: str, t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta and id(t) not in seen:
            seen.add(id(t))
            held[label] = t

    for name, p in model.named_parameters():
        add(f"parameter {name}", p)
    for name, b in model.named_buffers():
        add(f"buffer {name}", b)
    for name, module in model.named_modules():
        owners = {"": module, **{f".{a}": getattr(module, a, None) for a in _TENSOR_OWNERS}}
        owners[".scheme.kernel"] = getattr(owners[".scheme"], "kernel", None)
        for suffix, owner in owners.items():
            for attr, value in (vars(owner) if owner is not None and hasattr(owner, "__dict__") else {}).items():
                if attr in ("_parameters", "_buffers", "_modules", "kv_cache"):
                    continue
                kind = "attribute" if _read_by_forward(owner, attr) else "unread"
                for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                    add(f"{kind} {name}{suffix}.{attr}[{i}]", t)
    return held


@torch.no_grad()
def _garble(t: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite in place with what freed memory may hold: NaN floats, random integer codes."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.copy_(torch.randint(0, 2, t.shape, generator=gen).bool())
    else:
        info = torch.iinfo(t.dtype)
        t.copy_(torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), t.shape, generator=gen).to(t.dtype))


class Level2SleepProbe(SettingsProbe, QurlWorkerExtension):
    """The production extension, plus a simulated level-2 sleep and a record of the model's tensors."""

    def probe_kv_cache_scales(self) -> dict[str, list[float]]:
        """Mean of each attention layer's q/k/v/prob KV-cache scale tensors."""
        return {name: [float(getattr(m, a).float().mean()) for a in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale")]
                for name, m in self.model_runner.model.named_modules() if hasattr(m, "_k_scale")}

    def probe_ties_lm_head(self) -> bool:
        return tied_output_embedding(self.model_runner.model) is not None

    def probe_snapshot(self) -> int:
        self._probe_snapshot = {k: t.detach().clone() for k, t in _held_tensors(self.model_runner.model).items()}
        return len(self._probe_snapshot)

    def probe_changed_since_snapshot(self) -> list[str]:
        """Labels whose tensor is not bit-identical to the snapshot (or that appeared or vanished)."""
        now = _held_tensors(self.model_runner.model)
        snap = self._probe_snapshot
        differ = [k for k in now.keys() & snap.keys()
                  if now[k].dtype != snap[k].dtype or now[k].shape != snap[k].shape
                  or not torch.equal(now[k].detach(), snap[k])]
        return sorted(differ + list(now.keys() ^ snap.keys()))

    def probe_level2_sleep(self) -> dict[str, int]:
        """``sleep(level=2)`` then ``wake_up()`` as vLLM's GPU worker does them, on the host."""
        model = self.model_runner.model
        saved = {name: b.cpu().clone() for name, b in model.named_buffers()}  # sleep: buffers to the host
        held = _held_tensors(model)
        gen = torch.Generator().manual_seed(2)
        for t in held.values():  # the freed weight memory, mapped again on wake-up, uninitialized
            _garble(t.data, gen)
        for name, b in model.named_buffers():  # wake_up: buffers back
            b.data.copy_(saved[name])
        kinds = [label.split(" ", 1)[0] for label in held]
        return {kind: kinds.count(kind) for kind in ("parameter", "buffer", "attribute", "unread")}
