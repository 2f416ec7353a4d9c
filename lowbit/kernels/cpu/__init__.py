"""The ``"cpu"`` backend: the C++ extension ``lowbit._C`` (built at install time with
torch's cpp_extension; OpenMP threads, AVX-512 through the compiler where the machine
has it) plus packing in word-wide integer torch ops.  Configurations its kernels do not
cover (3-bit codes, float64 matmuls) go to the reference implementation.

Which kernel runs for a matmul is decided in one place, ``CpuBackend.plan``; the C++
entry points run exactly the kernel they are asked for.
"""

from __future__ import annotations

import os
import sys
import threading
from functools import lru_cache

import torch

from ...scheme import QuantScheme
from .. import packing as word_packing
from .. import reference
from ..interface import Backend, Plan

try:  # built by setup.py; absent when installed with LOWBIT_NO_EXT=1 or without a compiler
    from lowbit import _C  # type: ignore[attr-defined]

    _LOAD_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the install
    _C = None
    _LOAD_ERROR = f"the C++ extension lowbit._C did not load: {e}"


def available() -> bool:
    return _C is not None


def load_error() -> str | None:
    return _LOAD_ERROR


# -- the plan's thresholds ---------------------------------------------------------------
# Rows of W dequantized per tile: about 4 MiB of float weight, which stays in the L3
# between the dequantize and the matmul, or as many rows as x has (a tile no larger than
# x), so no float copy of W much larger than the activation is ever made.  Fewer, larger
# tiles mean fewer GEMM calls and copies into y; 1536x576 int4, Zen 2, 2 threads (ms):
#   M=16: 0.90 / 0.72 / 0.66 / 0.52 at 256 KiB / 512 KiB / 1 MiB / 4 MiB (float32 GEMM 0.49)
#   M=32: 1.04 / 0.88 / 0.82 / 0.66 (0.50);  49152x576 M=32: 32.0 / 27.1 / 24.5 / 21.3 (26.0)
TILE_BYTES = 4 << 20
# Where AMX runs, amx_linear.cpp's weight_only_gemm_bf16_amx (each block of 32 weight rows
# dequantized once per call into bf16 A tiles as stored, the rows of x packed into B tiles;
# the bits of the gemm_bf16.cpp panels it replaced, 1.6-2.4x them for 4-bit at 1-32 rows,
# 1.2-1.5x at 64-256, 8-bit 0.94-1.3x) against the panels before it (first figure), bf16 tiles
# through torch.mm and a bf16 F.linear of the float weight, AVX-512 Xeon with AMX, 2 threads (ms):
#   1536x576 g64 4-bit: M=8 0.13 / 0.29 / 0.07, M=32 0.16 / 0.31 / 0.10, M=128 0.25 / 0.39 / 0.16,
#                       M=512 0.69 / 0.66 / 0.42
#   576x1536 g128:      M=8 0.12 / 0.21 / 0.07, M=128 0.25 / 0.32 / 0.16, M=512 0.72 / 0.61 / 0.44
#   1536x576 8-bit:     M=8 0.08 / 0.17 / 0.07, M=128 0.19 / 0.29 / 0.16, M=512 0.63 / 0.61 / 0.64
# From 128 rows the kernel packs each weight block as B tiles and reads x's rows as stored,
# and for bf16 x it rounds its sums to bf16 itself (no float32 y to convert): against the
# tiles through torch.mm and a bf16 F.linear of the float weight, median ms, same machine:
#   1536x576 4-bit: M=256 0.63 / 1.47 / 1.05, M=512 1.16 / 2.60 / 2.29, M=1280 5.6 / 6.1 / 6.5
#   576x1536 4-bit: M=256 0.86 / 1.86 / 1.50, M=512 1.59 / 2.93 / 2.56, M=1280 4.7 / 12.0 / 11.4
#   1536x576 4-bit: M=2048 7.5 / 5.5 / 4.8;  576x1536 M=2048 6.2 / 5.4 / 4.9
# Beyond ~1-2k rows x outgrows the L2 and each block of weight rows reads it from the L3 again.
AMX_BF16_GEMM_MAX_M = 1024
# Where torch's bf16 GEMM runs on AMX tiles (oneDNN) it beats gemm_bf16.cpp by far, so bf16
# GEMMs go to dequantized bf16 tiles and torch.mm there (``_amx``); 512 rows, AVX-512 Xeon
# with AMX, 2 threads (ms): 1536x576 int4 g64 7.40 vs 1.46 (bf16 F.linear on the float
# weight: 1.07), int8 5.76 vs 0.61; 576x1536 int4 6.59 vs 0.80.
# The decode kernels (gemv_bf16.cpp, matmul.cpp: the packed weight unpacked in registers
# for every 4 rows) against the GEMM (gemm_bf16.cpp: unpacked once per call into bf16
# panels), 4096x4096, 2 threads, weights cold, Zen 5 (ms):
#   4-bit, bf16 x:     M=3 0.59 vs 0.82, M=4 0.75 vs 0.79, M=5 0.90 vs 0.83, M=6 1.02 vs 0.84
#   4-bit, float32 x:  M=2 0.53 vs 1.03, M=3 1.07 vs 1.05 (x split into two bf16 parts up
#                      to SPLIT_MAX_M rows, float32 FMAs beyond)
#   8-bit, any x:      M=1 0.57 vs 0.88, M=2 1.10-1.20 vs 0.63-0.84
# float32 x at the matmul precision "highest" has no bf16 GEMM: float32 FMAs up to
# GEMV_MAX_M rows (M=4 0.62 vs 1.18 ms for float32 tiles through torch.mm, M=8 1.85 vs 1.49).
# Beyond, where AMX runs and the zero points are integers (or mins: q * s + m), amx_linear.cpp's gemm_f32_amx (x in
# three bf16 parts, every product exact, three tile products per step where bf16 x takes one)
# against the float32 tiles through torch.mm and F.linear on the float32 weight, AVX-512 Xeon
# with AMX (whose tile products ran 30-70 ns in this VM), 2 threads, 4-bit, median ms:
#   1536x576 g64:  M=7 0.31 / 0.52 / 0.21, M=32 0.46 / 1.01 / 0.71, M=128 1.16 / 1.69 / 1.44,
#                  M=512 2.64 / 4.58 / 4.27
#   576x1536 g128: M=7 0.33 / 0.42 / 0.20, M=32 0.41 / 0.86 / 0.71, M=512 2.78 / 4.55 / 4.40
#   192x576 g64:   M=7 0.061 / 0.063 / 0.035, M=128 0.24 / 0.29 / 0.24, M=512 0.52 / 0.66 / 0.59
# (before exact_few_rows below 64 rows, 1.1-1.5x faster at 8-32 rows since).
GEMV_MAX_M = 6
SPLIT_MAX_M = 2
# A vdpbf16ps does 32 multiply-adds, a 512-bit FMA 16.  On Zen 4 both issue about once a
# cycle, so gemm_bf16's bf16 dot products do twice the work of FMAs; on the AVX-512 Xeon
# without AMX (family 6 model 207) a vdpbf16ps takes 4.0 FMAs' time (bf16_dot_cost: 0.72
# against 0.18 ns), so float32 FMAs on the same bf16 values, widened (gemm_fma), do ~2x the
# multiply-adds a cycle, for panels of twice the bytes: that side runs where a dot costs
# more than BF16_DOT_SLOW x two FMAs, over FMA_GEMM_MIN_M rows.  There, 2 threads, 4-bit g64
# (g128 at K = 1536), ms gemm_bf16 / gemm_fma (MKL's float32 sgemm on the float weight):
#   M=512: 576x576 2.20 / 1.25 (1.24), 192x576 0.69 / 0.62 (0.39), 1536x576 5.47 / 3.32 (3.09),
#          576x1536 5.52 / 3.15 (3.12)
#   M=64:  0.35 / 0.29, 0.12 / 0.12, 0.92 / 0.65, 0.84 / 0.66;  M=32: 0.19 / 0.17, 0.07 / 0.09,
#          0.48 / 0.40, 0.45 / 0.36;  M=16: 0.10 / 0.12, 0.04 / 0.06, 0.28 / 0.28, 0.25 / 0.26
# (at up to 64 rows gemm_bf16 is its rows path, dots.h).  A 512-token prefill of the bf16
# model, in-process A/B: w4a16-g128 1.30x, w4a16-g64 1.30x, w8a16 1.45x, q4_0 1.26x, q8_0
# 1.46x, q4_1 1.23x.  Chunks of K other than KC_MAX (128-384) were level or slower.
BF16_DOT_SLOW = 1.25
FMA_GEMM_MIN_M = 32
# 4-bit weights with bf16 x: gemv_bf16 up to this many rows, then the GEMM path (gemm_bf16,
# or bf16 tiles through torch.mm on AMX).  4 on Zen 5 (above); on an AVX-512 Xeon with AMX
# against the AMX tiles, 2 threads (us, 1536x576 / 576x1536 int4 g64): M=4 125/111 vs
# 349/330, M=8 232/198 vs 345/335, M=16 459/383 vs 359/363, M=32 843/746 vs 374/382.
# Calibrated per machine (``calibration.py``).
GEMV_BF16_MAX_M = 4
# Where AMX runs (and its shape fits), 4-bit weights with bf16 x run gemv_bf16 up to
# AMX_GEMV_BF16_MAX_M rows (calibrated per machine), then gemv_amx.cpp's gemv_bf16_amx up to
# GEMV_BF16_AMX_MAX_M (gemv_bf16's arithmetic, the codes as bf16 A tiles, x in the B
# tiles, one pass over the weights per 16 rows of x); against gemv_bf16 and gemm_bf16_amx,
# AVX-512 Xeon with AMX, 2 threads, in-process alternating medians (us):
#   1536x576 g64:  M=1 35 / 37 / 77, M=2 51 / 63 / 78, M=3 52 / 84 / 73, M=4 49 / 94 / 73,
#                  M=8 55 / 176 / 77, M=16 62 / 404 / 93, M=32 160 / 928 / 151
#   576x1536 g128: M=1 36 / 37 / 86, M=2 77 / 66 / 88, M=3 64 / 83 / 79, M=4 57 / 77 / 69,
#                  M=8 60 / 145 / 71, M=16 96 / 395 / 109
#   576x576 g32:   M=1 32 / 22 / 58, M=3 36 / 38 / 44, M=4 34 / 40 / 43, M=8 37 / 76 / 45,
#                  M=16 54 / 202 / 64
#   200x576 g64:   M=1 12 / 12 / 24, M=3 19 / 17 / 20, M=4 19 / 21 / 21, M=8 20 / 34 / 21
# At one or two rows it is level with gemv_bf16 or behind (its tile loads and per-group
# stores cost the same for 1 row as for 16), from 3 ahead of both.  Cycling through 120
# copies of the 1536x576 weight (L3, not L2): M=4 88 / 142 / 110, M=8 100 / 260 / 109,
# M=16 105 / 526 / 129.  In a batch's decode step (against amx_linear.cpp's tiles on the
# step's bf16 buffers, no tensors) SmolLM2 w4a16-g64, generate() of 16 tokens, in-process
# A/B: 4 prompts 1.10-1.14x, 8 0.97-0.99x, 16 0.88-1.02x.  Its sums are gemv_bf16's, exact
# products of the codes (no bf16 rounding of the dequantized weight, which gemm_bf16_amx
# makes): largest error against float64 over those shapes 1.4e-6 - 1.1e-5 (gemv_bf16's
# 3.6e-6 - 2.2e-5), gemm_bf16_amx's 1.8e-3 - 5.6e-3.
AMX_GEMV_BF16_MAX_M = 2
GEMV_BF16_AMX_MAX_M = 16
# W4A8 beyond a few rows: gemm_int8.cpp's panels (codes unpacked once per call, not once
# per 4 rows); 4096x4096 g128 on Zen 5, 2 threads: M=4 0.38 vs 0.58 ms, M=6 0.87 vs 0.61,
# M=16 1.50 vs 0.82, M=128 12.9 vs 3.7 (bf16 torch.matmul: 5.2).
W4A8_ROWS_MAX_M = 4
# Where AMX runs, beyond those rows gemm_amx.cpp's w4a8_gemm_amx (the same integers on int8
# tiles, floats once per group) against the panels and a bf16 F.linear of the shape, AVX-512
# Xeon with AMX, 2 threads (ms):
#   1536x576 g64:  M=32 0.37 / 0.16 / 0.16, M=128 0.83 / 0.34 / 0.29, M=512 3.0 / 1.5 / 1.1
#   576x1536 g128: M=32 0.39 / 0.12 / 0.17, M=128 1.17 / 0.30 / 0.41, M=512 4.1 / 1.1 / 1.2
# and since its panels hold u - z and each group's integer takes one fnmadd (the same bits),
# the same VM kind, medians of alternating runs:
#   1536x576 g64:  M=32 0.29 / 0.17 / 0.19, M=128 0.91 / 0.36 / 0.53, M=512 2.44 / 0.92 / 1.27
#   576x1536 g128: M=32 0.31 / 0.16 / 0.23, M=128 0.65 / 0.35 / 0.53, M=512 2.19 / 1.21 / 1.27
# and the rows kernel against it (us): 1536x576 M=4 59 / 79, M=6 123 / 82; 576x1536 M=4 42 / 75,
# M=6 75 / 75, M=8 73 / 76: the same threshold (since: M=4 73 / 105-118, M=5 97-113 / 116-120,
# M=6 129-135 / 122-129, still).
# Without AVX-512 VNNI (AVX2: vpmaddubsw + vpmaddwd for the same exact integers), the rows
# kernel against float32 weight tiles through torch.mm (x - x_zp exact in float32), Zen 2,
# 2 threads (ms): 1536x576 g64 M=16 0.34 vs 0.54, M=64 1.26 vs 1.44, M=128 2.46 vs 2.16,
# M=512 10.1 vs 5.9; 576x1536 g128 M=64 0.84 vs 1.21, M=128 1.64 vs 1.97, M=512 7.6 vs 5.6.
# (torch._int_mm per group, the route before: 2.5-7 ms at M=1-16 on those shapes.)  Those
# tiles are replaced by gemm_a8.cpp's u8 panels (the codes unpacked once, vpmaddubsw
# register tiles, the same exact integers), against the rows kernel, the tiles and F.linear
# of the same shape in float32, best of 9 alternating rounds (ms):
#   1536x576 g64:  M=16 0.22 / 0.54 / 0.85 / 0.53, M=64 0.68 / 2.23 / 1.52 / 1.14,
#                  M=512 5.4 / 18.9 / 7.8 / 7.0
#   576x1536 g128: M=16 0.24 / 0.24 / 1.37 / 0.61, M=128 0.91 / 2.02 / 2.75 / 1.95,
#                  M=512 4.2 / 11.9 / 7.8 / 6.1
W4A8_AVX2_ROWS_MAX_M = 16
# W8A8 for one row: torch._int_mm's GEMV beats gemm_int8.cpp (4096x4096 on Zen 5: 0.17 vs
# 0.46 ms); from two rows on it is 4x slower (1.32 vs 0.34 ms).  gemm_int8.cpp's int8_mm_rows
# beats both at one row on an AVX-512 Xeon (Sapphire Rapids class, 2 threads, us):
# 1536x576 41 vs 69 (_int_mm), 576x1536 37 vs 49, SmolLM2's 49152x576 head 1342 vs 2670.
INT8_GEMM_MIN_M = 2
# Where AMX runs, torch._int_mm (oneDNN's int8 gemm_api: ONEDNN_VERBOSE shows its VNNI GEMM, not
# the AMX brgemm matmul a bf16 F.linear gets) with the composed epilogue gives the same
# bits as gemm_int8.cpp and is faster from 32 rows on; AVX-512 Xeon with AMX, 2 threads
# (ms, fused gemm_int8 vs composed _int_mm):
#   1536x576: M=16 0.050 vs 0.074, M=32 0.084 vs 0.068, M=128 0.200 vs 0.143, M=512 0.72 vs 0.55
#   576x1536: M=16 0.061 vs 0.049, M=32 0.087 vs 0.061, M=128 0.239 vs 0.128, M=512 0.88 vs 0.30
#   576x576:  M=32 0.037 vs 0.037, M=512 0.33 vs 0.14;  192x576 M=512 0.14 vs 0.06
AMX_INT_MM_MIN_M = 32
# amx_linear.cpp's int8_linear_amx (AMX int8 tiles, K a multiple of 64: the weight read as
# stored into A tiles, the rows packed into B tiles, the epilogue fused) gives torch._int_mm's
# integers and gemm_int8's bits; against the fused gemm_int8 and torch._int_mm without its
# epilogue, same machine, 2 threads, weights cycled through 40 MB (us, gemm_int8 / amx / _int_mm):
#   1536x576: M=2 53 / 46 / 96, M=8 68 / 48 / 95, M=32 118 / 67 / 93, M=128 329 / 188 / 277,
#             M=512 1259 / 722 / 1138, M=1280 3006 / 1944 / 2135
#   576x1536: M=2 55 / 41 / 85, M=32 115 / 64 / 78, M=512 1197 / 504 / 933
#   576x576:  M=8 32 / 21 / 46, M=32 50 / 29 / 43;  192x576: M=8 22 / 13 / 27, M=512 283 / 135 / 99
# (the kernel before it, int8_mm_amx with the weight packed per call past 64 rows and the
# epilogue composed, was 1443 / 1007 / 1383 at 1536x576 M=512).
# One row stays on int8_rows (48 / 37 / 81 for 1536x576 composed, and the decode step runs
# it on pointers, without the tensors).
AMX_INT8_MIN_M = 2
# Without AVX-512 VNNI (an AVX2-only Zen 2) torch._int_mm has no fast int8 GEMM: 4096 x 576
# @ 576 x 1536 takes 1.18 s against 0.05 s for the same float32 GEMM.  int8 x int8
# products are at most 128 * 128 = 2^14 in magnitude, so every partial sum of a dot
# product over at most F32_EXACT_K columns is at most 2^24: an integer float32 holds
# exactly, whatever the summation order.  Float32 GEMMs over K chunks of that size,
# converted to int32 and summed, give exactly torch._int_mm's result.
F32_EXACT_K = 1024
# For a few rows, gemm_int8.cpp's int8_mm_rows (int16 vpmaddwd, exact int32) against
# torch._int_mm / those float32 chunks, same machine, 2 threads (ms):
#   1536x576: M=1 0.026 vs 0.29 / 0.23, M=16 0.12 vs 4.5 / 0.58, M=128 1.34 vs - / 1.74,
#             M=512 7.3 vs - / 9.6;  576x1536 M=512: 6.7 vs - / 5.5;  4096x4096 M=1 0.63 vs 5.3 / 4.6
# Beyond, gemm_i16.cpp's int8_mm_panels (the weight widened once into int16 panels), against
# int8_mm_rows and F.linear of the same shape in float32, best of 9 alternating rounds (ms):
#   1536x576: M=16 0.14 / 0.12 / 0.48, M=32 0.24 / 0.34 / 0.63, M=128 0.86 / 1.39 / 1.67,
#             M=512 3.4 / 7.8 / 5.6;  576x1536: M=16 0.15 / 0.17 / 0.40, M=512 3.4 / 7.4 / 5.2
INT8_ROWS_MAX_M = 16


