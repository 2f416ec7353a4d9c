"""Builds lowbit's C++ CPU kernels (lowbit._C) with torch's cpp_extension.

Install with ``pip install --no-build-isolation -e .`` so the extension is compiled
against the torch already in the environment.  Set ``LOWBIT_NO_EXT=1`` to skip it:
lowbit then runs on its pure-PyTorch reference kernels.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("LOWBIT_NO_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # -march=native: the extension is built on the machine that runs it (AVX-512 here).
    flags = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
    ext_modules = [
        CppExtension("lowbit._C", ["lowbit/csrc/cpu/bindings.cpp", "lowbit/csrc/cpu/dequant.cpp",
                                   "lowbit/csrc/cpu/matmul.cpp", "lowbit/csrc/cpu/gemv_bf16.cpp",
                                   "lowbit/csrc/cpu/gemv_amx.cpp", "lowbit/csrc/cpu/gemv_a8_vnni.cpp",
                                   "lowbit/csrc/cpu/gemm_bf16.cpp", "lowbit/csrc/cpu/gemm_int8.cpp",
                                   "lowbit/csrc/cpu/gemv_a8.cpp", "lowbit/csrc/cpu/gemm_a8.cpp",
                                   "lowbit/csrc/cpu/gemm_i16.cpp", "lowbit/csrc/cpu/gemm_a8_vnni.cpp",
                                   "lowbit/csrc/cpu/dense.cpp",
                                   "lowbit/csrc/cpu/decode.cpp", "lowbit/csrc/cpu/gptq.cpp",
                                   "lowbit/csrc/cpu/ggml.cpp", "lowbit/csrc/cpu/gemm_f32.cpp",
                                   "lowbit/csrc/cpu/gemm_amx.cpp", "lowbit/csrc/cpu/amx_linear.cpp",
                                   "lowbit/csrc/cpu/attend_amx.cpp"],
                     depends=["lowbit/csrc/cpu/kernels.h", "lowbit/csrc/cpu/panels.h", "lowbit/csrc/cpu/simd.h",
                              "lowbit/csrc/cpu/a8_blocks.h", "lowbit/csrc/cpu/int8_epilogue.h"],
                     extra_compile_args=flags, extra_link_args=["-fopenmp"])
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
