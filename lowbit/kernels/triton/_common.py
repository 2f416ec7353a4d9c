"""What every Triton kernel file shares: the interpreter flag, exact rounding, dtypes."""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

# Read once, when the kernels are decorated: triton.jit decides then whether a kernel
# compiles for the GPU or runs in the interpreter.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)
_INTERPRET = tl.constexpr(INTERPRET)

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
             torch.float64: tl.float64}


def dot_dtype(x_dtype: torch.dtype):
    """Operand type of tl.dot for float activations of ``x_dtype``.

    16-bit activations go to the tensor cores as they are; weight codes (at most 8
    bits) are exact in bf16/fp16, so the products are exact and only the float32
    accumulation rounds.  float32 activations use float32 operands (tf32x3 on the
    GPU, see ``dot_precision``).  The interpreter multiplies bf16 operands as raw
    uint16 (a Triton interpreter bug), so under it every dot runs in float32, which
    gives the same products: they are exact in both."""
    if INTERPRET or x_dtype == torch.float32:
        return tl.float32
    return TL_DTYPES[x_dtype]


# float32 activations: tf32x3 splits x into two tf32 parts on the tensor cores; codes
# are exact in tf32, so the only error is the lost tail |x - hi - lo| <= 2^-21 |x|.
DOT_PRECISION_F32 = "tf32x3"


@lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 132, an H100, off the GPU)."""
    if device.type != "cuda":
        return 132
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column indices of this program's BLOCK_M x BLOCK_N output tile, programs in
    grouped order (Triton tutorial 03): GROUP_M row blocks run next to each other and
    share each weight tile in L2."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def round_half_even(v):
    """torch.round (half to even) for |v| < 2^21 in float32 (2^50 in float64): adding
    and subtracting 1.5 * 2^23 (2^52) leaves the float rounded to an integer by the
    hardware's round-to-nearest-even.  Larger |v| are clamped to +-2^21 first (callers
    clamp the result to a code range far inside that).  The interpreter has no rint."""
    if v.dtype == tl.float64:
        v = tl.minimum(tl.maximum(v, -1125899906842624.0), 1125899906842624.0)
        return (v + 6755399441055744.0) - 6755399441055744.0
    else:
        v = tl.minimum(tl.maximum(v, -2097152.0), 2097152.0)
        return (v + 12582912.0) - 12582912.0


@triton.jit
def cast_rn(v, dtype: tl.constexpr):
    """``v.to(dtype)``, rounding to nearest even as the GPU (and torch) does.  The
    interpreter truncates float32 -> bfloat16, so there the rounding is done on the
    bits: add 0x7FFF plus the lowest kept bit, keep the high half."""
    if _INTERPRET:
        if dtype == tl.bfloat16:
            b = v.to(tl.float32).to(tl.uint32, bitcast=True)
            b = b + 0x7FFF + ((b >> 16) & 1)
            return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(dtype)
    else:
        return v.to(dtype)


@triton.jit
def div_exact(a, b):
    """a / b correctly rounded (Triton's float32 ``/`` is an approximate division)."""
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def code_plane(words, J: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Field J of each int32 word (bits BITS*J .. BITS*J + BITS - 1, lowbit.scheme's
    little-endian packing; J = 0 and BITS = 8 for one code per byte) as exact float32.

    No int -> float conversion instruction (a quarter of the FMA rate on NVIDIA GPUs,
    the bound of a 4-bit GEMV): the field u, offset into [0, 2^BITS) for signed codes,
    becomes the low mantissa bits of 2^23, so the float is 2^23 + u, and 2^23 (plus the
    offset) comes off exactly."""
    u = (words >> (BITS * J)) & ((1 << BITS) - 1)
    if SIGNED:
        u = u ^ (1 << (BITS - 1))  # two's complement field + 2^(BITS-1)
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
    else:
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def interleave8(p0, p1, p2, p3, p4, p5, p6, p7):
    """[R, W] planes p_j -> [R, 8W] with out[:, 8w + j] = p_j[:, w]: the codes of u32x8
    words in K order.  tl.interleave (join + reshape) keeps each new pair in one thread's
    registers, so there is no shared-memory layout conversion (the [R, W, 8] reshape of
    ``unpack_words`` has one).  With j = 4a + 2b + c: interleave(e0, e1)[2i + c] = e_c[i],
    and the same rule one and two levels down gives e_c[4w + 2a + b] = p_{4a + 2b + c}[w]."""
    e0 = tl.interleave(tl.interleave(p0, p4), tl.interleave(p2, p6))
    e1 = tl.interleave(tl.interleave(p1, p5), tl.interleave(p3, p7))
    return tl.interleave(e0, e1)


@triton.jit
def unpack_words(words, BITS: tl.constexpr, PER_WORD: tl.constexpr, SIGNED: tl.constexpr):
    """[R, W] words -> [R, W * PER_WORD] int32 codes, value j of a word in bits
    BITS*j .. BITS*j + BITS - 1 (lowbit.scheme's little-endian packing)."""
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    shifts = tl.arange(0, PER_WORD) * BITS
    v = (words.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    if SIGNED:
        v = v - ((v >> (BITS - 1)) << BITS)
    return tl.reshape(v, (R, W * PER_WORD))