# Without AVX-512 (AVX2 + FMA: the 8-lane decode kernels of matmul.cpp, no bf16 dot
# products) against float32 weight tiles through torch.mm, 1536 x 576, 2 threads, weights
# cycled through more than the L3, AVX2-only Zen 2 (ms):
#   4-bit: M=4 0.10-0.12 vs 0.52-0.55, M=16 0.34 vs 0.58-0.66, M=64 1.72-1.87 vs 1.17-1.38
#   8-bit: M=4 0.10 vs 0.36, M=16 0.52 vs 0.48, M=64 1.35 vs 1.23
# and bf16 tiles lose to float32 ones there at every M (M=64: 6.8-7.2 vs 1.2-1.4 ms).
AVX2_GEMV_MAX_M = {4: 16, 8: 8}
# Activations in int8 blocks (gemv_a8.cpp, vpmaddubsw / vpmaddwd per block of 32) against
# the same blocks dequantized and multiplied with float32 weight tiles, same setup (ms):
#   4-bit: M=1 0.04 vs 0.33-0.37, M=16 0.37-0.47 vs 0.58-0.66, M=64 1.27-1.80 vs 1.17-1.38
#   8-bit: M=1 0.04 vs 0.27, M=16 0.29 vs 0.48, M=64 0.96 vs 1.23
# The same after the kernel's prefetch and shift fixes (weights hot, Zen 2, ms): 1536x576
# 4-bit M=64 0.87 vs 1.50, M=128 1.78 vs 2.35, M=256 3.64 vs 3.65; 576x1536 M=128 1.62 vs
# 2.04; 8-bit 1536x576 M=128 1.95 vs 2.01.
# With AVX-512 VNNI (no AMX) the GEMM path is gemm_a8_vnni.cpp (the codes unpacked once per
# call into panels of 32 columns, vpdpbusd register tiles of 6 rows, the AVX2 panels' bits);
# the rows kernel / the AVX2 panels (gemm_a8.cpp, gemm_i16.cpp) / the VNNI panels / a bf16
# F.linear of the same shape (oneDNN, AVX512-BF16), Zen 4, 2 threads, weights hot, median
# of 7 alternating rounds (ms):
#   4-bit 1536x576: M=4 0.065 / 0.090 / 0.099, M=8 0.102 / 0.086 / 0.107, M=12 0.146 / 0.108 / 0.119,
#                   M=16 0.24 / 0.17 / 0.17 / 0.28, M=64 0.90 / 0.45 / 0.32 / 0.50,
#                   M=512 6.7 / 2.9 / 2.1 / 2.4
#   4-bit 576x1536: M=8 0.078 / 0.082 / 0.092, M=12 0.139 / 0.125 / 0.113, M=512 6.8 / 3.2 / 1.9 / 2.4
#   8-bit 1536x576: M=4 0.057 / 0.087 / 0.066, M=6 0.107 / 0.095 / 0.073, M=16 0.37 / 0.29 / 0.24 / 0.37,
#                   M=512 11.9 / 7.0 / 2.4 / 3.0
#   8-bit 576x1536: M=4 0.080 / 0.103 / 0.088, M=6 0.133 / 0.128 / 0.101, M=512 12.5 / 7.1 / 2.6 / 2.8
# (the path before it, the blocks dequantized into float32 weight tiles through torch.mm:
# 7.0-9.0 ms at M=512).
A8_ROWS_MAX_M = {4: 8, 8: 4}
# 4-bit codes beyond it run gemm_a8.cpp (codes unpacked once into panels, vpmaddubsw register
# tiles); against the rows kernel / the float32 tiles / a float32 F.linear of the same shape
# (weights hot, Zen 2, 2 threads, ms):
#   1536x576: M=16 0.19 / 0.40 / 0.99 / 0.42, M=32 0.20 / 0.45 / 0.87 / 0.55,
#             M=128 0.68 / 1.76 / 1.78 / 1.49, M=512 2.86 / 7.84 / 6.12 / 5.53
#   576x1536: M=16 0.18 / 0.21 / 0.65 / 0.33, M=512 2.90 / 6.85 / 6.30 / 6.43
# 8-bit codes beyond it run gemm_i16.cpp (int16 panels, vpmaddwd: no faster per instruction
# than float32 FMAs, but no float copy of the weight or x); against the rows kernel and
# F.linear, best of 9 alternating rounds (ms):
#   1536x576: M=16 0.25 / 0.25 / 0.48, M=32 0.44 / 0.43 / 0.63, M=512 6.3 / 7.7 / 5.6
#   576x1536: M=16 0.25 / 0.22 / 0.40, M=32 0.44 / 0.51 / 0.59, M=512 6.4 / 8.5 / 5.2
AVX2_A8_ROWS_MAX_M = {4: 8, 8: 16}
# Where AMX runs, the GEMM path beyond the rows kernel is gemm_amx.cpp's int8 tiles; the rows
# kernel against it, AVX-512 Xeon with AMX (family 6 model 207 VM), 2 threads, alternating (us),
# since the tiles take the weight rows as A (packing without a transposition):
#   4-bit 1536x576 g64:  M=1 36 / 89, M=2 65 / 91, M=4 110 / 90, M=6 152 / 82, M=8 149 / 79
#   4-bit 576x1536 g128: M=1 39 / 80, M=2 70 / 86, M=4 93 / 82, M=6 154 / 87, M=8 177 / 90
#   8-bit 1536x576 g64:  M=1 52 / 86, M=2 69 / 73, M=4 105 / 83, M=6 154 / 80, M=8 196 / 85
# (before, with the weight as B: 4-bit M=4 64 / 91, M=8 120 / 94; the rows up to 6 then).
# At one row, 4-bit codes take gemv_a8_vnni.cpp's vpdpbusd over 16 weight rows instead of the
# tiles (the same bits; the tiles' 16-row path there 81-86 us); against the rows kernel, f16
# scales, group 32, us (weights in L2 / in the L3: 60-120 weights cycled):
#   1536x576:  23-30 / 21-26,    L3 33-40 / 29-37
#   576x1536:  27-35 / 21-24,    L3 37-48 / 31-39
#   49152x576: 636-829 / 590-714
# and in decode steps (bf16 model, 48 tokens, alternating) q4_0-a8 1.07-1.10x the tokens/s,
# w4a16-g128-head8 act int8 (zero points, groups of 64 and 128) 1.12x, but q4_1 act int8 (zero
# points in groups of 32) 0.94-0.97x.  So one row of 4-bit codes runs a8_amx whatever these
# say (_a8_amx_row) except with zero points in groups of 32, and they decide from two rows on.
# 8-bit codes stay with the rows kernel: a tile version of the one-row kernel (x as a
# block-diagonal B tile, 16 blocks a tile product) took 1536x576 in 31-40 us against 42 with
# the weights in L2, but q8_0-a8 decoded at 0.85-0.87x with it.
AMX_A8_ROWS_MAX_M = {4: 3, 8: 1}
# A float32 nn.Linear in a decode step (float lm_head, float models): dense.cpp's
# dense_rows (each weight row read once, kept in L1 across x's rows) against at::linear
# (MKL: 12-14 GB/s for one row), 2 threads, weights cycled through more than the L3,
# AVX2-only Zen 2 (ms):
#   49152x576: M=1 3.86 vs 8.58, M=8 7.95 vs 19.1, M=32 19.4 vs 27.5
#   1536x576:  M=1 0.118 vs 0.268, M=8 0.249 vs 0.409, M=32 0.610 vs 0.663
#   576x1536:  M=1 0.104 vs 0.200, M=8 0.212 vs 0.376, M=32 0.571 vs 0.622
DENSE_ROWS_MAX_M = 32
# A bfloat16 nn.Linear in a decode step (the bf16 model, a bf16 lm_head): dense_rows on the
# bf16 values (widened exactly, float32 FMAs) against at::linear (oneDNN's bf16, AMX here),
# AVX-512 Xeon with AMX, 2 threads, weights cycled through more than the L3 (ms):
#   49152x576: M=1 3.27 vs 5.26, M=2 3.39 vs 4.46, M=4 4.34 vs 4.44, M=8 7.34 vs 4.82
#   1536x576:  M=1 0.129 vs 0.233, M=4 0.176 vs 0.225, M=8 0.271 vs 0.238
#   576x1536:  M=1 0.120 vs 0.228, M=4 0.164 vs 0.189, M=8 0.225 vs 0.193
DENSE_BF16_ROWS_MAX_M = 4
# Where AMX bf16 tiles run: amx_linear.cpp's dense_amx (the weight read as stored into the
# tiles, the rows packed per call) against oneDNN's bf16 linear and dense_rows, same machine,
# 2 threads, weights cycled through 80 MB (us, F.linear / dense_amx / dense_rows):
#   49152x576: M=1 3741 / 1622 / 2009, M=4 3146 / 1657 / 3445, M=8 3265 / 1643 / 6098,
#              M=16 3786 / 1805, M=32 5321 / 4001, M=64 8701 / 7672
#   1536x576:  M=1 203 / 109 / 104, M=8 161 / 107 / 218, M=32 231 / 182, M=64 333 / 251
#   576x1536:  M=1 167 / 83 / 89, M=8 137 / 86 / 196, M=32 206 / 144, M=64 273 / 224
#   576x576:   M=1 84 / 29 / 34, M=8 68 / 28 / 82, M=32 90 / 52;  192x576: M=8 57 / 17 / 39
# Measured up to 64 rows; beyond, torch's linear.
DENSE_AMX_MAX_M = 64
# Where AVX512-BF16 runs without AMX: dense.cpp's dense_dots (vdpbf16ps register tiles, the
# weight read as stored) for the rows past DENSE_BF16_ROWS_MAX_M, against oneDNN's bf16
# linear (which packs the weight on every call) and dense_rows, Zen 4, 2 threads, weights
# cycled through 96 MB (us, F.linear / dense_dots / dense_rows):
#   49152x576: M=1 4084 / 2485 / 2130, M=4 4190 / 2653 / 3066, M=8 5222 / 3201 / 5098,
#              M=16 5971 / 4172, M=32 8561 / 6795, M=64 13284 / 13103
#   1536x576:  M=4 162 / 82 / 95, M=8 171 / 99, M=16 225 / 124, M=32 282 / 223, M=64 420 / 393
#   576x1536:  M=4 152 / 96 / 150, M=8 156 / 119, M=32 261 / 194, M=64 450 / 336
#   576x576:   M=8 109 / 51, M=32 145 / 92, M=64 263 / 181
# Beyond 64 rows, torch's linear.
DENSE_DOTS_MAX_M = 64


