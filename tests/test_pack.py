import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit

from lowbit.kernels import reference
from lowbit.ops import pack_bits, pack_int4, unpack_bits, unpack_int4

from .conftest import BACKENDS, gen


@pytest.mark.parametrize("backend", BACKENDS)
@given(bits=st.sampled_from([2, 3, 4]), packing=st.sampled_from(["u32", "u8"]), signed=st.booleans(),
       rows=st.integers(0, 5), units=st.integers(0, 4), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trips_exactly(backend, bits, packing, signed, rows, units, seed):
    word = 32 if packing == "u32" else 8
    k = units * reference.math.lcm(bits, word) // bits
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    q = torch.randint(lo, hi, (rows, k), generator=gen(seed), dtype=torch.int8 if signed else torch.uint8)
    packed = pack_bits(q, bits, packing, backend=backend)
    assert packed.dtype == (torch.int32 if packing == "u32" else torch.uint8)
    assert packed.shape == (rows, k * bits // word)
    assert torch.equal(packed, reference.pack(q, bits, packing))  # same layout on every backend
    assert torch.equal(unpack_bits(packed, bits, packing, signed=signed, backend=backend), q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int4_layouts_are_the_documented_ones(backend):
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int8)
    # u32x8: element j in bits 4j..4j+3 of one int32
    word = pack_int4(q, "u32x8", backend=backend).item()
    assert word & 0xFFFFFFFF == 0x87654321
    # u8x2: even element in the low nibble
    assert pack_int4(q, "u8x2", backend=backend).tolist() == [[0x21, 0x43, 0x65, 0x87]]
    assert torch.equal(unpack_int4(pack_int4(q, backend=backend), signed=True, backend=backend), q)
    u = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    assert torch.equal(unpack_int4(pack_int4(u, "u8x2"), "u8x2", signed=False, backend=backend), u)


def test_three_bit_codes_straddle_words_as_a_little_endian_bit_stream():
    q = torch.full((1, 32), 7, dtype=torch.uint8)
    q[0, 10] = 0  # bits 30..32: two bits at the top of word 0, one at the bottom of word 1
    words = pack_bits(q, 3, "u32")
    assert words.shape == (1, 3)
    w0, w1 = (words[0, 0].item() & 0xFFFFFFFF), (words[0, 1].item() & 0xFFFFFFFF)
    assert w0 >> 30 == 0 and w1 & 1 == 0 and w0 & 0x3FFFFFFF == 0x3FFFFFFF


@pytest.mark.parametrize("bad, match", [
    (lambda: pack_int4(torch.zeros(2, 7, dtype=torch.int8)), "multiple of 8"),
    (lambda: pack_int4(torch.zeros(2, 8)), "q must have dtype"),
    (lambda: pack_int4(torch.full((1, 8), 16, dtype=torch.int32)), "q holds values"),
    (lambda: pack_int4(torch.tensor([[-1, 9, 0, 0, 0, 0, 0, 0]])), "q holds values"),
    (lambda: pack_int4(torch.zeros(1, 8, dtype=torch.int8), "u16x4"), "layout"),
    (lambda: pack_bits(torch.zeros(1, 8, dtype=torch.int8), 5), "bits"),
    (lambda: unpack_int4(torch.zeros(1, 1, dtype=torch.uint8), signed=True), "packed must have dtype"),
    (lambda: unpack_int4(torch.zeros(1, 1, dtype=torch.int32), signed=1), "signed"),
    (lambda: unpack_bits(torch.zeros(1, 2, dtype=torch.int32), 3, signed=True), "multiple of 3"),
])
def test_bad_pack_arguments_are_refused_with_a_clear_error(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_pack_leaves_its_input_alone(backend):
    """Out of place: the codes passed in keep their values and version (and an expanded
    or inference-mode tensor can be packed)."""
    if backend not in lowbit.available_backends("cpu"):
        pytest.skip("no cpu backend")
    q = torch.arange(32, dtype=torch.uint8).reshape(2, 16) % 16
    version, before = q._version, q.clone()
    lowbit.ops.pack_bits(q, 4, "u32", backend=backend)
    assert q._version == version and torch.equal(q, before)
    with torch.inference_mode():
        made = torch.randint(0, 16, (2, 16), dtype=torch.uint8)
    lowbit.ops.pack_bits(made, 4, "u32", backend=backend)
    lowbit.ops.pack_bits(torch.tensor([3], dtype=torch.uint8).expand(2, 16), 2, "u32", backend=backend)
