"""Streaming quantization (one decoder layer at a time) and sharded checkpoints."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import lowbit
from lowbit.models.checkpoint import CheckpointError, read_metadata
from lowbit.models.stream import quantize_streaming

transformers = pytest.importorskip("transformers")


def _tiny_folder(path, *, layers=3, shard=None, tied=False, seed=0):
    """A random Llama with grouped-query attention, saved as a Hugging Face folder
    (sharded when ``shard`` is a size such as "60KB")."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=256,
                                   tie_word_embeddings=tied, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so folded scales show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


def _ids(n=4, t=32, seed=1):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def _tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


@pytest.mark.parametrize("recipe, calibrated, shard, tied", [
    ("w4a16-g32", False, None, False),
    ("w4a16-g32", False, "60KB", True),
    (lowbit.Recipe(weight="int4-asym-g32", lm_head="int8-sym", name="with-head"), False, None, True),
    ("w4a16-g32:gptq", True, "60KB", False),
    ("w4a16-g32:awq", True, None, True),
    (lowbit.Recipe(weight="int8-sym", activation="int8-sym-token", smoothquant=0.5, name="sq"), True, None, False),
])
def test_streaming_writes_the_tensors_quantize_model_writes(tmp_path, recipe, calibrated, shard, tied):
    model = _tiny_folder(tmp_path / "hf", shard=shard, tied=tied)
    ids = _ids() if calibrated else None
    streamed = quantize_streaming(tmp_path / "hf", tmp_path / "streamed", recipe, calibration=ids)
    q = lowbit.quantize_model(model, recipe, calibration=ids)
    lowbit.save_quantized(q, tmp_path / "memory")
    a, b = _tensors(streamed), _tensors(tmp_path / "memory")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    meta = read_metadata(streamed)
    assert meta["format_version"] == 2 and len(meta["shards"]) == 3 + 2
    assert meta["modules"] == read_metadata(tmp_path / "memory")["modules"]
    loaded, _ = lowbit.load_quantized(streamed)
    x = _ids(1, 16, seed=5)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, q(x).logits)


def test_streaming_holds_one_decoder_layer_at_a_time(tmp_path, monkeypatch):
    import safetensors.torch

    from lowbit.models import stream

    _tiny_folder(tmp_path / "hf", layers=4)
    live, most = set(), []
    load, save = stream._Source.load, safetensors.torch.save_file

    def loading(self, module, prefix, dtype, names=None):
        load(self, module, prefix, dtype, names)
        if prefix.startswith("model.layers."):
            live.add(prefix)
            most.append(len(live))

    def saving(tensors, path, metadata=None):  # a layer's shard written: the layer is gone
        live.difference_update({".".join(n.split(".")[:3]) for n in tensors})
        save(tensors, path, metadata=metadata)

    monkeypatch.setattr(stream._Source, "load", loading)
    monkeypatch.setattr(safetensors.torch, "save_file", saving)
    quantize_streaming(tmp_path / "hf", tmp_path / "q", "w4a16-g32:gptq", calibration=_ids())
    assert most == [1, 1, 1, 1] and not live


def test_a_failure_midway_leaves_nothing(tmp_path):
    model = _tiny_folder(tmp_path / "hf", shard="60KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    # a NaN in the last layer's weight: found after two layers were written
    name = "model.layers.2.mlp.up_proj.weight"
    shard = tmp_path / "hf" / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    from safetensors.torch import save_file

    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.2.mlp.up_proj"):
        quantize_streaming(tmp_path / "hf", tmp_path / "q", "w4a16-g32")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    del model


def test_bad_sources_are_refused_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        quantize_streaming(tmp_path, tmp_path / "q", "w4a16-g32")
    model = _tiny_folder(tmp_path / "hf")
    os.rename(tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "weights.bin")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        quantize_streaming(tmp_path / "hf", tmp_path / "q", "w4a16-g32")
    model.config.hidden_size = 32  # the files no longer match the config
    model.config.save_pretrained(tmp_path / "hf2")
    os.rename(tmp_path / "hf" / "weights.bin", tmp_path / "hf2" / "model.safetensors")
    with pytest.raises(ValueError, match="has shape"):
        quantize_streaming(tmp_path / "hf2", tmp_path / "q", "w4a16-g32")
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_streaming(tmp_path / "hf2", tmp_path / "q", "w4a16-g32:gptq")
    assert not os.path.exists(tmp_path / "q")


def test_sharded_checkpoints_are_checked(tmp_path):
    _tiny_folder(tmp_path / "hf", layers=2)
    out = quantize_streaming(tmp_path / "hf", tmp_path / "q", "w4a16-g32")
    meta_file = out / "lowbit.json"
    meta = json.loads(meta_file.read_text())
    first = sorted(meta["shards"])[0]

    def edit(change):
        m = json.loads(json.dumps(meta))
        change(m)
        meta_file.write_text(json.dumps(m))

    edit(lambda m: m["shards"][first].pop())
    with pytest.raises(CheckpointError, match="shards and sha256 list different tensors"):
        lowbit.load_quantized(out)
    edit(lambda m: m["shards"].update({"../x.safetensors": []}))
    with pytest.raises(CheckpointError, match="not a tensors file"):
        lowbit.load_quantized(out)
    edit(lambda m: m["shards"][sorted(m["shards"])[1]].append(m["shards"][first][0]))
    with pytest.raises(CheckpointError, match="in two shards"):
        lowbit.load_quantized(out)
    meta_file.write_text(json.dumps(meta))
    os.remove(out / first)
    with pytest.raises(CheckpointError, match=f"{first}: missing"):
        lowbit.load_quantized(out)


def test_cli_quantize_stream(tmp_path, capsys):
    from lowbit.cli import main

    _tiny_folder(tmp_path / "hf", shard="60KB")
    assert main(["quantize", str(tmp_path / "hf"), "--stream", "--recipe", "w4a16-g32", "-o",
                 str(tmp_path / "q")]) in (0, None)
    out = capsys.readouterr().out
    assert "21 modules quantized" in out and "streaming" in out and "5 shards" in out
    assert lowbit.load_quantized(tmp_path / "q")[0].lowbit_modules.keys() == read_metadata(tmp_path / "q")["modules"].keys()
    assert main(["info", str(tmp_path / "q")]) == 0
    assert "format 2" in capsys.readouterr().out
    assert main(["quantize", "--stream", "--recipe", "w4a16-g32", "-o", str(tmp_path / "q2")]) == 2
    assert "--stream reads a Hugging Face model folder" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "q2")