def gemv_max_m(bits: int, dtype: torch.dtype) -> int:
    """Up to how many activation rows a weight-only matmul runs the decode kernels of
    AVX-512 and AVX2 registers (where AMX runs, 4-bit weights with bf16 x run gemv_bf16 up
    to ``AMX_GEMV_BF16_MAX_M`` rows instead, then gemv_bf16_amx, when their shape fits)."""
    return _gemv_max_m(bits, dtype, float32_exact(dtype))


def _gemv_max_m(bits: int, dtype: torch.dtype, exact: bool) -> int:
    if not _has_avx512():
        return AVX2_GEMV_MAX_M.get(bits, 0)
    if exact:
        return GEMV_MAX_M
    if bits == 8:
        return 1
    return GEMV_BF16_MAX_M if dtype == torch.bfloat16 else SPLIT_MAX_M


def float32_exact(dtype: torch.dtype) -> bool:
    """Whether float32 activations must get float32-accurate products: lowbit follows
    ``torch.set_float32_matmul_precision``.  At torch's default "highest" they do (float32
    FMAs, float32 tiles); at "high" or "medium" their dot products may run in bfloat16
    (x split in two bf16 parts at small M, rounded to bf16 at large M), 2-4x faster,
    as torch's own float32 matmuls may then use bf16/TF32."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"


_WEIGHT_ONLY_KERNELS = tuple(_C.weight_only_kernels()) if _C is not None else ()


def weight_only_kernel_index(kernel: str) -> int:
    """The index ``_C.weight_only_matmul`` (and the decode step) takes for a plan's kernel."""
    return _WEIGHT_ONLY_KERNELS.index(kernel)


