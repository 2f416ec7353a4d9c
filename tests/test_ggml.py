"""lowbit.formats.ggml against the gguf package, the format's reference implementation:
bit-identical bytes from quantize, bit-identical float32 from dequantize."""

import numpy as np
import pytest
import torch

from lowbit.formats import ggml

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

GT = gguf.GGMLQuantizationType
BLOCK_TYPES = [n for n in ggml.TYPES if n not in ("F32", "F16", "BF16")]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as bit patterns (NaN payloads included)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def odd_weights(rows: int, k: int) -> torch.Tensor:
    """Random weights plus the blocks a quantizer gets wrong first: all zero, constant,
    one outlier, ties at the largest magnitude, denormals, a huge range, exact halves."""
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
    x[0, :32] = 0
    x[1, :32] = 0.75
    x[2, :32] = 0
    x[2, 7] = -3.0
    x[3, :32] = torch.tensor([1.0, -1.0] * 16)  # tie between +max and -max: the first wins
    x[4, :32] = 1e-30  # its scale underflows float16 to 0
    x[5, :32] = torch.linspace(-6e4, 6e4, 32)
    x[6, :32] = torch.arange(32) / 2 - 8  # values on half steps
    return x


@pytest.mark.parametrize("name", ggml.QUANTIZABLE)
def test_quantize_is_bit_identical_with_gguf(name):
    x = odd_weights(16, 256)
    ours = ggml.quantize(x, name)
    theirs = gguf_quantize(x.numpy(), GT[name])
    assert ours.shape == (16, ggml.nbytes(name, [256]))
    assert np.array_equal(ours.numpy(), np.ascontiguousarray(theirs).view(np.uint8).reshape(ours.shape))


@pytest.mark.parametrize("name", list(ggml.TYPES))
def test_dequantize_is_bit_identical_with_gguf_on_random_bytes(name):
    """Random bytes reach every code, sub-scale and fp16 scale, NaN, infinite and
    denormal included; then blocks whose scales are set to those values on purpose."""
    t = ggml.block_type(name)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(64, t.type_size), dtype=np.uint8)
    if t.block_size > 1:
        d_at = {"Q2_K": 80, "Q3_K": 108, "Q6_K": 208}.get(name, 0)
        for row, half in enumerate([0x0000, 0x0001, 0x03FF, 0x7C00, 0xFC00, 0x7E00, 0x8000]):
            raw[row, d_at:d_at + 2] = np.frombuffer(np.uint16(half).tobytes(), np.uint8)
        raw[10] = 0  # an all-zero block
    with np.errstate(all="ignore"):
        theirs = gguf_dequantize(raw, GT[name]).reshape(64, -1)
    ours = ggml.dequantize(torch.from_numpy(raw), name, [64, t.block_size], backend="reference")
    assert same_bits(ours.numpy(), theirs)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_cpu_kernel_equals_the_reference(name):
    """Every bit of every value, on random bytes (NaN scales included: there only the
    NaN-ness must agree, a payload may differ); then on finite blocks, all bits."""
    t = ggml.block_type(name)
    raw = torch.randint(0, 256, (3000, t.type_size), dtype=torch.uint8)
    ref = ggml.dequantize(raw, name, [3000, t.block_size], backend="reference")
    fast = ggml.dequantize(raw, name, [3000, t.block_size], backend="cpu")
    nan = ref.isnan()
    assert torch.equal(nan, fast.isnan())
    assert torch.equal(ref[~nan].view(torch.int32), fast[~nan].view(torch.int32))
    assert nan.any() and not nan.all()  # the random bytes did reach NaN and finite scales

@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_every_block_type_loads_into_a_lossless_qtensor(name, backend):
    """``as_qtensor`` keeps the file's codes and scales: lowbit's dequantization of it is
    ggml's, bit for bit, on random bytes (every code and sub-scale, negative scales, fp16
    denormal scales; NaN/inf scales only need to give NaN/inf where ggml does)."""
    import lowbit

    t = ggml.block_type(name)
    raw = torch.randint(0, 256, (24, 2 * t.type_size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    shape = [24, 2 * t.block_size]
    qt = ggml.as_qtensor(raw, name, shape)
    assert str(qt.scheme) == ggml.LOSSLESS_SCHEMES[name] and qt.shape == torch.Size(shape)
    ref = ggml.dequantize(raw, name, shape, backend="reference")
    ours = lowbit.dequantize(qt, torch.float32, backend=backend)
    finite = ref.isfinite()
    assert torch.equal(finite, ours.isfinite()) and finite.float().mean() > 0.5
    assert torch.equal(ref[finite].view(torch.int32), ours[finite].view(torch.int32))
    assert torch.equal(ref[~finite].isnan(), ours[~finite].isnan())
    assert qt.nbytes < 4 * ref.numel() / 3  # no float copy: at most 10 bits per value


def test_float_types_have_no_qtensor():
    assert ggml.as_qtensor(torch.zeros(8, 4 * 32, dtype=torch.uint8), "F32", [8, 32]) is None


def test_dequantize_every_tensor_of_the_bundled_model():
    from lowbit.formats.gguf_file import read_gguf

    reader = read_gguf()
    kinds = set()
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8))
        theirs = gguf_dequantize(t.data, t.tensor_type).reshape(shape)
        for backend in ("reference", "cpu"):
            assert same_bits(ggml.dequantize(raw, t.tensor_type.name, shape, backend=backend).numpy(), theirs), t.name
        kinds.add(t.tensor_type.name)
    assert kinds == {"F32", "Q4_1", "Q8_0"}


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_pack_simple_is_the_inverse_of_reading_the_parts(name):
    raw = ggml.quantize(odd_weights(8, 64), name).reshape(-1, ggml.block_type(name).type_size)
    d, m, q = ggml._simple_parts(raw, name)
    half = lambda v: None if v is None else v.to(torch.float16)  # noqa: E731  (exact: read from float16)
    assert torch.equal(ggml.pack_simple(name, q, half(d), half(m)), raw)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown ggml type 'Q9_9'"):
        ggml.block_type("Q9_9")
    with pytest.raises(ValueError, match="Q4_0 data of shape \\[64\\] is 36 bytes, got 35"):
        ggml.dequantize(torch.zeros(35, dtype=torch.uint8), "Q4_0", [64])
    with pytest.raises(ValueError, match="whole 32-value blocks, got shape \\[2, 48\\]"):
        ggml.quantize(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(ValueError, match="non-finite"):
        ggml.quantize(torch.tensor([[float("nan")] * 32]), "Q4_1")
    with pytest.raises(ValueError, match="no quantizer for ggml type Q4_K"):
        ggml.quantize(torch.zeros(1, 256), "Q4_K")
    with pytest.raises(TypeError, match="raw must be a uint8"):
        ggml.dequantize(torch.zeros(18), "Q4_0", [32])
