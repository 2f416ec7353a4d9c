"""Static per-tensor activation quantization: a QuantLinear holds a calibrated
``act_scale`` (and ``act_zero_point``), refuses to run without it, saves and loads it,
and the runtime computes with it."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowbit
from lowbit.models.checkpoint import CheckpointError
from lowbit.models.common import sha256
from lowbit.models.quantize import _set_module, plan
from lowbit.nn import QuantLinear, act_qparams_from_range
from lowbit.ops import choose_qparams, dequantize, fake_quantize
from lowbit.runtime import Runner

from .conftest import BACKENDS, gen, skip_large_for_interpreter
from .test_matmul import U32, abs_products, gamma

ACTS = ["int8-sym-tensor", "int8-asym-tensor"]
WEIGHTS = ["int8-sym", "int4-asym-g64"]  # W8A8 and W4A8
NAN = float("nan")


class FakeQuantLinear(nn.Module):
    """The readable reference of a calibrated QuantLinear: x fake-quantized with its static
    qparams, then a float32 matmul with the dequantized weight."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.w, self.bias = dequantize(q.qweight), q.bias
        self.act, self.scale, self.zp = q.act_scheme, q.act_scale, q.act_zero_point

    def forward(self, x):
        return F.linear(fake_quantize(x.float(), self.act, self.scale, self.zp), self.w, self.bias).to(x.dtype)


# -- qparams from an observed range --------------------------------------------------------------
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("lo, hi", [(-1.0, 3.0), (-2.5, -0.25), (0.125, 7.0), (-3.0, 3.0), (0.0, 0.0)])
def test_qparams_from_a_range_are_choose_qparams_of_a_tensor_with_that_range(act, lo, hi):
    x = lo + (hi - lo) * torch.rand(16, 64, generator=gen(1))
    x[0, 0], x[-1, -1] = lo, hi  # min and max exactly lo and hi
    scale, zp = act_qparams_from_range(act, lo, hi)
    want_scale, want_zp = choose_qparams(x, act)
    assert torch.equal(scale, want_scale)
    assert (zp is None and want_zp is None) if act.startswith("int8-sym") else torch.equal(zp, want_zp)
    # tensors of one value are ranges too
    scale2, _ = act_qparams_from_range(act, torch.tensor(lo), torch.tensor([hi]))
    assert torch.equal(scale2, scale)


@pytest.mark.parametrize("args, match", [
    (("int8-sym-tensor", 1.0, -1.0), "min_val=1.0 is greater than max_val=-1.0"),
    (("int8-sym-tensor", NAN, 1.0), "min_val must be a finite number"),
    (("int8-asym-tensor", -1.0, math.inf), "max_val must be a finite number"),
    (("int8-sym-tensor", torch.zeros(2), 1.0), "min_val must hold one value"),
    (("int8-sym-token", -1.0, 1.0), "must be per tensor"),
])
def test_a_bad_range_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        act_qparams_from_range(*args)


# -- QuantLinear -----------------------------------------------------------------------------------
def _qlinear(weight="int8-sym", act="int8-sym-tensor", k=128, n=48):
    torch.manual_seed(3)
    return QuantLinear.from_linear(nn.Linear(k, n), weight, act_scheme=act)


@pytest.mark.parametrize("act", ACTS)
def test_forward_before_calibration_is_refused_before_any_work(act):
    q = _qlinear(act=act)
    assert q.act_scale is None and q.act_zero_point is None and not q.act_calibrated
    assert "act_scale" not in q.state_dict()  # nothing to save yet
    with pytest.raises(ValueError, match=r"activation scale not calibrated: act_scheme 'int8-.*-tensor'"):
        q(torch.randn(2, 128))
    # checked first: an input lowbit.linear would refuse for its dtype still gets this error
    with pytest.raises(ValueError, match="activation scale not calibrated"):
        q(torch.zeros(2, 128, dtype=torch.int64))
    q.set_act_range(-4.0, 4.0)
    assert q.act_calibrated and q(torch.randn(2, 128)).shape == (2, 48)