def features() -> dict:
    """What the plan's choices rest on: the CPU's model name and its x86 flags that lowbit's
    kernels use (from /proc/cpuinfo, Linux), and the ones ``lowbit._C`` was compiled for
    (``-march=native`` at install: the same, unless the build moved to another machine).

    Example::

        >>> f = features()
        >>> sorted(f)
        ['compiled', 'cpu', 'machine']
    """
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile")
    cpu, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu == "unknown":
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": cpu, "machine": [w for w in wanted if w in flags],
            "compiled": list(_C.compiled_features()) if _C is not None else []}


def _has_avx512() -> bool:
    return _C is not None and _C.has_avx512()


def _has_gemv_f32() -> bool:
    return _C is not None and _C.has_gemv_f32()


@lru_cache(maxsize=1)
def _amx() -> bool:
    """Whether torch's bf16 GEMMs run on AMX tiles here (oneDNN's brg_matmul:
    avx10_1_512_amx): the CPU has them and the OS grants a process their state (torch asks)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except (AttributeError, RuntimeError):  # a torch without these private helpers: as if none
        return False


def _gemm_f32() -> bool:
    # gemm_f32.cpp is AVX2 code, measured against MKL's sgemm on an AVX2 machine (Zen 2: 1.2-1.5x
    # at prefill shapes); against AVX-512 sgemm it is not measured, so AVX-512 machines keep torch.mm.
    return _C is not None and _C.has_gemm_f32() and not _has_avx512()


@lru_cache(maxsize=1)
def bf16_dot_cost() -> tuple[float, float]:
    """Nanoseconds per 512-bit FMA (16 multiply-adds) and per vdpbf16ps (32) on this core,
    timed once per process (``_C.bf16_dot_cost``: 12 independent chains, the best of 16
    alternating tries, well under a millisecond); (nan, nan) without AVX512-BF16.

    Example::

        >>> fma, dot = bf16_dot_cost()
        >>> (fma > 0 and dot > 0) or (fma != fma)
        True
    """
    cost = _C.bf16_dot_cost() if _C is not None else []
    return (cost[0], cost[1]) if len(cost) == 2 else (float("nan"), float("nan"))


def fma_over_bf16_dots() -> bool:
    """Whether the weight-only GEMM beyond ``FMA_GEMM_MIN_M`` rows of bf16 x runs float32 FMAs
    on widened bf16 values (``gemm_fma``) rather than vdpbf16ps (``gemm_bf16``): where a
    vdpbf16ps costs more than ``BF16_DOT_SLOW`` times two FMAs (its multiply-adds), measured
    here (``bf16_dot_cost``).  ``LOWBIT_FMA_GEMM=0``/``1`` overrides the measurement (the
    plans are cached: ``clear_plans()`` after changing it).

    Example::

        >>> isinstance(fma_over_bf16_dots(), bool)
        True
    """
    forced = os.environ.get("LOWBIT_FMA_GEMM")
    if forced in ("0", "1"):
        return forced == "1"
    fma, dot = bf16_dot_cost()
    return dot > BF16_DOT_SLOW * 2 * fma  # False for nan


def _has_w4a8_rows() -> bool:
    return _C is not None and _C.has_w4a8_rows()


def _has_a8_blocks() -> bool:
    return _C is not None and _C.has_a8_blocks()


def _has_amx_int8() -> bool:
    return _C is not None and _C.has_amx_int8()


def _weight_only_plan(bits: int, group: int, m: int, k: int, dtype: torch.dtype,
                      zero_point_domain: str = "int") -> Plan:
    return _weight_only_plan_at(bits, group, m, k, dtype, torch.get_float32_matmul_precision(), zero_point_domain)


def _zero_point_domain(zero_point, zero_point_min: bool) -> str:
    # what a matmul's arguments say of its weight's zero points: integer ones are stored as
    # integers (QuantScheme.zero_point_dtype), float ones as floats, the "min" domain flagged
    if zero_point_min:
        return "min"
    return "float" if zero_point is not None and zero_point.is_floating_point() else "int"


@lru_cache(maxsize=4096)  # a decode step asks for the same few plans over and over
def _weight_only_plan_at(bits, group, m, k, dtype, precision, zero_point_domain="int") -> Plan:
    if bits not in (4, 8):
        return Plan("reference", f"no CPU kernel for {bits}-bit codes")
    if dtype == torch.float64:
        return Plan("reference", "float64 activations")
    exact = dtype == torch.float32 and precision == "highest"  # float32_exact(dtype)
    fused = _has_gemv_f32() and group % (32 if bits == 4 else 16) == 0
    # q * s + m weights (the "min" domain) run every kernel here: the bf16 decode kernels take
    # 128 s - m for the group's factor of sum x, the bf16 panels and tiles dequantize q * s + m,
    # gemm_f32_amx multiplies q exactly and adds m times x's group sums
    amx_rows = (bits == 4 and dtype == torch.bfloat16 and _C is not None
                and _C.gemv_bf16_amx_supported(k, group))
    rows = AMX_GEMV_BF16_MAX_M if amx_rows else _gemv_max_m(bits, dtype, exact)
    if fused and m <= rows:
        split = dtype != torch.bfloat16
        if (bits == 4 and _C.gemv_bf16_supported(k, group)
                and (not split or m <= (0 if exact else SPLIT_MAX_M))):
            if split:
                return Plan("gemv_bf16_split", f"up to {SPLIT_MAX_M} rows: packed weight, x in two bf16 parts")
            return Plan("gemv_bf16", f"up to {rows} rows: packed weight, bf16 dot products")
        return Plan("gemv_f32", f"up to {rows} rows: packed weight, float32 FMAs")
    if amx_rows and m <= GEMV_BF16_AMX_MAX_M:
        return Plan("gemv_bf16_amx", f"{rows + 1} to {GEMV_BF16_AMX_MAX_M} rows where AMX runs: packed weight, codes "
                                     "as bf16 A tiles, x in B tiles, gemv_bf16's arithmetic (1.1-6x gemv_bf16, "
                                     "1.1-1.5x gemm_bf16_amx: figures at GEMV_BF16_AMX_MAX_M)")
    if not exact and not _amx() and _C is not None and _C.gemm_bf16_supported(k, group):
        if m > FMA_GEMM_MIN_M and fma_over_bf16_dots():
            fma, dot = bf16_dot_cost()
            return Plan("gemm_fma", f"over {FMA_GEMM_MIN_M} rows where a vdpbf16ps costs {dot / fma:.1f} FMAs "
                                    "(measured at first use): gemm_bf16's panels and bf16 weight widened to float32, "
                                    "float32 FMAs")
        return Plan("gemm_bf16", "bf16 panels of the weight, bf16 dot products (AVX512-BF16)")
    if (exact and zero_point_domain != "float" and k % 32 == 0 and group % 32 == 0 and k % group == 0
            and _has_amx_bf16()):
        return Plan("gemm_f32_amx", f"over {rows} rows, float32 x at matmul precision 'highest' where AMX runs: x in "
                                    "three bf16 parts (every product exact), q - z on bf16 tiles, float32 scaling "
                                    "per group: 1.05-2.5x the float32 tiles (figures at GEMV_MAX_M)")
    if exact and _C is not None and _C.gemm_bf16_supported(k, group):
        return Plan("gemm_f32_fma", f"over {rows} rows, float32 x at matmul precision 'highest' on AVX-512: "
                                    "gemm_fma's panels holding the reference's float32 weight (no bf16 rounding), "
                                    "x as it is, float32 FMAs, each output summed in the order of k: 1.1-3.2x the "
                                    "float32 tiles at 8-512 rows (Xeon without AMX, README)")
    if exact or not _has_avx512():
        why = ("float32 activations at matmul precision 'highest'" if exact
               else "no AVX-512: float32 GEMMs beat bf16 ones without bf16 dot products")
        if _gemm_f32():
            return Plan("tiles_f32", f"panels of 16 weight rows dequantized to float32 as they are reached, "
                                     f"gemm_f32.cpp's 6 x 16 FMA register tiles ({why})")
        return Plan("tiles_f32", f"L2-sized weight tiles dequantized to float32, torch.mm ({why})")
    if (m <= AMX_BF16_GEMM_MAX_M and _C is not None and _C.has_amx_bf16()
            and _C.gemm_bf16_supported(k, group)):
        return Plan("gemm_bf16_amx", f"up to {AMX_BF16_GEMM_MAX_M} rows where AMX runs: each block of 32 weight "
                                     "rows dequantized into bf16 A tiles (packed as B tiles from 128 rows), AMX "
                                     "bf16 tiles (faster than bf16 tiles through torch.mm up to here: figures at "
                                     "AMX_BF16_GEMM_MAX_M)")
    if _amx():
        return Plan("tiles_bf16", "weight tiles dequantized to bf16, torch.mm on AMX tiles (oneDNN): 4-10x "
                                  "gemm_bf16.cpp's AVX512-BF16 panels")
    return Plan("tiles_bf16", "L2-sized weight tiles dequantized, torch.mm (no AVX-512 kernel for this group size)")


def a8_rows_max_m(bits: int) -> int:
    """Up to how many rows activations in int8 blocks run gemv_a8.cpp's rows kernel with
    ``bits``-bit weights; beyond, a GEMM path (``a8_gemm``, ``a8_vnni`` or ``a8_amx``).

    Example::

        >>> a8_rows_max_m(4) >= 1 and a8_rows_max_m(8) >= 1
        True
    """
    if not _has_avx512():
        return AVX2_A8_ROWS_MAX_M.get(bits, 0)
    return (AMX_A8_ROWS_MAX_M if _has_amx_int8() else A8_ROWS_MAX_M).get(bits, 0)


def _a8_gemm() -> bool:
    # gemm_a8.cpp / gemm_i16.cpp are AVX2 code, measured against float32 tiles of 8 lanes;
    # against AVX-512's 16 they are not measured, so AVX-512 machines keep their tiles.
    return not _has_avx512()


def _a8_amx_row(bits: int, group: int, symmetric: bool) -> bool:
    # gemm_amx.cpp's one-row kernel for 4-bit codes (gemv_a8_vnni.cpp); not for zero points in
    # groups of 32, whose scales and zero points it reads as 32 streams per 16 weight rows
    # (q4_1 act int8 decoded at 0.94-0.97x with it: figures at AMX_A8_ROWS_MAX_M)
    return bits == 4 and (symmetric or group >= 64) and _has_amx_int8() and _C.a8_vnni_row_supported()


@lru_cache(maxsize=4096)
def _a8_blocks_plan(bits: int, group: int, block: int, m: int, k: int, symmetric: bool) -> Plan:
    if bits not in (4, 8) or block != 32 or group % 32 or not _has_a8_blocks():
        return Plan("reference", "no CPU kernel for these activation blocks, weight or machine (AVX2 needed)")
    if m == 1 and _a8_amx_row(bits, group, symmetric):
        return Plan("a8_amx", "one row where AMX runs: int8 blocks of x, vpdpbusd over 16 weight rows, exact "
                              "block dot products (the tiles' bits): 1.0-1.4x the rows kernel (figures at "
                              "AMX_A8_ROWS_MAX_M)")
    rows = a8_rows_max_m(bits)
    if m <= rows:
        return Plan("a8_blocks", f"up to {rows} rows: int8 blocks of x, integer dot products per "
                                 "block (vpmaddubsw / vpmaddwd)")
    if _a8_gemm():
        how = "u8 panels, vpmaddubsw" if bits == 4 else "int16 panels, vpmaddwd"
        return Plan("a8_gemm", f"over {rows} rows: int8 blocks of x, the codes unpacked once per call into {how} "
                               "register tiles")
    if _has_amx_int8():
        return Plan("a8_amx", f"over {rows} rows: int8 blocks of x, AMX int8 tiles per block (tdpbusd / tdpbssd), "
                              "exact block dot products: 2.5-3x the float32 tiles")
    return Plan("a8_vnni", f"over {rows} rows: int8 blocks of x, the codes unpacked once per call into u8 panels, "
                           "vpdpbusd register tiles, exact block dot products: 1.4-2.9x the AVX2 panels")


@lru_cache(maxsize=4096)
def _act8_plan(bits: int, group: int, m: int, k: int) -> Plan:
    if bits == 8:
        if m >= AMX_INT8_MIN_M and k % 64 == 0 and _has_avx512() and _has_amx_int8():
            return Plan("int8_amx", f"from {AMX_INT8_MIN_M} rows where AMX runs: amx_linear.cpp's int8 tiles, the "
                                    "weight read as stored (exact int32, torch._int_mm's integers), gemm_int8's "
                                    "epilogue fused: 1.2-2.4x gemm_int8")
        if m >= AMX_INT_MM_MIN_M and _has_avx512() and _amx():
            return Plan("int_mm", f"from {AMX_INT_MM_MIN_M} rows where AMX runs: torch._int_mm (oneDNN's int8 GEMM), "
                                  "zero-point correction, row x column epilogue: 1.2-2.9x gemm_int8.cpp")
        if m >= INT8_GEMM_MIN_M and _C is not None and _C.int8_gemm_supported(k):
            return Plan("gemm_int8", "vpdpbusd panels with the accumulator epilogue fused")
        if _C is not None and _C.has_int8_rows():
            avx512 = _has_avx512()
            if m < INT8_GEMM_MIN_M or (not avx512 and m <= INT8_ROWS_MAX_M):
                where = ("one row (torch._int_mm's GEMV: 1.2-2x slower)" if avx512
                         else f"up to {INT8_ROWS_MAX_M} rows without AVX-512 VNNI")
                return Plan("int8_rows", f"{where}: int8 widened to int16, vpmaddwd, exact int32 sums")
            if not avx512:
                return Plan("int8_panels", f"over {INT8_ROWS_MAX_M} rows without AVX-512 VNNI: the weight widened "
                                           "once into int16 panels, vpmaddwd register tiles, exact int32 sums")
        if m >= INT8_GEMM_MIN_M and not _has_avx512():
            return Plan("int_mm_f32", f"no AVX-512 VNNI: int8 products exact in float32 GEMMs over K chunks of "
                                      f"{F32_EXACT_K}, zero-point correction, row x column epilogue")
        return Plan("int_mm", "torch._int_mm, zero-point correction, row x column epilogue")
    if _has_avx512() and group % 32 == 0:
        if m > W4A8_ROWS_MAX_M and _has_amx_int8():
            return Plan("w4a8_amx", f"over {W4A8_ROWS_MAX_M} rows where AMX runs: u4 codes unpacked once into "
                                    "AMX int8 tiles, a group per tile sum: 1.8-2.7x the vpdpbusd panels")
        if m > W4A8_ROWS_MAX_M and _C.int8_gemm_supported(k):
            return Plan("w4a8_panels", f"over {W4A8_ROWS_MAX_M} rows: u4 codes unpacked once into int8 panels "
                                       "(vpdpbusd), a layer's q/k/v and gate/up each in one call")
        return Plan("w4a8_rows", "packed u4 codes, vpdpbusd dot products per group")
    if _has_w4a8_rows() and group % 32 == 0:
        if m <= W4A8_AVX2_ROWS_MAX_M:
            return Plan("w4a8_rows", f"up to {W4A8_AVX2_ROWS_MAX_M} rows: packed u4 codes, vpmaddubsw / vpmaddwd "
                                     "dot products and vpsadbw code sums per group (no AVX-512 VNNI)")
        return Plan("w4a8_panels", f"over {W4A8_AVX2_ROWS_MAX_M} rows without AVX-512 VNNI: u4 codes unpacked "
                                   "once into u8 panels, vpmaddubsw register tiles, exact integers per group")
    return Plan("w4a8_int_mm", "torch._int_mm per weight group, float scaling per group")


class CpuBackend(Backend):
    name = "cpu"
    kernels = ("reference", "gemv_f32", "gemv_bf16", "gemv_bf16_split", "gemv_bf16_amx", "gemm_bf16", "gemm_bf16_amx",
               "gemm_fma", "gemm_f32_fma", "gemm_f32_amx", "tiles_f32", "tiles_bf16",
               "int_mm", "int_mm_f32", "int8_rows", "int8_panels", "int8_amx", "gemm_int8", "w4a8_rows", "w4a8_panels",
               "w4a8_amx", "w4a8_int_mm", "a8_blocks", "a8_gemm", "a8_amx", "a8_vnni")

    def plan(self, weight, act, m, k, dtype):
        if act is not None and act.granularity == "group":
            return _a8_blocks_plan(weight.bits, weight.group_size or k, act.group_size, m, k, weight.symmetric)
        if act is not None:
            return _act8_plan(weight.bits, weight.group_size or k, m, k)
        return _weight_only_plan(weight.bits, weight.group_size or k, m, k, dtype, weight.zero_point_domain)

    def dequantize(self, codes, scale, zero_point, scheme, shape, out_dtype):
        if scheme.bits == 3:  # 3-bit codes straddle words
            return super().dequantize(codes, scale, zero_point, scheme, shape, out_dtype)
        rows_per_scale, group = scheme.scale_map(shape)
        cdt = reference.compute_dtype(out_dtype)
        if scheme.zero_point_domain == "min":  # q * scale + min
            out = _C.dequantize_min(codes.contiguous(), scale.to(cdt).contiguous(), zero_point.to(cdt).contiguous(),
                                    scheme.bits, shape[-1] if shape else 1, group, rows_per_scale, out_dtype)
            return out.reshape(shape)
        zp = None if zero_point is None else zero_point.to(cdt).contiguous()
        out = _C.dequantize(codes.contiguous(), scale.to(cdt).contiguous(), zp, scheme.bits, scheme.symmetric,
                            shape[-1] if shape else 1, group, rows_per_scale, out_dtype)
        return out.reshape(shape)

    def pack(self, q, bits, packing):
        return word_packing.pack(q, bits, packing)

    def unpack(self, packed, bits, packing, signed):
        return word_packing.unpack(packed, bits, packing, signed)

    def quantize_per_token(self, x, bits, symmetric):
        """One pass per row (range, scale, codes); also reports whether x and every
        scale were finite (a finite row whose range overflows the scale's dtype is not)."""
        return _C.quantize_per_token(x.contiguous(), bits, symmetric)

    def dequantize_per_token(self, q, scale, zero_point):
        d = q.shape[1]
        cdt = reference.compute_dtype(scale.dtype)
        return _C.dequantize(q.contiguous(), scale.to(cdt).contiguous(), zero_point.to(cdt).contiguous(), 8,
                             q.dtype == torch.int8, d, d, 1, scale.dtype).reshape(q.shape)

    def dequantize_accumulator_grouped(self, acc, scale, group_size, out_dtype):
        n = acc.shape[-1]
        rows = acc.numel() // n if n else 0
        shared = scale.dim() == 1 and acc.dim() > 1
        out = _C.dequantize(acc.contiguous(), scale.to(torch.float32).contiguous(), None, 32, True, n,
                            group_size, max(rows, 1) if shared else 1, out_dtype)
        return out.reshape(acc.shape)

    def dequantize_accumulator_rowcol(self, acc, row_scale, col_scale, out_dtype):
        return _C.dequantize_rowcol(acc.contiguous(), row_scale.to(torch.float32).contiguous(),
                                    col_scale.to(torch.float32).contiguous(), out_dtype)

    # -- matmuls -------------------------------------------------------------------------
    def weight_only_matmul(self, x, codes, scale, zero_point, bits, group_size, zero_point_min=False):
        """x @ dequantize(W).T with the kernel ``plan`` picks.  The decode kernels
        (``gemv_*``, up to ``gemv_max_m`` rows) read the packed weight and accumulate in
        float32: 4-bit through bf16 dot products on the codes (gemv_bf16.cpp; non-bf16 x
        split into two bf16 parts; where AMX runs, beyond ``AMX_GEMV_BF16_MAX_M`` rows of
        bf16 x the same products and float32 sums on AMX bf16 tiles, gemv_amx.cpp), else float32
        FMAs (matmul.cpp; signed 4-bit codes as q + 8 less 8 sum x per group, within the
        bound of sum (|q| + 8) |x| s).  ``gemm_bf16``
        (gemm_bf16.cpp) dequantizes panels of W to bf16 (rounded once, as
        W.to(bfloat16)) and multiplies them with x rounded to bf16 with float32
        accumulation: bf16 torch.matmul's arithmetic, 4-5x faster than float32 here, and
        the bf16 roundings (2^-9 relative each) are far below the 4/8-bit weight error.
        ``gemm_fma`` (where a vdpbf16ps costs over 2.5 FMAs, ``fma_over_bf16_dots``) is
        the same weight and x in gemm_bf16's panels, widened to float32, on FMAs: the same
        exact products, summed in the order of k.  ``gemm_f32_fma`` (float32 x at the
        float32 matmul precision "highest", AVX-512 machines without AMX, or weights with
        float zero points where AMX runs) is those panels holding the reference's float32
        weight, (q - z) * s, never rounded to bf16, and x as it is: each output the float32
        FMA chain over k in order, within gamma_K of sum |x| |w|.
        ``tiles_*``: L2-sized tiles of W (or tiles as large as x) dequantized to bf16
        (float32 at the float32 matmul precision "highest", and on machines without
        AVX-512) through torch.mm; float32 ones on AVX2 machines without AVX-512 run
        gemm_f32.cpp's 6 x 16 FMA register tiles instead (1.2-1.5x MKL's sgemm at prefill
        shapes on a Zen 2; each output summed in the order of k, within gamma_K) on panels
        of 16 rows of W dequantized as they are reached (``weight_only_gemm_f32``).  No
        float copy of W larger than x is made (none at all in gemm_f32).  Where AMX runs,
        float32 x at "highest" times a weight with integer zero points (or none) is
        ``gemm_f32_amx`` (amx_linear.cpp) instead: x = x1 + x2 + x3 exactly in three bf16
        parts, q - z exact in bf16, so every product is exact and summed in float32 on
        the tiles per group, times the group's scale, within gamma_(3 group + G) of
        sum |x| |q - z| |s| (tests/test_matmul.py), the tiles' bound being gamma_(K + 1).

        A weight in the "min" domain (``zero_point_min``: W = q * s + m, GGUF's Q4_1)
        runs the same kernels: ``gemv_f32`` and ``gemm_f32_amx`` take its codes as
        unsigned without a zero point and add m times the group sums of x per group,
        sum_g (s_g sum q x + m_g sum x) (``gemm_f32_amx``: within gamma_(3 group + 2 G) of
        sum |x| (|q s| + |m|)); the bf16 decode kernels sum s (128 + u) x and
        subtract (128 s - m) sum x per group; all within the same gamma bound of
        sum (|q s| + |m|) |x| (offset by 136 for the bf16 ones, tests/test_matmul.py); the
        panels and tiles dequantize q * s + m, the reference's weight."""
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        kernel = _weight_only_plan(bits, group_size, m, k, x.dtype,
                                   _zero_point_domain(zero_point, zero_point_min)).kernel
        if kernel == "reference":
            return super().weight_only_matmul(x, codes, scale, zero_point, bits, group_size, zero_point_min)
        if kernel.startswith("tiles"):
            cdt = torch.float32 if kernel == "tiles_f32" else torch.bfloat16
            return _tiles(x, codes, scale, zero_point, bits, group_size, cdt, zero_point_min)
        return _C.weight_only_matmul(x, codes, scale, zero_point, bits, group_size, weight_only_kernel_index(kernel),
                                     zero_point_min)

    def one_row(self, weight, act, codes, scale, zero_point, k, dtype):
        """The decode step's projection (``quant_projection``: decode.cpp's Group, the
        same kernels and bits as a decode step, which are lowbit.linear's) as a callable
        ``_C.RowLinear``: x's conversions to float32 and back and the activations'
        quantization are loops in its call.  Where the plan for one row is a kernel the
        decode step runs; else None."""
        p = quant_projection(weight, act, codes, scale, zero_point, None, k, dtype)
        return None if p is None else _C.RowLinear(p)

    def split_matmul(self, x, codes, scale, zero_point, bits, group_size, outliers, high_codes, high_scale,
                     high_zero_point, high_bits, high_group_size):
        """Where the low part's plan is a decode kernel (``gemv_*``), one call of
        ``_C.split_matmul``: that kernel's float32 result, the 8-bit outlier columns added
        to it in float32 (a loop over x[:, outliers]), one rounding to x's dtype: within the
        composition's bound (``Backend.split_matmul``), with one rounding fewer.  Else the
        composition of this backend's weight-only matmuls."""
        k = x.shape[-1]
        kernel = _weight_only_plan(bits, group_size, x.numel() // k, k, x.dtype,
                                   _zero_point_domain(zero_point, False)).kernel
        if kernel.startswith("gemv") and high_bits == 8:
            return _C.split_matmul(x, codes, scale, zero_point, bits, group_size, weight_only_kernel_index(kernel),
                                   outliers, high_codes, high_scale, high_zero_point, high_group_size)
        return super().split_matmul(x, codes, scale, zero_point, bits, group_size, outliers, high_codes, high_scale,
                                    high_zero_point, high_bits, high_group_size)

    def linear_a8_blocks(self, x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min=False):
        """Up to ``a8_rows_max_m`` rows, gemv_a8.cpp: each row of x quantized to int8 blocks
        of 32 (the reference's codes and scales, bit for bit), integer dot products per block
        (exact), each scaled by its block's float32 scale, per-group sums scaled by the
        weight's; beyond, on AVX2 machines gemm_a8.cpp (4-bit) or gemm_i16.cpp (8-bit): the
        same blocks and exact block dot products, the codes unpacked once into panels; where
        AMX runs, gemm_amx.cpp: the same block dot products on int8 tiles, the bits of those
        panel GEMMs; on other AVX-512 VNNI machines gemm_a8_vnni.cpp: the same on vpdpbusd
        register tiles, the same bits again.  The codes and scales are the reference's; the
        float32 roundings differ (order of the sums, one product of the
        two scales per block, the zero-point term apart), within the bound derived in
        tests/test_a8_blocks.py.  A weight in the "min" domain (``zero_point_min``: q * s + m,
        llama.cpp's Q4_1 x Q8_1) adds m times the group sums of x where the others take
        s z times them away."""
        k, n = x.shape[-1], codes.shape[0]
        m = x.numel() // k
        kernel = _a8_blocks_plan(bits, group_size, act_block, m, k, zero_point is None).kernel
        if kernel == "reference":
            return super().linear_a8_blocks(x, codes, scale, zero_point, bits, group_size, act_block, zero_point_min)
        s, zp = _C.packed_scales(scale, zero_point)
        # the AMX tiles take bf16 x as it is and give bf16 y: no float32 copy of either
        x2 = (x.reshape(m, k).contiguous() if kernel == "a8_amx" and x.dtype == torch.bfloat16
              else _float32(x.reshape(m, k)))
        if kernel == "a8_gemm":
            gemm = _C.gemm_a8_blocks if bits == 4 else _C.gemm_a8_blocks8
            y, ok = gemm(x2, codes.contiguous(), s, zp, group_size, zero_point_min)
        elif kernel in ("a8_amx", "a8_vnni"):
            gemm = _C.gemm_a8_blocks_amx if kernel == "a8_amx" else _C.gemm_a8_blocks_vnni
            y, ok = gemm(x2, codes.contiguous(), s, zp, bits, group_size, zero_point_min)
        else:
            y, ok = _C.linear_a8_blocks(x2, codes.contiguous(), s, zp, bits, group_size, zero_point_min)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return (y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)), ok

    def int8_mm(self, a, b):
        """torch._int_mm: oneDNN's int8 GEMM (AMX/VNNI), exact int32 accumulation; on a
        machine without VNNI, up to ``INT8_ROWS_MAX_M`` rows ``_C.int8_mm_rows`` (AVX2
        vpmaddwd), beyond ``_C.int8_mm_panels`` (the same in int16 panels), or exact float32
        GEMMs over K chunks (``F32_EXACT_K``) without AVX2: the same int32 result, many
        times faster there."""
        m, k = a.shape
        kernel = _act8_plan(8, k, m, k).kernel
        if kernel == "int_mm_f32":
            return int8_mm_f32(a, b)
        if kernel == "int8_rows":
            return _C.int8_mm_rows(a, b)
        if kernel == "int8_panels":
            return _C.int8_mm_panels(a, b)
        if kernel == "int8_amx":
            return _C.int8_mm_amx(a, b)
        return torch._int_mm(a.contiguous(), b.T)

    def int8_linear(self, a, a_zero_point, b, row_scale, col_scale, bias, out_dtype):
        """W8A8 in one call where ``plan`` says ``gemm_int8`` (gemm_int8.cpp: vpdpbusd) or
        ``int8_amx`` (amx_linear.cpp: AMX tdpbssd): an int8 GEMM with exact int32 sums and the
        dequantize_accumulator epilogue (and bias) fused into its store, the bits of the
        composed path (``Backend.int8_linear``)."""
        fused = {"gemm_int8": _C.int8_linear, "int8_amx": _C.int8_linear_amx}.get(
            _act8_plan(8, a.shape[1], a.shape[0], a.shape[1]).kernel)
        if fused is None:
            return super().int8_linear(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)
        return fused(a, a_zero_point, b, row_scale, col_scale, bias, out_dtype)

    def linear_qta8a_qga4w(self, x_q, x_scale, x_zero_point, w_codes, w_scale, w_zero_point, group_size, bias):
        """Integer arithmetic inside each weight group, float scaling once per group:

        y[m, n] = x_scale[m] * sum_g w_scale[n, g] * sum_{k in g} (x_q[m, k] - x_zp[m]) (w_q[n, k] - w_zp[n, g])

        The inner sum expands to  sum x_q w_q - w_zp sum x_q - x_zp sum w_q + |g| x_zp w_zp,
        all exact in int32 (|g| * 255 * 15 << 2^31); sum x_q w_q is an int8 GEMM per group.
        ``w4a8_rows`` (matmul.cpp: vpdpbusd, or vpmaddubsw / vpmaddwd on AVX2) and
        ``w4a8_panels`` (many rows: gemm_int8.cpp's vpdpbusd panels, or gemm_a8.cpp's
        vpmaddubsw panels on AVX2) and ``w4a8_amx`` (many rows where AMX runs:
        gemm_amx.cpp's int8 tiles, the bits of the VNNI panels) compute these integers exactly.
        """
        m, k = x_q.shape
        kernel = _act8_plan(4, group_size, m, k).kernel
        if kernel != "w4a8_int_mm":
            zp = None if w_zero_point is None else w_zero_point.to(torch.int32).contiguous()
            run = {"w4a8_panels": _C.w4a8_gemm_panels, "w4a8_amx": _C.w4a8_gemm_amx}.get(kernel, _C.w4a8_gemm)
            y = run(x_q.contiguous(), x_zero_point.to(torch.int32).contiguous(), w_codes.contiguous(),
                    w_scale.to(torch.float32).contiguous(), zp, group_size)
            y = y * x_scale.to(torch.float32)[:, None]
            return y if bias is None else y + bias.to(torch.float32)
        n, groups = w_scale.shape
        g = group_size
        w_q = self.unpack(w_codes, 4, "u32", w_zero_point is None).to(torch.int8).reshape(n, groups, g)
        xg = x_q.reshape(m, groups, g)
        w_zp = (torch.zeros(n, groups, dtype=torch.int32) if w_zero_point is None
                else w_zero_point.to(torch.int32))
        x_zp = x_zero_point.to(torch.int32)
        x_sum = xg.to(torch.int32).sum(-1)                       # [m, groups]
        w_sum = w_q.to(torch.int32).sum(-1)                      # [n, groups]
        y = torch.zeros(m, n, dtype=torch.float32)
        ws = w_scale.to(torch.float32)
        for j in range(groups):
            acc = self.int8_mm(xg[:, j].contiguous(), w_q[:, j].contiguous())  # [m, n] int32
            acc = (acc - x_sum[:, j, None] * w_zp[None, :, j] - x_zp[:, None] * w_sum[None, :, j]
                   + g * x_zp[:, None] * w_zp[None, :, j])
            y += acc.to(torch.float32) * ws[None, :, j]
        y = y * x_scale.to(torch.float32)[:, None]
        return y if bias is None else y + bias.to(torch.float32)


