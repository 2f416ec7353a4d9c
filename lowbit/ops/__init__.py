"""Public operators.  Each validates its arguments, then calls a ``lowbit::*`` custom
op (``torch.ops.lowbit``) that runs on the chosen backend."""

from .accumulator import dequantize_accumulator
from .matmul import linear, linear_qta8a_qga4w_qta8o, quantized_matmul
from .pack import pack_bits, pack_int4, unpack_bits, unpack_int4
from .per_token import dequantize_per_token, quantize_per_token
from .quant import choose_qparams, dequantize, fake_quantize, quantize
from .split import choose_outliers, split_quantize

__all__ = [
    "choose_qparams", "quantize", "dequantize", "fake_quantize",
    "pack_bits", "unpack_bits", "pack_int4", "unpack_int4",
    "quantize_per_token", "dequantize_per_token", "dequantize_accumulator",
    "quantized_matmul", "linear", "linear_qta8a_qga4w_qta8o", "split_quantize", "choose_outliers",
]
