"""Mixed int8/int4 weights (lowbit.SplitQTensor): the format, the choice of outlier
channels, lowbit::split_matmul on every backend against the reference, the module."""

import json

import pytest
import torch

import lowbit
from lowbit.kernels import reference
from lowbit.nn import SplitQuantLinear
from lowbit.ops.matmul import weight_parts
from lowbit.ops.split import choose_outliers, split_dequantize
from lowbit.qtensor import QTensor, SplitQTensor

from .conftest import FAST_BACKENDS, skip_large_for_interpreter
from .test_matmul import UNIT, weight_only_tolerance


def planted(n=48, k=256, columns=(3, 70, 200), factor=25.0, seed=0):
    """A weight whose few columns are large (they set their groups' ranges)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, list(columns)] *= factor
    return w


def test_the_reference_is_the_float64_matmul_of_the_summed_weight():
    st = lowbit.split_quantize(planted(), "int4-asym-g64", 8)
    low, high = st.low, st.high
    w = reference.dequantize_packed(low.codes, low.scale, low.zero_point, low.scheme, low.shape, torch.float64)
    w[:, st.outliers] += reference.dequantize_packed(high.codes, high.scale, high.zero_point, high.scheme,
                                                    high.shape, torch.float64)
    x = torch.randn(5, 256)
    y = reference.split_matmul(x, *weight_parts(low), st.outliers, *weight_parts(high))
    exact = x.double() @ w.T
    # one float32 matmul of K = 256 products: |error| <= gamma_K * sum |x| |w| (+ the float32 weight)
    bound = 2 * 256 * 2.0**-24 * (x.double().abs() @ w.abs().T) + 2.0**-24 * exact.abs()
    assert bool(((y.double() - exact).abs() <= bound).all())
    assert torch.equal(split_dequantize(st, torch.float64), w)


def split_tolerance(x, st, y_ref, backend):
    """backend.split_matmul is two weight-only matmuls (each within weight_only_tolerance of
    its part's exact product, which also bounds the reference's float32 sums of that part,
    as |W| <= |low| + |high| columnwise), each rounded to x's dtype, summed in float32 and
    rounded once more to x's dtype."""
    low_ref = lowbit.linear(x, st.low, backend="reference")
    xh = x.index_select(-1, st.outliers)
    high_ref = lowbit.linear(xh, st.high, backend="reference")
    u = UNIT[x.dtype]
    return (weight_only_tolerance(x, st.low, low_ref, backend) + weight_only_tolerance(xh, st.high, high_ref, backend)
            + 2 * u * y_ref.double().abs() + u * (low_ref.double().abs() + high_ref.double().abs()))


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("low,count", [("int4-asym-g64", 16), ("int4-sym-g32", 5), ("int8-sym-g64", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 33])
def test_split_matmul_matches_the_reference(backend, low, count, dtype, m):
    n, k = 48, 256
    skip_large_for_interpreter(backend, m, n, k)
    st = lowbit.split_quantize(planted(n, k), low, count)
    x = torch.randn(m, k).to(dtype)
    y_ref = reference.split_matmul(x, *weight_parts(st.low), st.outliers, *weight_parts(st.high))
    y = lowbit.linear(x, st, backend=backend)
    assert y.dtype == dtype and y.shape == (m, n)
    err = (y.double() - y_ref.double()).abs()
    assert bool((err <= split_tolerance(x, st, y_ref, backend)).all()), float(err.max())


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("high,count", [("int8-asym", 12), ("int8-sym-g16", 32), ("int8-asym-g8-zpfloat-f16", 24),
                                        ("int8-sym", 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_split_matmul_with_each_kind_of_high_part(backend, high, count, dtype, m):
    # unsigned codes with an integer or float zero point, groups, and an odd count (the
    # cpu kernel's 8-wide loop and its scalar tail)
    n, k = 40, 128
    st = lowbit.split_quantize(planted(n, k, columns=(3, 70, 100)), "int4-asym-g32", count, high=high)
    x = torch.randn(m, k).to(dtype)
    y_ref = reference.split_matmul(x, *weight_parts(st.low), st.outliers, *weight_parts(st.high))
    err = (lowbit.linear(x, st, backend=backend).double() - y_ref.double()).abs()
    assert bool((err <= split_tolerance(x, st, y_ref, backend)).all()), float(err.max())


def test_split_matmul_passes_the_gradient_to_x():
    st = lowbit.split_quantize(planted(), "int4-asym-g64", 8)
    x = torch.randn(3, 256, requires_grad=True)
    lowbit.linear(x, st).square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (x2 @ lowbit.dequantize(st).T).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-4, atol=1e-3)


def test_a_split_tensor_with_a_min_zero_point_high_part_is_refused():
    st = lowbit.split_quantize(planted(), "int4-asym-g64", torch.tensor([3, 70]))
    w = planted()
    high = lowbit.quantize(w[:, [3, 70]], "int8-asym-zpmin")
    with pytest.raises(ValueError, match="high must be an 8-bit"):
        lowbit.linear(torch.randn(2, 256), SplitQTensor(st.low, high, st.outliers))


def test_split_quantize_keeps_outliers_exactly_out_of_the_low_part():
    w = planted()
    st = lowbit.split_quantize(w, "int4-asym-g64", torch.tensor([3, 70, 200]))
    low = lowbit.dequantize(st.low)
    assert torch.equal(low[:, st.outliers], torch.zeros(48, 3))  # the codes are the zero point
    w0 = w.clone()
    w0[:, [3, 70, 200]] = 0
    assert torch.equal(low, lowbit.dequantize(lowbit.quantize(w0, "int4-asym-g64")))
    # the int8 part holds the outlier columns to half a step of its per-row scale (plus the
    # float32 roundings of the division and the product, 2^-24 |w| each)
    cols = w[:, st.outliers]
    err = (lowbit.dequantize(st)[:, st.outliers] - cols).abs()
    assert bool((err <= st.high.scale.reshape(-1, 1) / 2 + 2.0**-23 * cols.abs()).all())


@pytest.mark.parametrize("low", ["int4-asym-g64", "int4-sym-g32", "int4-asym-g32-zpfloat-f16"])
def test_split_beats_plain_int4_on_planted_outlier_columns(low):
    w = planted()
    st = lowbit.split_quantize(w, low, 3)
    assert sorted(st.outliers.tolist()) == [3, 70, 200]
    plain = lowbit.dequantize(lowbit.quantize(w, low))
    assert (lowbit.dequantize(st) - w).norm() < 0.5 * (plain - w).norm()


def test_choose_outliers_by_each_criterion():
    w = torch.randn(16, 128)
    w[:, 40] *= 30  # widens its group: the largest saving, though it rounds well itself
    x_sq = torch.ones(128)
    x_sq[90] = 1e4
    assert choose_outliers(w, 1, "int4-asym-g32").tolist() == [40]
    assert choose_outliers(w, 1, "int4-asym-g32", x_sq=x_sq, by="activation").tolist() == [90]
    assert choose_outliers(w, 1, "int4-asym-g32", by="weight").tolist() == [40]
    both = choose_outliers(w, 2, "int4-asym-g32", x_sq=x_sq)
    assert both.tolist() == [40, 90]
    assert choose_outliers(w, 0, "int4-asym-g32").numel() == 0


@pytest.mark.parametrize("call,err,match", [
    (lambda w: choose_outliers(w, 65, "int4-asym-g32"), ValueError, "count must be an int in"),
    (lambda w: choose_outliers(w, 2, "int4-asym-g32", by="size"), ValueError, "by must be one of"),
    (lambda w: choose_outliers(w, 2, "int4-asym-g32", by="activation"), ValueError, "pass x_sq"),
    (lambda w: choose_outliers(w, 2, "int4-asym-g32", x_sq=torch.ones(8)), ValueError, "x_sq"),
    (lambda w: lowbit.split_quantize(w, "int3-asym-g32", 2), ValueError, "not one the weight-only matmul"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", 2, high="int4-sym"), ValueError, "high must be"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", 0), ValueError, r"outliers must be a count in \[1, 64\]"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", torch.tensor([1, 2], dtype=torch.int32)), TypeError,
     "outliers"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", 3, high="int8-sym-g16"), ValueError, "divisible by 16"),
    (lambda w: lowbit.split_quantize(w.T.contiguous()[:3], "int4-asym-g32", 2), ValueError, "group_size"),
    (lambda w: choose_outliers(w, 2, "garbage", by="weight"), ValueError, "garbage"),
    (lambda w: choose_outliers(w, 2, "int4-asym-g32", x_sq=-torch.ones(64)), ValueError, "negative"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", torch.tensor([3, 64])), ValueError, "strictly increasing"),
    (lambda w: lowbit.split_quantize(w, "int4-asym-g32", torch.tensor([5, 3])), ValueError, "strictly increasing"),
])
def test_bad_split_arguments_are_refused(call, err, match):
    with pytest.raises(err, match=match):
        call(torch.randn(8, 64))


def test_split_quantize_refuses_nan():
    w = torch.randn(8, 64)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match="w"):
        lowbit.split_quantize(w, "int4-asym-g32", 2)


@pytest.mark.parametrize("outliers,match", [
    (torch.tensor([4, 2]), "strictly increasing"),
    (torch.tensor([2, 2]), "strictly increasing"),
    (torch.tensor([2, 64]), r"in \[0, 64\)"),
    (torch.tensor([-1, 3]), r"in \[0, 64\)"),
])
def test_split_qtensor_refuses_bad_outliers(outliers, match):
    st = lowbit.split_quantize(torch.randn(8, 64), "int4-asym-g32", torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=match):
        SplitQTensor(st.low, st.high, outliers)


def test_split_qtensor_refuses_a_high_part_of_another_shape():
    st = lowbit.split_quantize(torch.randn(8, 64), "int4-asym-g32", torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"expected \[N, len\(outliers\)\]"):
        SplitQTensor(st.low, st.high, torch.tensor([1, 3, 5]))
    with pytest.raises(TypeError, match="low must be a 2-D lowbit.QTensor"):
        SplitQTensor(st.low.codes, st.high, st.outliers)
    with pytest.raises(ValueError, match="at least one"):
        SplitQTensor(st.low, QTensor(st.high.codes[:, :0], st.high.scale, None, st.high.scheme, (8, 0)),
                     torch.zeros(0, dtype=torch.int64))


def test_split_runs_weight_only():
    st = lowbit.split_quantize(torch.randn(8, 64), "int4-asym-g32", 2)
    with pytest.raises(ValueError, match="runs weight-only"):
        lowbit.linear(torch.randn(2, 64), st, act_scheme="int8-sym-token")


def test_split_tensor_is_a_pytree_and_exports():
    import torch.utils._pytree as pytree

    st = lowbit.split_quantize(planted(), "int4-asym-g64", 4)
    leaves, spec = pytree.tree_flatten(st)
    back = pytree.tree_unflatten(leaves, spec)
    assert torch.equal(lowbit.dequantize(back), lowbit.dequantize(st))
    lin = torch.nn.Linear(256, 48)
    lin.weight.data = planted()
    q = SplitQuantLinear.from_linear(lin, "int4-asym-g64", 4)
    x = torch.randn(3, 256)
    ep = torch.export.export(q, (x,))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "lowbit.split_matmul.default" in ops
    assert torch.equal(ep.module()(x), q(x))


def test_split_module_matches_the_split_linear_with_bias():
    lin = torch.nn.Linear(256, 48)
    lin.weight.data = planted()
    q = SplitQuantLinear.from_linear(lin, "int4-asym-g64", 16, x_sq=torch.rand(256))
    x = torch.randn(4, 256)
    assert torch.equal(q(x), lowbit.linear(x, q.qweight, lin.bias))
    assert sorted(q.state_dict()) == ["bias", "weight.high.codes", "weight.high.scale", "weight.low.codes",
                                      "weight.low.scale", "weight.low.zero_point", "weight.outliers"]
    expected = x @ q.dequantized_weight().T + lin.bias
    assert torch.allclose(q(x), expected, rtol=1e-5, atol=1e-4)


def test_formats_refuse_split_modules_by_name(tiny, tmp_path):
    from lowbit.formats.compressed_tensors import CompressedTensorsError, export_compressed_tensors
    from lowbit.formats.gguf_export import GGUFExportError, export_gguf

    model, tok = lowbit.load_model(tiny)
    name = "model.layers.0.mlp.down_proj"
    lowbit.quantize_model(model, "w4a16-g64")
    model.set_submodule(name, SplitQuantLinear.from_linear(torch.nn.Linear(128, 64), "int4-asym-g64", 16))
    for call, err in [(lambda: lowbit.save_quantized(model, tmp_path / "ckpt"), ValueError),  # not recorded
                      (lambda: export_gguf(model, tok, tmp_path / "m.gguf"), GGUFExportError),
                      (lambda: export_compressed_tensors(model, tok, tmp_path / "ct"), CompressedTensorsError)]:
        with pytest.raises(err, match=f"'{name}' is a SplitQuantLinear"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_split_model_saves_and_loads_bit_for_bit(tiny, tmp_path):
    from lowbit.models import split_model
    from lowbit.models.checkpoint import read_metadata

    model, tok = lowbit.load_model(tiny)
    ids = torch.randint(0, 1000, (2, 16))
    split_model(model, "int4-asym-g32", 16, calibration=ids)
    path = lowbit.save_quantized(model, tmp_path / "ckpt", tok)
    spec = read_metadata(path)["modules"]["model.layers.0.mlp.down_proj"]
    assert spec == {"kind": "split", "weight": "int4-asym-g32", "activation": None, "high": "int8-sym"}
    loaded, _ = lowbit.load_quantized(path)
    assert type(loaded.model.layers[0].mlp.down_proj) is SplitQuantLinear
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_split_checkpoint_with_bad_outliers_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    from lowbit.models import split_model
    from lowbit.models.checkpoint import CheckpointError
    from lowbit.models.common import sha256

    model, tok = lowbit.load_model(tiny)
    split_model(model, "int4-asym-g32", 8, modules=r"layers\.0\.mlp\.down_proj$")
    path = lowbit.save_quantized(model, tmp_path / "ckpt", tok)
    key = "model.layers.0.mlp.down_proj.weight.outliers"
    tensors = load_file(path / "model.safetensors")
    tensors[key] = tensors[key].flip(0).contiguous()  # decreasing: refused by name
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((path / "lowbit.json").read_text())
    meta["sha256"][key] = sha256(tensors[key])
    (path / "lowbit.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="strictly increasing"):
        lowbit.load_quantized(path)


def test_formats_refuse_sparse_modules_by_name(tiny, tmp_path):
    from lowbit.formats.compressed_tensors import CompressedTensorsError, export_compressed_tensors
    from lowbit.formats.gguf_export import GGUFExportError, export_gguf
    from lowbit.sparse import SparseQuantLinear

    model, tok = lowbit.load_model(tiny)
    name = "model.layers.0.mlp.up_proj"
    lowbit.quantize_model(model, "w4a16-g64")
    model.set_submodule(name, SparseQuantLinear.from_linear(torch.nn.Linear(64, 128), "int4-asym-g32"))
    for call, err in [(lambda: lowbit.save_quantized(model, tmp_path / "ckpt"), ValueError),
                      (lambda: export_gguf(model, tok, tmp_path / "m.gguf"), GGUFExportError),
                      (lambda: export_compressed_tensors(model, tok, tmp_path / "ct"), CompressedTensorsError)]:
        with pytest.raises(err, match=f"'{name}' is a SparseQuantLinear"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