def _float32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous float32, without a (no-op) op call when it already is: at decode
    sizes each costs a few microseconds, as much as a small kernel."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def int8_mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 a [M, K] @ int8 b [N, K].T, the exact int32 result, from float32 GEMMs over K
    chunks of ``F32_EXACT_K`` (each chunk's sums are exact integers in float32).

    Example::

        >>> a = torch.full((2, 3000), -128, dtype=torch.int8)
        >>> int8_mm_f32(a, a[:1]).tolist()
        [[49152000], [49152000]]
    """
    if a.shape[1] <= F32_EXACT_K:  # one chunk: no int32 sum to keep
        bf = _scratch("tile", b.shape[0], b.shape[1], torch.float32).copy_(b)
        return (a.to(torch.float32) @ bf.T).to(torch.int32)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32)
    for k0 in range(0, a.shape[1], F32_EXACT_K):
        acc += (a[:, k0:k0 + F32_EXACT_K].to(torch.float32)
                @ b[:, k0:k0 + F32_EXACT_K].to(torch.float32).T).to(torch.int32)
    return acc


# Float copies of weights (tiles, int8 codes as float32) go into buffers kept per thread
# and reused: a fresh multi-MiB tensor per matmul is a fresh heap top that glibc hands
# back to the OS when freed, so every call page-faults its tile in again.  A 512-token
# prefill on the 2-core Zen 2 next to a dozen loaded models: 0.69-0.82x the float model's
# speed with fresh tiles, 0.82-0.95x without those page faults.  Larger buffers are not kept.
SCRATCH_MAX_BYTES = 64 << 20
_scratch_buffers = threading.local()


def _scratch(name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [rows, cols] tensor of dtype in this thread's buffer ``name``,
    valid until the next ``_scratch(name, ...)`` on this thread."""
    n = rows * cols
    if n * dtype.itemsize > SCRATCH_MAX_BYTES:
        return torch.empty(rows, cols, dtype=dtype)
    bufs = _scratch_buffers.__dict__
    buf = bufs.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: writable inside inference mode and out of it
            buf = bufs[name] = torch.empty(n, dtype=dtype)
    return buf[:n].view(rows, cols)


def _dequantized(codes, s, zp, bits, signed, k, group_size, cdt, reuse: bool, zero_point_min=False):
    """The float [rows, k] tile of packed ``codes``, in this thread's scratch buffer when
    ``reuse`` (not when autograd may keep it for a backward pass)."""
    w = _scratch("tile", codes.shape[0], k, cdt) if reuse else torch.empty(codes.shape[0], k, dtype=cdt)
    if zero_point_min:
        _C.dequantize_min_into(w, codes, s, zp, bits, k, group_size, 1)
    else:
        _C.dequantize_into(w, codes, s, zp, bits, signed, k, group_size, 1)
    return w


def _tiles(x, codes, scale, zero_point, bits, group_size, cdt, zero_point_min=False):
    k, n = x.shape[-1], codes.shape[0]
    x2 = x.reshape(-1, k)
    zp = None if zero_point is None else zero_point.to(torch.float32).contiguous()
    s = scale.to(torch.float32).contiguous()
    xc = x2.to(cdt).contiguous()
    if cdt == torch.float32 and _gemm_f32() and not (torch.is_grad_enabled() and xc.requires_grad):
        # gemm_f32 with each panel of W dequantized as it goes, no copy of W (it records no
        # autograd graph: where x needs a gradient, the tiles below)
        y = _C.weight_only_gemm_f32(xc, codes.contiguous(), s, zp, bits, zero_point is None, group_size,
                                    zero_point_min)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    # A tile of W as large as x itself costs no more memory than x does, and one GEMM over
    # all of W (no transposed output to copy back) is 1.5x faster at prefill sizes; so is
    # all of W at once when its float copy is no larger than x and y together (a prefill
    # of 512 tokens through 1536x576: 3 tiles and their copies into y cost 3-4% more).
    m = x2.shape[0]
    reuse = not (torch.is_grad_enabled() and xc.requires_grad)
    tile = max(16, TILE_BYTES // max(k * xc.element_size(), 1), m)
    if tile >= n or n * k <= m * (k + n):
        w = _dequantized(codes.contiguous(), s, zp, bits, zero_point is None, k, group_size, cdt, reuse,
                         zero_point_min)
        return torch.mm(xc, w.T).to(x.dtype).reshape(*x.shape[:-1], n)
    # Each tile's GEMM into its columns of y: 512 x 1536 x 576 at 3 tiles took 1.5x the
    # float32 GEMM computing y.T tile by tile and transposing it (Zen 2); this, 1.05x.
    out = torch.empty(x2.shape[0], n, dtype=cdt)
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        w = _dequantized(codes[n0:n1].contiguous(), s[n0:n1], None if zp is None else zp[n0:n1],
                         bits, zero_point is None, k, group_size, cdt, reuse, zero_point_min)
        out[:, n0:n1] = torch.mm(xc, w.T)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


BACKEND = CpuBackend()


# -- the native decode step of lowbit.runtime ------------------------------------------------
# decode.cpp runs a decode step (one token, or one token of each of a batch's sequences)
# through the whole model in one call, each projection with the kernel this backend's plan
# picks for the step's rows, when the plan picks one of these; decode.cpp's Proj takes each
# by its index among the kernels of its kind of activations (weight-only: weight_only_kernels).
DECODE_W8A8_KERNELS = ("int_mm", "int8_rows", "gemm_int8", "int8_panels", "int8_amx")
DECODE_W4A8_KERNELS = ("w4a8_rows", "w4a8_panels", "w4a8_amx")
DECODE_A8_BLOCKS_KERNELS = ("a8_blocks", "a8_amx", "a8_gemm", "a8_vnni")
DECODE_KERNELS = ("gemv_f32", "gemv_bf16", "gemv_bf16_split", "gemv_bf16_amx", "gemm_bf16", "gemm_bf16_amx",
                  "gemm_fma", "gemm_f32_fma", "gemm_f32_amx",
                  *DECODE_W8A8_KERNELS, *DECODE_W4A8_KERNELS, *DECODE_A8_BLOCKS_KERNELS)


def has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).  Where it does
    not, bfloat16 activations are converted in software and the same model runs faster in
    float32: the rule of ``lowbit generate --dtype auto`` and ``benchmarks/generate.py``.

    Example::

        >>> isinstance(has_bf16_dot(), bool)
        True
    """
    return bool({"avx512_bf16", "amx_tile"} & set(features()["machine"]))


def decode_available() -> bool:
    """Whether lowbit._C has the decode step (``new_decoder``) and its attention/RMSNorm."""
    return _C is not None


def new_decoder(heads: int, kv_heads: int, head_dim: int, hidden: int, eps: float, scaling: float):
    """An empty ``_C.Decoder``: add layers of ``float_projection``/``quant_projection``s."""
    return _C.Decoder(heads, kv_heads, head_dim, hidden, eps, scaling)


def dense_rows_max_m(dtype: torch.dtype = torch.float32) -> int:
    """Up to how many rows a decode step's ``nn.Linear`` with a ``dtype`` (float32 or
    bfloat16) weight runs ``_C.dense_rows`` on this machine (0: never, the kernel is not
    compiled in or takes no such weight)."""
    if _C is None or not _C.has_dense_rows():
        return 0
    return {torch.float32: DENSE_ROWS_MAX_M, torch.bfloat16: DENSE_BF16_ROWS_MAX_M}.get(dtype, 0)


def dense_rows_apply(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows of a decode step through a float ``nn.Linear`` with this
    weight run ``_C.dense_rows`` (float32 or bfloat16 on CPU, up to ``dense_rows_max_m``
    rows of its dtype), not ``torch.nn.functional.linear``.  A prefill never does: its
    logits stay bit-identical to transformers' forward."""
    most = dense_rows_max_m(weight.dtype)
    return weight.device.type == "cpu" and most > 0 and rows <= most


