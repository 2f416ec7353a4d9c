import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit import SCHEME_PRESETS, QuantScheme


@st.composite
def schemes(draw):
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    symmetric = draw(st.booleans())
    granularity = draw(st.sampled_from(["tensor", "channel", "token", "group"]))
    packing = draw(st.sampled_from(["u32", "u8"]))
    unit = QuantScheme(bits, packing=packing).pack_unit
    group_size = unit * draw(st.integers(1, 8)) if granularity == "group" else None
    zpd = "int" if symmetric else draw(st.sampled_from(["int", "float"]))
    sd = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return QuantScheme(bits, symmetric, granularity, group_size, sd, zpd, packing if bits < 8 else "u32")


@given(schemes())
def test_string_form_round_trips(s):
    assert QuantScheme.parse(str(s)) == s


def test_presets_are_valid_and_round_trip():
    for name, s in SCHEME_PRESETS.items():
        assert QuantScheme.parse(name) == s
        assert QuantScheme.parse(str(s)) == s


def test_code_ranges_follow_the_convention():
    s = QuantScheme.parse("int4-sym-g32")
    assert (s.qmin, s.qmax, s.code_dtype) == (-8, 7, torch.int32)
    a = QuantScheme.parse("int8-asym-token")
    assert (a.qmin, a.qmax, a.code_dtype, a.zero_point_dtype) == (0, 255, torch.uint8, torch.uint8)
    assert QuantScheme.parse("int3-asym-g32").pack_unit == 32  # 32 values fill 3 int32 words
    assert QuantScheme.parse("int3-asym-g32-u8").pack_unit == 8


@pytest.mark.parametrize("kwargs, field", [
    (dict(bits=5), "bits"),
    (dict(bits=True), "bits"),
    (dict(granularity="row"), "granularity"),
    (dict(granularity="group"), "group_size"),
    (dict(granularity="group", group_size=0), "group_size"),
    (dict(bits=4, granularity="group", group_size=12), "group_size"),
    (dict(granularity="channel", group_size=32), "group_size"),
    (dict(scale_dtype=torch.float64), "scale_dtype"),
    (dict(symmetric=True, zero_point_domain="float"), "zero_point_domain"),
    (dict(symmetric=False, zero_point_domain="fp"), "zero_point_domain"),
    (dict(packing="u16"), "packing"),
    (dict(symmetric=1), "symmetric"),
])
def test_invalid_scheme_names_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"QuantScheme.{field}"):
        QuantScheme(**kwargs)


@pytest.mark.parametrize("text", ["int4", "int4-sym-g", "int4-sym-foo", "float4-sym", "int9-sym"])
def test_unparseable_strings_are_refused(text):
    with pytest.raises(ValueError):
        QuantScheme.parse(text)