def test_per_token_and_weight_only_modules_need_no_calibration_and_take_none():
    for act in ["int8-sym-token", None]:
        q = _qlinear(act=act)
        assert q.act_calibrated and q(torch.randn(2, 128)).shape == (2, 48)
        with pytest.raises(ValueError, match="needs a per-tensor act_scheme"):
            q.set_act_qparams(torch.tensor([0.1]))
        with pytest.raises(ValueError, match="needs a per-tensor act_scheme"):
            q.set_act_range(-1.0, 1.0)


def test_a_float_zero_point_activation_scheme_is_refused():
    with pytest.raises(ValueError, match="float zero point"):
        _qlinear(act="int8-asym-tensor-zpfloat")


@pytest.mark.parametrize("act, scale, zp, error, match", [
    ("int8-sym-tensor", torch.tensor([0.0]), None, ValueError, "act_scale must be finite and > 0, got 0.0"),
    ("int8-sym-tensor", torch.tensor([-0.5]), None, ValueError, "act_scale must be finite and > 0, got -0.5"),
    ("int8-sym-tensor", torch.tensor([NAN]), None, ValueError, "act_scale must be finite and > 0, got nan"),
    ("int8-sym-tensor", torch.tensor([math.inf]), None, ValueError, "act_scale must be finite and > 0, got inf"),
    ("int8-sym-tensor", torch.tensor([0.1, 0.2]), None, ValueError, r"act_scale must have shape \(1,\)"),
    ("int8-sym-tensor", torch.tensor(0.1), None, ValueError, r"act_scale must have shape \(1,\)"),
    ("int8-sym-tensor", torch.tensor([0.1], dtype=torch.float64), None, TypeError, "act_scale must have dtype"),
    ("int8-sym-tensor", 0.1, None, TypeError, "act_scale must be a torch.Tensor"),
    ("int8-sym-tensor", torch.tensor([0.1]), torch.tensor([3], dtype=torch.uint8), ValueError,
     "act_zero_point must be None for the symmetric scheme"),
    ("int8-asym-tensor", torch.tensor([0.1]), None, ValueError, "act_zero_point is required"),
    ("int8-asym-tensor", torch.tensor([0.1]), torch.tensor([300], dtype=torch.int32), TypeError,
     "act_zero_point must have dtype"),
    ("int8-asym-tensor", torch.tensor([0.1]), torch.tensor([1, 2], dtype=torch.uint8), ValueError,
     r"act_zero_point must have shape \(1,\)"),
])
def test_bad_static_qparams_are_refused_and_leave_the_module_as_it_was(act, scale, zp, error, match):
    q = _qlinear(act=act)
    with pytest.raises(error, match=match):
        q.set_act_qparams(scale, zp)
    assert q.act_scale is None and q.act_zero_point is None
    q.set_act_range(-1.0, 2.0)
    before = (q.act_scale.clone(), None if q.act_zero_point is None else q.act_zero_point.clone())
    with pytest.raises(error, match=match):
        q.set_act_qparams(scale, zp)
    assert torch.equal(q.act_scale, before[0])
    assert (q.act_zero_point is None) == (before[1] is None)


def test_set_act_qparams_copies_its_tensors():
    """q/k/v calibrated from one shared input range get their own storage (save_quantized
    writes a shared tensor once, under one name)."""
    scale = torch.tensor([0.05])
    a, b = _qlinear(), _qlinear()
    a.set_act_qparams(scale)
    b.set_act_qparams(scale)
    scale.fill_(1.0)
    assert a.act_scale.item() == b.act_scale.item() == pytest.approx(0.05)
    assert a.act_scale.data_ptr() != b.act_scale.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("act", ACTS)
def test_calibrated_linear_matches_the_fake_quantized_reference(backend, weight, act):
    m, k, n = 6, 128, 48
    skip_large_for_interpreter(backend, m, k, n)
    q = _qlinear(weight, act, k, n)
    q.backend = backend
    q.set_act_range(-1.5, 2.0)
    # |x| up to ~4 past the calibrated range: the static scale clamps them, a scale chosen
    # from x (dynamic) would not, and would miss this reference by a whole code step
    x = torch.randn(m, k, generator=gen(2)) * 1.3
    y, want = q(x), FakeQuantLinear(q)(x)
    x_hat = fake_quantize(x, act, q.act_scale, q.act_zero_point)
    # Both sides see the same codes of x.  The reference rounds x_hat and w_hat once each,
    # then sums K products in float32 (gamma_{K+2} of the abs products); linear sums integers
    # exactly (W8A8) or per group (W4A8: K/G float sums) and scales twice (gamma_{K+3} bounds
    # both); each adds the bias with one rounding of |y|.
    tol = 2 * gamma(k + 3) * abs_products(x_hat, q.qweight) + 2 * U32 * want.abs().double()
    assert bool(((y.double() - want.double()).abs() <= tol).all()), float((y - want).abs().max())