def dense_amx_apply(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows of a decode step through a bfloat16 ``nn.Linear`` with this
    weight run ``_C.dense_amx`` (AMX bf16 tiles, up to ``DENSE_AMX_MAX_M`` rows, K a multiple
    of 32).  A prefill never does: its logits stay bit-identical to transformers' forward.

    Example (K = 40 is not a multiple of 32, float32 has no AMX tiles: never)::

        >>> import torch
        >>> from lowbit.kernels import cpu
        >>> cpu.dense_amx_apply(torch.zeros(8, 40, dtype=torch.bfloat16), 1)
        False
        >>> cpu.dense_amx_apply(torch.zeros(8, 64), 1)
        False
    """
    return _bf16_blocks(weight) and rows <= DENSE_AMX_MAX_M and _has_amx_bf16()


def _bf16_blocks(weight: torch.Tensor) -> bool:
    # what the bf16 tile kernels (dense_amx, dense_dots) take: a bf16 CPU matrix whose rows
    # are whole 32-value blocks
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0)


def dense_dots_apply(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows of a decode step through a bfloat16 ``nn.Linear`` with this
    weight run ``_C.dense_dots`` (AVX512-BF16 tiles, K a multiple of 32, up to
    ``DENSE_DOTS_MAX_M`` rows; ``step_linear_kernel`` gives the rows dense_rows takes, and
    every row where AMX runs, to those first).  A prefill never does.

    Example (K = 40 is not a multiple of 32, float32 is not bf16: never)::

        >>> import torch
        >>> from lowbit.kernels import cpu
        >>> cpu.dense_dots_apply(torch.zeros(8, 40, dtype=torch.bfloat16), 16)
        False
        >>> cpu.dense_dots_apply(torch.zeros(8, 64), 16)
        False
    """
    return _bf16_blocks(weight) and rows <= DENSE_DOTS_MAX_M and _C is not None and _C.has_dense_dots()


def _has_amx_bf16() -> bool:
    return _C is not None and _C.has_amx_bf16() and _amx()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for the few rows of a decode step (dense.cpp), all float32
    or all bfloat16 (float32 sums of the exact products, one rounding to bf16 after the
    bias): every row is summed in one order whatever the number of rows, so a batch's rows
    get the bits each gets alone.  Within float32 rounding of ``torch.nn.functional.linear``
    on the float32 values (bfloat16: plus the one rounding of the result).

    Example::

        >>> import torch
        >>> from lowbit.kernels import cpu
        >>> x, w = torch.randn(2, 40), torch.randn(24, 40)
        >>> torch.allclose(cpu.dense_linear(x, w, None), x @ w.T, atol=1e-4)
        True
        >>> torch.equal(cpu.dense_linear(x[1:], w, None), cpu.dense_linear(x, w, None)[1:])
        True
    """
    return _C.dense_rows(x, weight, bias)


def step_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float ``nn.Linear`` for the rows of a decode step, on the kernel ``step_linear_kernel``
    names: ``dense_linear``; gemm_f32.cpp's register tiles (each output summed in the order
    of k whatever the number of rows, 1.5-1.8x MKL's sgemm at 17-64 rows on a Zen 2), then
    the bias; or ``torch.nn.functional.linear``.

    Example::

        >>> import torch
        >>> from lowbit.kernels import cpu
        >>> x, w = torch.randn(1, 64), torch.randn(8, 64)
        >>> torch.allclose(cpu.step_linear(x, w, None), x @ w.T, atol=1e-4)
        True
        >>> x = torch.randn(40, 64)
        >>> torch.allclose(cpu.step_linear(x, w, torch.ones(8)), x @ w.T + 1, atol=1e-4)
        True
    """
    kernel = "linear"
    if x.dim() == 2 and x.dtype == weight.dtype and x.device.type == "cpu":
        kernel = step_linear_kernel(weight, x.shape[0])
    if kernel == "dense_rows":
        return dense_linear(x, weight, bias)
    if kernel == "dense_amx" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return _C.dense_amx(x, weight, bias)
    if kernel == "dense_dots" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return _C.dense_dots(x, weight, bias)
    if kernel == "gemm_f32" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = _C.gemm_f32(x, weight)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)


