"""Damaged GGUF files: every failure to read one is a ValueError (GGUFError) or an OSError
whose message names the file, and the metadata key or tensor where one applies, raised by
lowbit's checks before transformers converts anything."""

from __future__ import annotations

import signal
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

import lowbit  # noqa: E402
from lowbit.formats.gguf_file import LLAMA_KEYS, GGUFError, read_gguf, read_gguf_linear_weights  # noqa: E402

VT = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType
NAME = "tiny-llama.gguf"
TOKENS = [*"abcdefghijklmnopqrstuvwxyz", "ab", "abc", "<s>", "</s>"]
MERGES = ["a b", "ab c"]


def tiny_llama(n_layer: int = 2, n_embd: int = 32, n_ff: int = 64, n_head: int = 2, n_kv: int = 1):
    """A Llama model that writes in a millisecond, as plain data for a test to damage:
    metadata {key: (value, type[, element type])} and tensors {name: (array, raw_shape,
    raw_dtype)} in file order.  Linears are Q4_1 and the embedding Q8_0, like the bundled
    model's; rows of 32 and 64 elements are whole blocks of both."""
    rng = np.random.default_rng(0)
    head_dim = n_embd // n_head

    def quantized(kind, rows, cols):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind), None, kind

    def norm():
        return np.ones(n_embd, np.float32), None, None

    metadata = {
        "general.architecture": ("llama", VT.STRING),
        "general.name": ("tiny", VT.STRING),
        "llama.block_count": (n_layer, VT.UINT32),
        "llama.context_length": (128, VT.UINT32),
        "llama.embedding_length": (n_embd, VT.UINT32),
        "llama.feed_forward_length": (n_ff, VT.UINT32),
        "llama.attention.head_count": (n_head, VT.UINT32),
        "llama.attention.head_count_kv": (n_kv, VT.UINT32),
        "llama.rope.freq_base": (10000.0, VT.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, VT.FLOAT32),
        "llama.vocab_size": (len(TOKENS), VT.UINT32),
        "tokenizer.ggml.model": ("gpt2", VT.STRING),
        "tokenizer.ggml.pre": ("default", VT.STRING),
        "tokenizer.ggml.tokens": (TOKENS, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": ([1] * len(TOKENS), VT.ARRAY, VT.INT32),
        "tokenizer.ggml.merges": (MERGES, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.bos_token_id": (TOKENS.index("<s>"), VT.UINT32),
        "tokenizer.ggml.eos_token_id": (TOKENS.index("</s>"), VT.UINT32),
    }
    tensors = {"token_embd.weight": quantized(Q.Q8_0, len(TOKENS), n_embd), "output_norm.weight": norm()}
    for i in range(n_layer):
        tensors[f"blk.{i}.attn_norm.weight"] = norm()
        tensors[f"blk.{i}.ffn_norm.weight"] = norm()
        for name, rows, cols in [("attn_q", n_head * head_dim, n_embd), ("attn_k", n_kv * head_dim, n_embd),
                                 ("attn_v", n_kv * head_dim, n_embd), ("attn_output", n_embd, n_head * head_dim),
                                 ("ffn_gate", n_ff, n_embd), ("ffn_up", n_ff, n_embd), ("ffn_down", n_embd, n_ff)]:
            tensors[f"blk.{i}.{name}.weight"] = quantized(Q.Q4_1, rows, cols)
    return metadata, tensors


def write_gguf(path: Path, metadata: dict, tensors: dict) -> Path:
    """Write metadata and tensors (tiny_llama's form) with gguf.GGUFWriter, keys in the given order."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].clear()  # the writer adds general.architecture itself: let `metadata` decide
    for key, (value, kind, *element) in metadata.items():
        w.add_key_value(key, value, kind, *element)
    for name, (array, raw_shape, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_shape=raw_shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def good(tmp_path) -> Path:
    return write_gguf(tmp_path / NAME, *tiny_llama())


def patched(path: Path, offset: int, new: bytes) -> Path:
    data = bytearray(path.read_bytes())
    data[offset:offset + len(new)] = new
    path.write_bytes(bytes(data))
    return path


def truncated(path: Path, size: int) -> Path:
    path.write_bytes(path.read_bytes()[:size])
    return path


def key_offset(path: Path, key: str) -> int:
    """Where a metadata key's name starts; its value type follows, then its value."""
    return path.read_bytes().index(struct.pack("<Q", len(key)) + key.encode()) + 8


def tensor_info_offset(path: Path, name: str) -> int:
    """Where a tensor's dimension count follows its name in the tensor table."""
    data = path.read_bytes()
    start = data.index(struct.pack("<Q", len(name)) + name.encode(), data.index(b"token_embd.weight") - 8)
    return start + 8 + len(name)


def refused(path: Path, *contains: str, call=read_gguf, error=GGUFError) -> str:
    """The message of the error `call(path)` raises; it names the file and each of `contains`."""
    with pytest.raises(error) as info:
        call(path)
    message = str(info.value)
    assert str(path) in message, message
    for part in contains:
        assert part in message, message
    return message


def test_the_tiny_llama_reads_and_loads_into_transformers(good, tmp_path, monkeypatch):
    reader = read_gguf(good)
    assert len(reader.tensors) == 2 + 2 * 9
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    model, tok = lowbit.load_model(good, progress=False)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (2, 32, 2, 1, 64, len(TOKENS))
    assert tok.convert_ids_to_tokens(tok("abc").input_ids) == ["abc"]  # the merges were read


def test_a_changed_file_replaces_its_stale_cache_entry(good, tmp_path, monkeypatch):
    """Converting a file again (new size or mtime, e.g. after a reinstall) deletes the
    entries lowbit wrote for the same path before, and those of GGUF files that are gone
    (a deleted virtual environment's); other folders in the cache stay."""
    import json
    import os
    import shutil

    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWBIT_CACHE", str(cache))
    lowbit.load_model(good, progress=False)
    (first,) = [p for p in cache.iterdir() if p.is_dir()]
    assert json.loads((first / "config.json").read_text())["lowbit_source"]["gguf"] == str(good.absolute())
    elsewhere = tmp_path / "elsewhere" / good.name  # the same file at another path, still there
    elsewhere.parent.mkdir()
    shutil.copy(good, elsewhere)

    def entry(name, source):  # a conversion lowbit wrote from `source`
        (cache / name).mkdir()
        (cache / name / "config.json").write_text(json.dumps({"lowbit_source": {"gguf": source}}))
        return cache / name

    other = entry(f"{good.stem}-1-2", str(elsewhere))
    gone = entry("another-3-4", str(tmp_path / "deleted-venv" / "another.gguf"))
    relative = entry("relative-5-6", "models/x.gguf")  # whose file cannot be told: kept
    mine = cache / f"{good.stem}-notes"  # a user's folder: no lowbit_source
    mine.mkdir()
    st = good.stat()
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    lowbit.load_model(good, progress=False)
    assert not first.exists() and not gone.exists()
    assert other.exists() and relative.exists() and mine.exists()
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 4


def test_bundled_model_passes_the_checks():
    reader = read_gguf()
    assert reader.fields["general.architecture"].contents() == "llama"


# -- structure: what gguf.GGUFReader would trip over, or read wrongly without a word

@pytest.mark.parametrize("where, cut, contains", [
    ("in the header", lambda p: 12, ["header", "past the end of the file"]),
    ("in the metadata", lambda p: key_offset(p, "llama.block_count"), ["header", "claims 18 metadata entries"]),
    ("in a metadata key", lambda p: key_offset(p, "tokenizer.ggml.model") + 5, ["metadata entry 12 of"]),
    ("in the token list", lambda p: key_offset(p, "tokenizer.ggml.tokens") + 60, ["metadata entry 14 of"]),
    ("in the tensor count", lambda p: tensor_info_offset(p, "blk.0.attn_q.weight"), ["claims 20 tensors"]),
    ("in the tensor table", lambda p: tensor_info_offset(p, "blk.1.ffn_down.weight") + 6,
     ["tensor info 20 of 20 (after 'blk.1.ffn_up.weight')"]),
    ("in the tensor data", lambda p: p.stat().st_size - 100, ["tensor 'blk.1.ffn_down.weight'", "truncated"]),
    ("one byte short", lambda p: p.stat().st_size - 1, ["tensor 'blk.1.ffn_down.weight'"]),
])
def test_truncated_file_is_refused_where_it_breaks(good, where, cut, contains):
    refused(truncated(good, cut(good)), *contains)


def test_empty_file_and_wrong_magic_are_not_gguf(good, tmp_path):
    refused(patched(good, 0, b"GGML"), "not a GGUF file", "b'GGML'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    refused(empty, "not a GGUF file")


def test_unsupported_version_is_refused(good):
    refused(patched(good, 4, struct.pack("<I", 7)), "header", "version 7")
    refused(patched(good, 4, struct.pack(">I", 3)), "big-endian")


def test_missing_file_is_an_os_error_naming_it(tmp_path):
    refused(tmp_path / "nowhere.gguf", "does not exist", error=FileNotFoundError)


@pytest.mark.parametrize("field, offset, value", [
    ("tensor count", lambda p: 8, struct.pack("<Q", 2**63)),
    ("metadata count", lambda p: 16, struct.pack("<Q", 2**64 - 1)),
    ("string length", lambda p: key_offset(p, "general.name") - 8, struct.pack("<Q", 2**63)),
    ("array length", lambda p: key_offset(p, "tokenizer.ggml.token_type") + len("tokenizer.ggml.token_type") + 8,
     struct.pack("<Q", 2**62)),
    ("dimension count", lambda p: tensor_info_offset(p, "output_norm.weight"), struct.pack("<I", 2**32 - 1)),
    ("tensor dimension", lambda p: tensor_info_offset(p, "output_norm.weight") + 4, struct.pack("<Q", 2**62)),
    ("tensor offset", lambda p: tensor_info_offset(p, "output_norm.weight") + 4 + 8 + 4, struct.pack("<Q", 2**60)),
])
def test_absurd_count_is_refused_without_allocating_or_looping(good, field, offset, value):
    patched(good, offset(good), value)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        refused(good)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a full parse of this 10 KB file takes milliseconds and well under a megabyte:
    # the bounds are loose enough for a loaded machine and far below a runaway loop
    assert time.perf_counter() - start < 5
    assert peak < 16 << 20, peak


def test_damaged_byte_array_length_is_refused_not_looped_on(tmp_path):
    # gguf.GGUFReader reads an array's elements one by one, and past the end of the file
    # a read is empty and advances nothing: a damaged length there loops nearly forever
    metadata, tensors = tiny_llama()
    metadata["general.blob"] = ([1, 2, 3], VT.ARRAY, VT.UINT8)
    path = write_gguf(tmp_path / NAME, metadata, tensors)
    patched(path, key_offset(path, "general.blob") + len("general.blob") + 8, struct.pack("<Q", 2**62))
    refused(path, "metadata entry 19 of 19", "claims 4611686018427387904 array elements")


def test_unknown_types_are_refused(good, tmp_path):
    refused(patched(good, tensor_info_offset(good, "blk.0.attn_q.weight") + 4 + 16, struct.pack("<I", 200)),
            "tensor 'blk.0.attn_q.weight'", "unknown ggml type 200")
    other = write_gguf(tmp_path / "other.gguf", *tiny_llama())
    refused(patched(other, key_offset(other, "general.name") + len("general.name"), struct.pack("<I", 99)),
            "metadata entry 2 of", "99")


def test_array_of_arrays_is_refused(tmp_path):
    metadata, tensors = tiny_llama()
    metadata["general.nested"] = ([[1, 2], [3]], VT.ARRAY, VT.ARRAY)
    refused(write_gguf(tmp_path / NAME, metadata, tensors), "array of arrays")


@pytest.mark.parametrize("where, patch, contains", [
    ("a key", lambda p: (key_offset(p, "general.name") + 2, b"\xff"), ["metadata entry 2 of", "utf-8"]),
    ("a string value", lambda p: (key_offset(p, "general.name") + len("general.name") + 4 + 8 + 1, b"\xc3"),
     ["metadata key 'general.name'", "not valid UTF-8"]),
    ("a token", lambda p: (p.read_bytes().index(struct.pack("<Q", 3) + b"abc") + 9, b"\xe2"),
     ["metadata key 'tokenizer.ggml.tokens': element 27", "not valid UTF-8"]),
    ("a tensor name", lambda p: (tensor_info_offset(p, "blk.0.ffn_up.weight") - 3, b"\x80"), ["tensor info"]),
])
def test_invalid_utf8_is_refused_by_name(good, where, patch, contains):
    refused(patched(good, *patch(good)), *contains)


def test_duplicate_key_and_tensor_names_are_refused(good, tmp_path):
    refused(patched(good, key_offset(good, "tokenizer.ggml.bos_token_id") + len("tokenizer.ggml."), b"e"),
            "Duplicate tokenizer.ggml.eos_token_id")
    other = write_gguf(tmp_path / "other.gguf", *tiny_llama())
    refused(patched(other, tensor_info_offset(other, "blk.1.ffn_up.weight") - len("1.ffn_up.weight"), b"0"),
            "duplicated tensor", "blk.0.ffn_up.weight")


# -- tensors: shapes against their data, their type's blocks and the metadata

def test_shape_claiming_more_data_than_the_tensor_has_is_refused(tmp_path):
    metadata, tensors = tiny_llama()
    tensors["blk.0.attn_norm.weight"] = (np.ones(32, np.float32), (48,), None)
    refused(write_gguf(tmp_path / NAME, metadata, tensors),
            "but the tensor before it, 'blk.0.attn_norm.weight' (shape [48], F32, 192 bytes), ends at")


def test_shape_claiming_less_data_than_the_tensor_has_is_refused(tmp_path):
    metadata, tensors = tiny_llama()
    codes = tensors["blk.0.attn_q.weight"][0]  # 32 rows of Q4_1 blocks
    tensors["blk.0.attn_q.weight"] = (codes, (codes.shape[0] // 2, codes.shape[1]), Q.Q4_1)
    refused(write_gguf(tmp_path / NAME, metadata, tensors), "'blk.0.attn_q.weight' (shape [32, 16], Q4_1")


def test_last_tensor_claiming_more_data_runs_past_the_end(tmp_path):
    metadata, tensors = tiny_llama()
    codes = tensors["blk.1.ffn_down.weight"][0]
    tensors["blk.1.ffn_down.weight"] = (codes, (codes.shape[0] * 2, codes.shape[1]), Q.Q4_1)
    refused(write_gguf(tmp_path / NAME, metadata, tensors), "tensor 'blk.1.ffn_down.weight'", "past the end")


def test_rows_that_are_not_whole_blocks_are_refused(good):
    refused(patched(good, tensor_info_offset(good, "blk.0.attn_q.weight") + 4, struct.pack("<Q", 40)),
            "tensor 'blk.0.attn_q.weight'", "not a whole number of 32-element blocks")


def test_consistent_data_with_the_wrong_shape_for_the_model_is_refused(tmp_path):
    # the file's own layout is fine; transformers would fail reshaping it into the config's shape
    metadata, tensors = tiny_llama()
    codes = tensors["blk.0.attn_q.weight"][0]
    tensors["blk.0.attn_q.weight"] = (codes[:16], None, Q.Q4_1)
    refused(write_gguf(tmp_path / NAME, metadata, tensors),
            "tensor 'blk.0.attn_q.weight' has shape [32, 16], but the metadata implies [32, 32]")


@pytest.mark.parametrize("change, contains", [
    (lambda m, t: t.pop("blk.1.ffn_up.weight"), "tensor 'blk.1.ffn_up.weight' is missing"),
    (lambda m, t: m.update({"llama.block_count": (1, VT.UINT32)}), "'blk.1.attn_norm.weight' is beyond"),
    (lambda m, t: m.update({"llama.block_count": (2**31, VT.UINT32)}), "holds only 20 tensors"),
    (lambda m, t: m.update({"llama.embedding_length": (64, VT.UINT32)}), "'token_embd.weight' has shape [32, 30]"),
])
def test_tensors_missing_or_beyond_the_metadata_are_refused(tmp_path, change, contains):
    metadata, tensors = tiny_llama()
    change(metadata, tensors)
    refused(write_gguf(tmp_path / NAME, metadata, tensors), contains)


# -- metadata a Llama load reads

@pytest.mark.parametrize("key", ["general.architecture"] + [k for k, kind in LLAMA_KEYS.items()
                                                            if not kind.endswith("?")])
def test_missing_required_key_is_refused_by_name(tmp_path, key):
    metadata, tensors = tiny_llama()
    del metadata[key]
    refused(write_gguf(tmp_path / NAME, metadata, tensors), f"metadata key {key!r} is missing")


def test_tokenizer_without_merges_or_scores_is_refused(tmp_path):
    metadata, tensors = tiny_llama()
    del metadata["tokenizer.ggml.merges"]  # transformers would look for scores to rebuild them from
    refused(write_gguf(tmp_path / NAME, metadata, tensors), "neither 'tokenizer.ggml.merges' nor")


@pytest.mark.parametrize("key, value, contains", [
    ("general.architecture", (3, VT.UINT32), "is UINT32, expected a string"),
    ("general.architecture", ("\x00lama", VT.STRING), "not an architecture gguf"),
    ("llama.block_count", ("2", VT.STRING), "is STRING, expected an integer"),
    ("llama.block_count", (0, VT.UINT32), "is 0, expected an integer >= 1"),
    ("llama.attention.layer_norm_rms_epsilon", (1, VT.UINT32), "expected a float"),
    ("llama.attention.layer_norm_rms_epsilon", (float("nan"), VT.FLOAT32), "expected a float > 0"),
    ("tokenizer.ggml.model", ("\x00pt2", VT.STRING), "expected one of ('llama', 'gpt2')"),
    ("tokenizer.ggml.tokens", ([1, 2], VT.ARRAY, VT.INT32), "is ARRAY[INT32], expected an array of strings"),
    ("tokenizer.ggml.token_type", ([1, 2], VT.ARRAY, VT.INT32), "has 2 entries"),
    ("tokenizer.ggml.bos_token_id", (len(TOKENS), VT.UINT32), "not a token id"),
    ("tokenizer.ggml.eos_token_id", (-1, VT.INT32), "not a token id"),
    ("tokenizer.ggml.merges", (["a z"], VT.ARRAY, VT.STRING), "merge 0 'a z'"),
    ("tokenizer.ggml.merges", (["abc"], VT.ARRAY, VT.STRING), "merge 0 'abc'"),
    ("llama.vocab_size", (99, VT.UINT32), "'llama.vocab_size' is 99"),
    ("llama.attention.head_count_kv", (3, VT.UINT32), "does not divide"),
])
def test_key_of_the_wrong_type_or_value_is_refused_by_name(tmp_path, key, value, contains):
    metadata, tensors = tiny_llama()
    metadata[key] = value
    refused(write_gguf(tmp_path / NAME, metadata, tensors), f"metadata key {key!r}", contains)


# -- the public entry points check before any heavy work

def test_load_model_refuses_before_converting(good, tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    truncated(good, good.stat().st_size - 100)
    refused(good, "tensor 'blk.1.ffn_down.weight'", call=lowbit.load_model)
    refused(good, "tensor 'blk.1.ffn_down.weight'", call=read_gguf_linear_weights)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# -- any damage at all: a clean refusal or a file that still reads

class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("read_gguf ran for more than 10 s")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_byte_damage_reads_or_is_refused_by_name(tmp_path_factory, data):
    path = write_gguf(tmp_path_factory.mktemp("fuzz") / NAME, *tiny_llama(n_layer=1))
    raw = bytearray(path.read_bytes())
    header_end = read_gguf(path).data_offset  # most damage worth finding is in the header
    position = st.one_of(st.integers(0, header_end - 1), st.integers(0, len(raw) - 1))
    for at, byte in data.draw(st.lists(st.tuples(position, st.integers(0, 255)), min_size=1, max_size=4)):
        raw[at] = byte
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        read_gguf(path)
    except (ValueError, OSError) as e:
        assert str(path) in str(e), repr(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_info_on_a_damaged_gguf_names_the_file(tmp_path, capsys):
    from lowbit.cli import main

    path = tmp_path / "damaged.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 24)  # absurd tensor and key counts
    assert main(["info", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_read_gguf_linear_weights_refuses_a_limit_below_one(limit):
    from lowbit.models import read_gguf_linear_weights

    with pytest.raises(ValueError, match="limit must be a positive int"):
        read_gguf_linear_weights(limit=limit)
