"""QuRL numerics, pure torch: 8-bit formats, W8A8 matmuls, compressed-tensors emission, UAQ, update visibility.

Every quantizing entry point takes one ``QuantScheme`` (codes, granularity, block size), e.g.
``quantize(w, INT8_CHANNEL)`` or ``quantize_state_dict(weights, FP8_BLOCK)``; ``parse_scheme("fp8", "block")``
is the one reader of names, for command lines and config values.

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
from .formats import FP8_E4M3, INT8, Granularity, QuantFormat, activation_format, int_format
from .linear import W8A8Linear, quantize_linear_modules_
from .matmul import fp8_scaled_matmul, int8_matmul_accumulate, w8a8_linear, w8a8_linear_reference
from .quantizer import QuantizedTensor, fake_quantize, quantize
from .scheme import FP8_BLOCK, FP8_CHANNEL, FP8_GROUP, FP8_TOKEN, INT8_CHANNEL, INT8_TOKEN, QuantScheme, parse_scheme
from .uaq import SUPPORTED_MODEL_TYPES, apply_uaq, apply_uaq_to_state_dict, uaq_record
from .update_visibility import UpdateStats, UpdateVisibilityTracker, tensor_update_stats, update_visibility

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_TARGET_MODULES",
    "FP8_BLOCK",
    "FP8_CHANNEL",
    "FP8_E4M3",
    "FP8_GROUP",
    "FP8_TOKEN",
    "INT8",
    "INT8_CHANNEL",
    "INT8_TOKEN",
    "Granularity",
    "QuantFormat",
    "QuantScheme",
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
    "parse_scheme",
    "tensor_update_stats",
    "uaq_record",
    "update_visibility",
    "w8a8_linear",
    "w8a8_linear_reference",
]