def step_linear_kernel(weight: torch.Tensor, rows: int) -> str:
    """Which kernel ``rows`` rows of a decode step (x of the weight's dtype) take through a
    float ``nn.Linear`` with this weight: ``"dense_amx"`` where ``dense_amx_apply`` (a bf16
    weight where AMX runs: every row, alone or in a batch, summed in one order), else
    ``"dense_rows"`` where ``dense_rows_apply``, else ``"dense_dots"`` where
    ``dense_dots_apply``, else
    ``"gemm_f32"`` for float32 on AVX2 machines without AVX-512 (``_gemm_f32``), else
    ``"linear"`` (``torch.nn.functional.linear``).

    Example::

        >>> import torch
        >>> from lowbit.kernels import cpu
        >>> cpu.step_linear_kernel(torch.zeros(8, 64, dtype=torch.float64), 1)
        'linear'
    """
    if dense_amx_apply(weight, rows):
        return "dense_amx"
    if dense_rows_apply(weight, rows):
        return "dense_rows"
    if dense_dots_apply(weight, rows):
        return "dense_dots"
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and _gemm_f32():
        return "gemm_f32"
    return "linear"


def float_projection(weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 1):
    """A float ``nn.Linear`` in the decode step of ``rows`` rows, on ``step_linear``'s kernel."""
    kernel = ("linear", "dense_rows", "gemm_f32", "dense_amx", "dense_dots").index(step_linear_kernel(weight, rows))
    return _C.DecodeProj(weight, None, None, None, bias, 0, 0, 0, kernel)