# -- a model: runtime and checkpoint ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (float32) and the input range of each linear on calibration tokens."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ranges = {}

    def observe(name):
        def hook(_, args):
            lo, hi = ranges.get(name, (math.inf, -math.inf))
            ranges[name] = (min(lo, args[0].min().item()), max(hi, args[0].max().item()))
        return hook

    hooks = [m.register_forward_pre_hook(observe(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 32), generator=gen(1)))
    for h in hooks:
        h.remove()
    return model, ranges


def _static_model(tiny, weight, act, calibrate=True):
    """A copy of the tiny model with the recipe's linears swapped by hand (round to nearest)
    for QuantLinears whose static scales come from the observed ranges: only lowbit.nn
    sets them, whatever calibration quantize_model runs."""
    model, ranges = tiny
    recipe = lowbit.Recipe(weight=weight, activation=act)
    q = copy.deepcopy(model)
    todo = plan(q, recipe)
    for name, spec in todo.items():
        mod = QuantLinear.from_linear(q.get_submodule(name), spec["weight"], spec["activation"])
        if calibrate:
            mod.set_act_range(*ranges[name])
        _set_module(q, name, mod)
    q.lowbit_recipe, q.lowbit_modules = recipe, todo
    return q


def _reference(tiny, q):
    ref = copy.deepcopy(tiny[0])
    for name, mod in q.named_modules():
        if isinstance(mod, QuantLinear):
            _set_module(ref, name, FakeQuantLinear(mod))
    return ref


def _run(model, ids, steps=(7, 100, 300)):
    """Runner logits of the prompt (every position) and of three decode steps after it."""
    r = Runner(model)
    cache = r.new_cache(ids.numel() + len(steps))
    out = [r.forward(ids, cache, all_logits=True)]
    out += [r.forward(torch.tensor([t]), cache) for t in steps]
    return torch.cat(out), r


IDS = torch.randint(0, 512, (12,), generator=gen(2))


@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("act", ACTS)
def test_runner_matches_the_fake_quantized_reference_model(tiny, weight, act, monkeypatch):
    q = _static_model(tiny, weight, act)
    ref = _reference(tiny, q)
    calls = []  # every linear call of the runner: the linear, its input and output, the reference linear
    hooks = [mod.register_forward_hook(lambda m, args, y, f=ref.get_submodule(name): calls.append((m, args[0], y, f)))
             for name, mod in q.named_modules() if isinstance(mod, QuantLinear)]
    got, runner = _run(q, IDS)
    for h in hooks:
        h.remove()
    want, _ = _run(ref, IDS)
    # the C++ decode step quantizes activations per token and takes no static scale: it
    # declines the model, and every decode step runs the Python path with the QuantLinears
    assert runner._decoder is None
    # Each linear of the prefill and the decode steps on the inputs the runner gave it: the
    # bound of test_calibrated_linear_matches_the_fake_quantized_reference.
    assert len(calls) == 4 * 14
    with torch.inference_mode():
        for m, x, y, f in calls:
            want_y = f(x)
            x_hat = fake_quantize(x, f.act, f.scale, f.zp)
            tol = 2 * gamma(x.shape[-1] + 3) * abs_products(x_hat.reshape(-1, x.shape[-1]), m.qweight).reshape(y.shape) \
                + 2 * U32 * want_y.abs().double()
            assert bool(((y.double() - want_y.double()).abs() <= tol).all())
    # End to end the two models differ by those roundings, and by what they flip: an input
    # one rounding away from a code boundary takes the next code (1e-7 upstream moved this
    # machine's logits by 2.2e-3 of their scale through one flip).  A scale other than the
    # calibrated one (per token) misses every code: the same model quantizing per token
    # misses the reference by far more.
    per_token, _ = _run(_static_model(tiny, weight, act.replace("tensor", "token"), calibrate=False), IDS)
    assert 4 * float((got - want).abs().max()) < float((per_token - want).abs().max())
    # the prefill runs the same modules as transformers' forward: without lowbit's prefill
    # kernels (attention and norms: LOWBIT_NATIVE_DECODE=0), its bits
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", "0")
    python = Runner(q)
    with torch.inference_mode():
        assert torch.equal(python.forward(IDS, python.new_cache(IDS.numel()), all_logits=True), q(IDS[None]).logits[0])


