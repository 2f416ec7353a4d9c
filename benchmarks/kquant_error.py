"""lowbit's K-quant quantizers against llama.cpp's on the same weights: relative RMS error
||W - deq(W)|| / ||W|| over the bundled model's 210 linear weights, per type.

    HF_HUB_OFFLINE=1 python benchmarks/kquant_error.py [--types Q4_K Q5_K Q6_K] [--embedding] [--threads 2]

Needs ``llama-cpp-python`` (the optional extra ``lowbit[llama]``) and the bundled model.
Times are wall-clock seconds on torch's default threads; on a machine shared with other
busy processes, set ``OMP_WAIT_POLICY=passive`` (torch's OpenMP threads otherwise spin at
every parallel region waiting for a descheduled partner, 10-100x slower).

The weights: every linear of the bundled SmolLM2-135M (stored as Q4_1 there; dequantized
to float32), transposed so that ggml's blocks run across the original Q4_1 blocks (a K-quant
sub-block lined up with a Q4_1 block would find its 16-level grid again), then cut to a row
length K that is a multiple of 256 (llama.cpp falls back to another type otherwise):
[1536, 576] -> [576, 1536]; [576, 576] -> [576, 512]; [576, 1536] -> [1536, 512]; the
[192, 576] k/v projections -> [576, 192] -> [432, 256].  ``--embedding`` adds the token
embedding [49152, 576] cut to [49152, 512] (not transposed: it is Q8_0, nearly continuous).

llama.cpp: the weights are written as an F32 llama GGUF (the bundled model's metadata)
and quantized by ``llama_cpp.llama_model_quantize`` with ``pure`` set (every 2-D tensor
gets the one type: Q4_K_S -> Q4_K, Q5_K_S -> Q5_K, Q6_K -> Q6_K, Q3_K_S -> Q3_K,
Q2_K -> Q2_K; the type of each output tensor is checked) and no importance matrix, so
llama.cpp runs its reference quantizers (``quantize_row_q4_K_ref`` etc.).  Its time
includes reading and writing the files.  Both outputs are dequantized by
``lowbit.formats.ggml.dequantize``.

lowbit: ``lowbit.formats.kquants.quantize(W, type)`` (importance=None, the same
information llama.cpp gets); the row "lowbit, importance=1" runs the weighted code path
with uniform weights (same error expected, its time shown).  Ratio = lowbit / llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FTYPES = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q6_K": "Q6_K"}


def benchmark_weights(embedding: bool) -> dict[str, torch.Tensor]:
    """The bundled model's 2-D weights as float32 [N, K], K a multiple of 256 (module docstring)."""
    from lowbit.formats import ggml
    from lowbit.formats.gguf_file import read_gguf

    out = {}
    for t in read_gguf().tensors:
        shape = [int(n) for n in reversed(t.shape)]
        if len(shape) != 2 or (t.name == "token_embd.weight" and not embedding):
            continue
        raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(-1).copy())
        w = ggml.dequantize(raw, t.tensor_type.name, shape)
        if t.name == "token_embd.weight":
            w = w[:, :512]
        else:
            w = w.T
            k = w.shape[1]
            w = w[:, : k // 256 * 256] if k >= 256 else w.reshape(-1, 256)
        out[t.name] = w.contiguous()
    return out


def write_f32_gguf(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """A llama GGUF with the bundled model's metadata and ``weights`` (plus its 1-D norms) as F32."""
    import gguf

    from lowbit.formats.gguf_file import read_gguf

    reader = read_gguf()
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name in weights:
            writer.add_tensor(t.name, weights[t.name].numpy())
        elif len(t.shape) == 1:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_quantize(src: Path, dst: Path, name: str, threads: int) -> tuple[dict[str, torch.Tensor], float]:
    """Raw bytes of every 2-D tensor llama.cpp wrote as ``name``, and the seconds it took."""
    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPES[name]}")
    params.pure = True
    params.nthread = threads
    start = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    seconds = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {name} failed with code {rc}")
    out = {}
    for t in gguf.GGUFReader(str(dst)).tensors:
        if len(t.shape) == 2:
            if t.tensor_type.name != name:
                raise RuntimeError(f"llama.cpp wrote {t.name} as {t.tensor_type.name}, not {name}")
            out[t.name] = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(-1).copy())
    return out, seconds


def relative_rms(weights: dict[str, torch.Tensor], raws: dict[str, torch.Tensor], name: str) -> float:
    """||W - deq|| / ||W|| over all the tensors together."""
    from lowbit.formats import ggml

    err = total = 0.0
    for key, w in weights.items():
        deq = ggml.dequantize(raws[key].reshape(-1), name, w.shape)
        err += float((deq.double() - w.double()).square().sum())
        total += float(w.double().square().sum())
    return (err / total) ** 0.5


def lowbit_quantize(weights: dict[str, torch.Tensor], name: str, uniform_importance: bool):
    from lowbit.formats import kquants

    out = {}
    start = time.perf_counter()
    for key, w in weights.items():
        imp = torch.ones(w.shape[1]) if uniform_importance else None
        out[key] = kquants.quantize(w, name, importance=imp)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"], choices=list(FTYPES),
                        help="K-quant types to compare (default: Q4_K Q5_K Q6_K)")
    parser.add_argument("--embedding", action="store_true", help="also quantize the token embedding")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's quantize threads (default 2)")
    args = parser.parse_args()

    weights = benchmark_weights(args.embedding)
    n = sum(w.numel() for w in weights.values())
    print(f"{len(weights)} tensors, {n / 1e6:.1f}M values, torch threads {torch.get_num_threads()}, "
          f"llama.cpp threads {args.threads}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        write_f32_gguf(src, weights)
        for name in args.types:
            theirs, t_llama = llama_cpp_quantize(src, Path(tmp) / f"{name}.gguf", name, args.threads)
            e_llama = relative_rms(weights, {k: theirs[k] for k in weights}, name)
            for label, uniform in (("importance=None", False), ("importance=1", True)):
                ours, t_ours = lowbit_quantize(weights, name, uniform)
                e_ours = relative_rms(weights, ours, name)
                rows.append((name, label, e_llama, e_ours, t_llama, t_ours))
                print(f"  {name} {label}: done", flush=True)
    print()
    print(f"{'type':6} {'lowbit run':16} {'llama.cpp rel RMS':>17} {'lowbit rel RMS':>14} {'ratio':>7} "
          f"{'llama.cpp s':>11} {'lowbit s':>9}")
    for name, label, e_llama, e_ours, t_llama, t_ours in rows:
        print(f"{name:6} {label:16} {e_llama:17.5f} {e_ours:14.5f} {e_ours / e_llama:7.4f} "
              f"{t_llama:11.2f} {t_ours:9.2f}")


if __name__ == "__main__":
    main()