def quant_projection(weight: QuantScheme, act: QuantScheme | None, codes, scale, zero_point, bias, k: int,
                     dtype: torch.dtype, rows: int = 1):
    """A quantized projection in the decode step of ``rows`` rows: ``lowbit.linear``'s
    matmul form of the weight (``ops.matmul.weight_parts``), run as ``plan`` says for that
    many rows; None when the plan's kernel is not one decode.cpp runs (``DECODE_KERNELS``)
    or the activations are per tensor (static scales)."""
    if act is not None and act.granularity == "tensor":
        return None
    kernel = BACKEND.plan(weight, act, rows, k, dtype).kernel
    if kernel not in DECODE_KERNELS:
        return None
    if kernel in DECODE_A8_BLOCKS_KERNELS or kernel == "gemv_f32":  # packed scales, float16 ones as stored
        s, zp = _C.packed_scales(scale, zero_point)
        mode, index = ((3, DECODE_A8_BLOCKS_KERNELS.index(kernel)) if act is not None
                       else (0, weight_only_kernel_index(kernel)))
        return _C.DecodeProj(None, codes, s, zp, bias, weight.bits, k // scale.shape[-1], mode, index,
                             weight.zero_point_domain == "min")
    s = scale.to(torch.float32).contiguous()
    if act is None:
        zp = None if zero_point is None else zero_point.to(torch.float32).contiguous()
        return _C.DecodeProj(None, codes, s, zp, bias, weight.bits, k // scale.shape[-1], 0,
                             weight_only_kernel_index(kernel), weight.zero_point_domain == "min")
    mode = 1 if act.symmetric else 2
    if weight.bits == 8:
        return _C.DecodeProj(None, codes, s.reshape(-1), None, bias, 8, k, mode, DECODE_W8A8_KERNELS.index(kernel))
    zp = None if zero_point is None else zero_point.to(torch.int32).contiguous()
    return _C.DecodeProj(None, codes, s, zp, bias, 4, k // scale.shape[-1], mode, DECODE_W4A8_KERNELS.index(kernel))


def decode_attention(q, keys, values, n: int, scaling: float):
    """Attention of one new token over the first ``n`` cached positions, float32 arithmetic."""
    return _C.decode_attention(q, keys, values, n, scaling)


def decode_attention_rows(q, keys, values, rows, lengths, scaling: float):
    """``decode_attention`` of query j (q [N, H, hd]) over the first ``lengths[j]``
    positions of sequence ``rows[j]`` of batched caches [B, KV, capacity, hd], in one call."""
    return _C.decode_attention_rows(q, keys, values, rows, lengths, scaling)


def prefill_attention_available() -> bool:
    """Whether ``prefill_attention`` runs here (an AVX-512 build of ``lowbit._C``)."""
    return _C is not None and hasattr(_C, "has_prefill_attention") and _C.has_prefill_attention()


def prefill_attention_tiles(head_dim: int) -> bool:
    """Whether ``prefill_attention`` runs bf16 caches with heads of ``head_dim`` values on
    AMX bf16 tiles here (attend_amx.cpp: AMX bf16 usable, head sizes 32, 64, 96 or 128).

    Example::

        >>> prefill_attention_tiles(48)
        False
    """
    return prefill_attention_available() and hasattr(_C, "prefill_attention_tiles") and \
        _C.prefill_attention_tiles(head_dim)


def prefill_attention(q, keys, values, seqs, pos: int, scaling: float):
    """Causal attention of t new tokens of each of N sequences at once (a prefill): q [N, t,
    H, hd] at positions ``pos`` .. ``pos + t - 1`` of sequence ``seqs[i]`` of the caches
    [B, KV, capacity, hd], which already hold those tokens' keys and values; query j of a
    sequence sees its positions 0 .. pos + j.  Float32 arithmetic, GEMM-shaped (decode.cpp's
    prefill_attend; bf16 q and caches take the scores on bf16 dot products, each product
    exact, the sums float32, except where a vdpbf16ps costs over 2.5 FMAs
    (``fma_over_bf16_dots``: float32 FMAs, as for float32 caches; a 512-token attention of
    the bf16 model 1.2x on the Xeon without AMX), and where AMX bf16 tiles run and hd is 32, 64, 96 or 128 both
    products on tiles, the softmax weights in three bf16 parts); returns [N, t, H, hd] in
    q's dtype.

    Example::

        >>> import torch
        >>> q, kv = torch.randn(1, 3, 2, 16), torch.randn(1, 1, 4, 16)
        >>> out = prefill_attention(q, kv, kv, torch.tensor([0]), 0, 0.25) if prefill_attention_available() else q
        >>> out.shape
        torch.Size([1, 3, 2, 16])
    """
    return _C.prefill_attention(q, keys, values, seqs, pos, scaling, not fma_over_bf16_dots())


def argmax_rows(x):
    """The first index of the largest value of each row of x [rows, n] (float32, bfloat16
    or float16, compared as float32; a NaN counts as the largest, as numpy's argmax), as
    int64 [rows]: a batch step's greedy picks, rows spread over the threads.

    Example::

        >>> import torch
        >>> argmax_rows(torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 5.0, 0.0]]))
        tensor([1, 0])
    """
    return _C.argmax_rows(x)


def rms_norm_rows(h, w, eps: float):
    """RMSNorm of rows in one pass, float32 arithmetic (as transformers' LlamaRMSNorm),
    each row on its own: a row has the same bits alone or among many.

    Example::

        >>> import torch
        >>> x = torch.ones(2, 8)
        >>> rms_norm_rows(x, torch.full((8,), 2.0), 0.0)[0, :2]
        tensor([2., 2.])
    """
    return _C.rms_norm_rows(h, w, eps)


def rope(x, cos, sin):
    """The rotary embedding of x [N, heads, head_dim] at N positions (cos and sin: N rows
    of head_dim values, x's dtype): ``x * cos + rotate_half(x) * sin`` with its three
    roundings in x's dtype, the bits of those ATen ops (and of the C++ decode step's),
    each row on its own.

    Example::

        >>> import torch
        >>> x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
        >>> rope(x, torch.zeros(1, 4), torch.ones(1, 4))         # rotate_half(x)
        tensor([[[-3., -4.,  1.,  2.]]])
    """
    return _C.rope(x, cos, sin)


def clear_plans() -> None:
    """Forget the cached plans: after a threshold above changed (``calibration.apply``)."""
    for plan in (_weight_only_plan_at, _a8_blocks_plan, _act8_plan):
        plan.cache_clear()
    CpuBackend.plan_epoch += 1


def _load_calibration():
    """This machine's measured thresholds (``calibration.py``), applied over the built-in
    ones above; None when there is no calibration file for it.  A file that cannot be read
    is reported and ignored: the built-in thresholds stay."""
    from . import calibration

    calibration.BUILT_IN.update({t.name: t.get(sys.modules[__name__]) for t in calibration.THRESHOLDS})
    try:
        data = calibration.load()
    except ValueError as e:
        import warnings

        warnings.warn(str(e), stacklevel=2)
        return None
    if data is not None:
        calibration.apply(data)
    return data


# the calibration in force (None: the built-in thresholds), read once, when lowbit is imported
CALIBRATION = _load_calibration() if _C is not None else None
