"""Checkpoints made by the real tools (tests/fixtures/formats: GPTQModel, AutoAWQ,
llm-compressor on a tiny random Llama; README.md there says how) loaded into lowbit:
the weights lowbit dequantizes equal, bit for bit, those the tool itself dequantized
(``reference.safetensors``), and the logits agree with the tool's."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lowbit

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
CHECKED = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
U16 = 2.0**-11  # unit roundoff of float16

# fixture: (lowbit scheme, dtype the tool dequantized in, reference logits to compare);
# GPTQModel and AutoAWQ dequantize in float16: (q - z) * s rounded to float16
CASES = {
    "gptq-g32-sym": ("int4-sym-g32-f16", torch.float16, "logits"),
    "gptq-g32-asym": ("int4-asym-g32-f16", torch.float16, "logits"),
    "awq-g32": ("int4-asym-g32-f16", torch.float16, "logits"),
    # desc_act=True: g_idx scatters each group's 32 channels; lowbit sorts them (input_order)
    "gptq-g32-actorder": ("int4-sym-g32-f16", torch.float16, "logits"),
    # compressed-tensors decompressed with float32 scales: exact products, lowbit's float32
    "ct-w4a16-g32-sym": ("int4-sym-g32-f16", torch.float32, "logits_weight_only"),
    "ct-w4a16-g32-asym": ("int4-asym-g32-f16", torch.float32, "logits_weight_only"),
    "ct-w8a8": ("int8-sym-f16", torch.float32, "logits_weight_only"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tools_checkpoints_load_exactly(name):
    scheme, tool_dtype, logits_key = CASES[name]
    ref = load_file(FIXTURES / name / "reference.safetensors")
    model, _ = lowbit.load_model(FIXTURES / name)
    assert {m["weight"] for m in model.lowbit_modules.values()} == {scheme}
    assert len(model.lowbit_modules) == 7  # every decoder linear; lm_head stays float
    for module in CHECKED:
        mod = model.get_submodule(module)
        assert (mod.input_order is not None) == name.endswith("actorder")
        got = mod.dequantized_weight(tool_dtype).float()
        assert torch.equal(got, ref[f"{module}.dequant_weight"]), module
    if model.lowbit_modules[CHECKED[0]]["activation"] is not None:  # compare the weight-only path
        for m in model.modules():
            if isinstance(m, lowbit.nn.QuantLinear):
                m.act_scheme = None
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    want = ref[logits_key]
    # The tools ran in float16 or compared float32 models whose float weights (norms,
    # embedding) were float16 or bfloat16 in the file: about 30 roundings at most 2^-11
    # relative each lie between the input and the logits of this one-layer model.
    assert (logits - want).abs().max() <= 32 * U16 * want.abs().max()