def test_saving_an_uncalibrated_model_is_refused(tiny, tmp_path):
    q = _static_model(tiny, "int8-sym", "int8-sym-tensor", calibrate=False)
    with pytest.raises(ValueError, match="activation scale not calibrated: 14 module"):
        lowbit.save_quantized(q, tmp_path / "c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("weight, act", [("int8-sym", "int8-asym-tensor"), ("int4-asym-g64", "int8-sym-tensor")])
def test_checkpoint_round_trip_is_bit_exact(tiny, tmp_path, weight, act):
    q = _static_model(tiny, weight, act)
    path = lowbit.save_quantized(q, tmp_path / "c")
    meta = json.loads((path / "lowbit.json").read_text())
    scales = [n for n in meta["sha256"] if n.endswith(".act_scale")]
    zps = [n for n in meta["sha256"] if n.endswith(".act_zero_point")]
    assert len(scales) == 14 and len(zps) == (14 if act == "int8-asym-tensor" else 0)
    q2, _ = lowbit.load_quantized(path)
    for name, mod in q.named_modules():
        if isinstance(mod, QuantLinear):
            mod2 = q2.get_submodule(name)
            assert torch.equal(mod2.act_scale, mod.act_scale) and mod2.act_scale.dtype == torch.float32
            assert (mod2.act_zero_point is None) == (mod.act_zero_point is None)
            if mod.act_zero_point is not None:
                assert torch.equal(mod2.act_zero_point, mod.act_zero_point)
    with torch.inference_mode():
        assert torch.equal(q2(IDS[None]).logits, q(IDS[None]).logits)
    assert torch.equal(_run(q2, IDS)[0], _run(q, IDS)[0])


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("static") / "c"
    return lowbit.save_quantized(_static_model(tiny, "int8-sym", "int8-asym-tensor"), path)


def _edit_json(path, dst, edit):
    import shutil

    shutil.copytree(path, dst)
    meta = json.loads((dst / "lowbit.json").read_text())
    edit(meta)
    (dst / "lowbit.json").write_text(json.dumps(meta))
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["sha256"].pop(f"{Q}.act_scale"), f"no tensor '{Q}.act_scale'"),
    (lambda m: m["sha256"].pop(f"{Q}.act_zero_point"), f"no tensor '{Q}.act_zero_point'"),
    (lambda m: m["modules"][Q].update(activation="int8-asym-token"), "takes no static activation qparams"),
])
def test_a_description_that_disagrees_on_static_qparams_is_refused(saved, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        lowbit.load_quantized(_edit_json(saved, tmp_path / "bad", edit))


@pytest.mark.parametrize("name, value, match", [
    (f"{Q}.act_scale", torch.tensor([0.0]), "act_scale must be finite and > 0"),
    (f"{Q}.act_scale", torch.tensor([0.1, 0.1]), r"has shape \(2,\), expected \(1,\)"),
    (f"{Q}.act_zero_point", torch.tensor([3], dtype=torch.int32), "has dtype torch.int32"),
])
def test_bad_static_qparams_in_the_tensors_file_are_refused_by_name(saved, tmp_path, name, value, match):
    """Tensors rewritten with matching checksums: the checks of set_act_qparams and the
    reader, not the checksum, refuse them."""
    from safetensors.torch import load_file, save_file

    bad = _edit_json(saved, tmp_path / "bad", lambda m: None)
    tensors = load_file(bad / "model.safetensors")
    tensors[name] = value
    save_file(tensors, bad / "model.safetensors")
    _edit_json(bad, tmp_path / "bad2", lambda m: m["sha256"].update({name: sha256(value)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{match}"):
        lowbit.load_quantized(tmp_path / "bad2")
