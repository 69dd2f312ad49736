"""QuRL numerics, pure torch: 8-bit formats, W8A8 matmuls, compressed-tensors emission, UAQ, update visibility.

Nothing here imports verl or vLLM, so the trainer, the rollout worker and the tests share one
definition of "the quantized actor".
"""
from .compressed_tensors_format import (
    DEFAULT_IGNORE,
    DEFAULT_TARGET_MODULES,
    compressed_tensors_config,
    is_quantization_target,
    quantize_state_dict,
)
from .formats import FP8_E4M3, INT8, QuantFormat, activation_format, int_format, resolve_format
from .linear import W8A8Linear, quantize_linear_modules_
from .matmul import fp8_scaled_matmul, int8_matmul_accumulate, w8a8_linear, w8a8_linear_reference
from .quantizer import QuantizedTensor, fake_quantize, quantize
from .uaq import SUPPORTED_MODEL_TYPES, apply_uaq, apply_uaq_to_state_dict, uaq_record
from .update_visibility import UpdateStats, UpdateVisibilityTracker, tensor_update_stats, update_visibility

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_TARGET_MODULES",
    "FP8_E4M3",
    "INT8",
    "QuantFormat",
    "QuantizedTensor",
    "SUPPORTED_MODEL_TYPES",
    "UpdateStats",
    "UpdateVisibilityTracker",
    "W8A8Linear",
    "activation_format",
    "apply_uaq",
    "apply_uaq_to_state_dict",
    "compressed_tensors_config",
    "fake_quantize",
    "fp8_scaled_matmul",
    "int8_matmul_accumulate",
    "int_format",
    "is_quantization_target",
    "quantize",
    "quantize_linear_modules_",
    "quantize_state_dict",
    "resolve_format",
    "tensor_update_stats",
    "uaq_record",
    "update_visibility",
    "w8a8_linear",
    "w8a8_linear_reference",
]
