"""int32 accumulator dequantization (the W8A8 epilogue): int32 accumulators -> bf16/fp16/fp32, bit-exact formula."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit.ops import dequantize_accumulator

from .conftest import BACKENDS, gen

OUT = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@given(m=st.integers(0, 6), groups=st.integers(1, 4), group_size=st.sampled_from([1, 3, 32, 64, 128]),
       per_row=st.booleans(), out_dtype=st.sampled_from(OUT),
       scale_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31))
def test_grouped_form_is_float32_acc_times_scale_rounded_once(backend, m, groups, group_size, per_row,
                                                              out_dtype, scale_dtype, seed):
    g = gen(seed)
    n = groups * group_size
    acc = torch.randint(-2**31, 2**31 - 1, (m, n), generator=g, dtype=torch.int32)
    acc[:, :1] = 2**31 - 1  # extremes: float32(acc) rounds
    sshape = (m, groups) if per_row else (groups,)
    scale = (torch.rand(sshape, generator=g) * 1e-6).to(scale_dtype)
    out = dequantize_accumulator(acc, scale, group_size, out_dtype=out_dtype, backend=backend)
    per_element = scale.float().repeat_interleave(group_size, dim=-1)
    assert torch.equal(out, (acc.float() * per_element).to(out_dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", OUT)
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_rowcol_form_is_evaluated_left_to_right_in_float32(backend, out_dtype, lead):
    acc = torch.randint(-2**24, 2**24, (*lead, 96), dtype=torch.int32)
    row = torch.rand(lead) * 0.01
    col = torch.rand(96).to(torch.bfloat16)
    out = dequantize_accumulator(acc, row_scale=row, col_scale=col, out_dtype=out_dtype, backend=backend)
    assert torch.equal(out, ((acc.float() * row[..., None]) * col.float()).to(out_dtype))


def test_group_size_is_inferred_from_the_scale():
    acc = torch.randint(-1000, 1000, (4, 256), dtype=torch.int32)
    scale = torch.rand(2)
    assert torch.equal(dequantize_accumulator(acc, scale), dequantize_accumulator(acc, scale, 128))


A = torch.zeros(4, 128, dtype=torch.int32)


@pytest.mark.parametrize("args, kwargs, err, match", [
    ((A.float(), torch.ones(4)), {}, TypeError, "acc must have dtype"),
    ((A, torch.ones(4), 48), {}, ValueError, "group_size=48 does not divide"),
    ((A, torch.ones(3)), {}, ValueError, "cannot infer group_size"),
    ((A, torch.ones(4), 0), {}, ValueError, "group_size must be a positive int"),
    ((A, torch.ones(2), 32), {}, ValueError, "scale must have shape"),
    ((A, torch.ones(4, dtype=torch.float64), 32), {}, TypeError, "scale must have dtype"),
    ((A, torch.ones(4), 32), {"out_dtype": torch.int8}, TypeError, "out_dtype"),
    ((A,), {}, ValueError, "give scale"),
    ((A, torch.ones(4)), {"row_scale": torch.ones(4), "col_scale": torch.ones(128)}, ValueError, "not both"),
    ((A,), {"row_scale": torch.ones(3), "col_scale": torch.ones(128)}, ValueError, "row_scale must have shape"),
    ((A,), {"row_scale": torch.ones(4), "col_scale": torch.ones(64)}, ValueError, "col_scale must have shape"),
    ((A,), {"row_scale": torch.ones(4), "col_scale": torch.ones(128, device="meta")}, ValueError, "col_scale is on meta"),
    ((A, torch.ones(4, device="meta"), 32), {}, ValueError, "scale is on meta"),
])
def test_bad_arguments_are_refused_before_any_work(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        dequantize_accumulator(*args, **kwargs)


def test_zero_sized_accumulators_are_a_no_op():
    for backend in BACKENDS:
        assert dequantize_accumulator(torch.empty(0, 64, dtype=torch.int32), torch.ones(2),
                                      backend=backend).shape == (0, 64)
