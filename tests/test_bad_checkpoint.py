"""Checkpoints that are not what ``save_quantized`` wrote, and places it must not write:
every refusal is an exception of the documented type that names the file (and the
field), and a refused write changes nothing on disk.

The checkpoint here is a tiny random Llama (2 layers, hidden 64) quantized with
``w4a16-g32`` and a 64-word tokenizer: saving and loading it takes milliseconds."""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.models.checkpoint import CheckpointError, check_output_dir, load_quantized, read_metadata


def _tiny_model(recipe: str):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(62)} | {"<unk>": 62, "<s>": 63}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>")
    return lowbit.quantize_model(model, recipe), tok


@pytest.fixture(scope="module")
def tiny():
    return _tiny_model("w4a16-g32")


@pytest.fixture(scope="module")
def tiny8():
    """Another model to replace the checkpoint with (another recipe, so the files differ)."""
    return _tiny_model("w8a16")


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    lowbit.save_quantized(tiny[0], path, tiny[1])
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    """A private copy of the saved checkpoint, alone in its folder."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _snapshot(root: Path) -> dict:
    """Every entry under ``root`` (hidden ones too) with its kind, mode and content hash."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st_ = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st_.st_mode) else None
            out[str(p.relative_to(root))] = (stat.S_IFMT(st_.st_mode), stat.S_IMODE(st_.st_mode), digest)
    return out


def _meta(path: Path) -> dict:
    return json.loads((path / "lowbit.json").read_text())


def _write_meta(path: Path, meta) -> None:
    (path / "lowbit.json").write_text(json.dumps(meta))


def _names(path: Path, *files: str) -> str:
    """A regex matching a message that names ``path / file`` for one of ``files``."""
    return "|".join(re.escape(str(path / f)) for f in files)


# -- 7: config.json and the tokenizer files are covered by checksums ---------------------------

def test_config_and_tokenizer_files_are_recorded_with_their_checksums(ckpt):
    files = _meta(ckpt)["files"]
    assert set(files) == set(os.listdir(ckpt)) - {"lowbit.json", "model.safetensors"}
    assert {"config.json", "tokenizer.json"} <= set(files)
    for name, digest in files.items():
        assert digest == hashlib.sha256((ckpt / name).read_bytes()).hexdigest()


def _edit_heads(ckpt: Path) -> None:
    """4 heads of 16 (2 KV heads) -> 2 heads of 32 (1 KV head): every weight keeps its
    shape, so without a checksum the model loads and computes garbage."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_consistently_edited_config_is_refused_naming_it(ckpt):
    _edit_heads(ckpt)
    match = re.escape(str(ckpt / "config.json")) + r": changed since .*SHA-256 mismatch"
    with pytest.raises(CheckpointError, match=match):
        lowbit.load_model(ckpt)
    with pytest.raises(CheckpointError, match=match):  # what `lowbit info` reads
        read_metadata(ckpt)


@pytest.mark.parametrize("name, old, new", [("tokenizer.json", '"w1"', '"w9"'),
                                           ("tokenizer_config.json", '"<s>"', '"w5"')])
def test_edited_tokenizer_file_is_refused_naming_it(ckpt, name, old, new):
    f = ckpt / name
    assert old in f.read_text()
    f.write_text(f.read_text().replace(old, new, 1))
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ": changed since"):
        lowbit.load_model(ckpt)


def test_missing_covered_file_is_refused_naming_it(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "tokenizer.json")) + ": missing"):
        lowbit.load_model(ckpt)


def test_tokenizer_file_the_checksums_do_not_cover_is_refused(ckpt):
    (ckpt / "special_tokens_map.json").write_text(json.dumps({"bos_token": "w5"}))
    (ckpt / "README.md").write_text("notes: transformers never reads this file")
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "special_tokens_map.json")) + ": not covered"):
        lowbit.load_model(ckpt)


def test_checkpoint_without_file_checksums_still_loads_unchecked(ckpt):
    """Checkpoints written before ``files`` was recorded load as before: their config
    and tokenizer are not checked (tensors still are)."""
    meta = _meta(ckpt)
    del meta["files"]
    _write_meta(ckpt, meta)
    _edit_heads(ckpt)
    model, tok = lowbit.load_model(ckpt)
    assert model.config.num_attention_heads == 2 and tok is not None


# -- 10: overwrite replaces only a lowbit checkpoint -------------------------------------------

def _make_target(kind: str, where: Path, ckpt: Path) -> Path:
    p = where / "target"
    if kind == "file":
        p.write_text("my notes")
    elif kind == "empty folder":
        p.mkdir()
    elif kind == "folder of other files":
        p.mkdir()
        (p / "config.json").write_text("{}")
    elif kind == "lowbit.json of another format":
        p.mkdir()
        (p / "lowbit.json").write_text(json.dumps({"format": "other"}))
    elif kind == "lowbit.json that is not JSON":
        p.mkdir()
        (p / "lowbit.json").write_text("format: lowbit")
    elif kind == "checkpoint holding a folder":  # -o ~ --force with a stray lowbit.json in the home folder
        shutil.copytree(ckpt, p)
        (p / "Documents").mkdir()
        (p / "Documents" / "thesis.tex").write_text("years of work")
    elif kind == "link to a checkpoint":
        p.symlink_to(ckpt)
    return p


@pytest.mark.parametrize("kind", ["file", "empty folder", "folder of other files", "lowbit.json of another format",
                                  "lowbit.json that is not JSON", "checkpoint holding a folder",
                                  "link to a checkpoint"])
def test_overwrite_refuses_what_is_not_a_lowbit_checkpoint(tiny, ckpt, tmp_path, kind):
    where = tmp_path / "out"
    where.mkdir()
    target = _make_target(kind, where, ckpt)
    before, before_ckpt = _snapshot(where), _snapshot(ckpt)
    match = re.escape(repr(str(target))) + " exists and .*; refusing to replace it"
    with pytest.raises(FileExistsError, match=match):
        check_output_dir(target, overwrite=True)
    with pytest.raises(FileExistsError, match=match):
        lowbit.save_quantized(tiny[0], target, tiny[1], overwrite=True)
    assert _snapshot(where) == before and _snapshot(ckpt) == before_ckpt


def test_overwrite_refuses_a_device_node(tiny):
    if not os.path.exists("/dev/null") or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        pytest.skip("no /dev/null character device")
    before = sorted(os.listdir("/dev"))
    with pytest.raises(FileExistsError, match="'/dev/null' exists and is not a folder; refusing"):
        check_output_dir("/dev/null", overwrite=True)
    with pytest.raises(FileExistsError, match="'/dev/null' exists and is not a folder; refusing"):
        lowbit.save_quantized(tiny[0], "/dev/null", tiny[1], overwrite=True)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and sorted(os.listdir("/dev")) == before


def test_existing_path_without_overwrite_is_refused_untouched(tiny, ckpt):
    before = _snapshot(ckpt.parent)
    with pytest.raises(FileExistsError, match=re.escape(repr(str(ckpt))) + " exists; pass overwrite=True"):
        check_output_dir(ckpt)
    with pytest.raises(FileExistsError, match=re.escape(repr(str(ckpt))) + " exists; pass overwrite=True"):
        lowbit.save_quantized(tiny[0], ckpt, tiny[1])
    assert _snapshot(ckpt.parent) == before


def test_overwrite_replaces_a_checkpoint_and_leaves_nothing_beside_it(tiny8, ckpt):
    assert check_output_dir(ckpt, overwrite=True) == ckpt
    lowbit.save_quantized(tiny8[0], ckpt, tiny8[1], overwrite=True)
    assert os.listdir(ckpt.parent) == ["ckpt"]
    model, _ = load_quantized(ckpt)
    assert model.lowbit_recipe.name == "w8a16"


def test_check_output_dir_accepts_a_new_path_and_writes_nothing(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b" / "new", overwrite=True) == tmp_path / "a" / "b" / "new"
    assert check_output_dir(str(tmp_path / "new")) == tmp_path / "new"
    assert os.listdir(tmp_path) == []


# -- 11: a failed replacement puts the old checkpoint back ---------------------------------------

def _failing_rename(monkeypatch, fail):
    """os.rename raising ``fail(src, dst)`` when that is not None; returns the list of calls."""
    real, calls = os.rename, []

    def rename(src, dst, *a, **kw):
        calls.append((str(src), str(dst)))
        exc = fail(Path(src), Path(dst))
        if exc is not None:
            raise exc
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    return calls


def _is_swap_in(ckpt):
    """The second step of a replacement: the new folder renamed onto the target."""
    return lambda src, dst: dst == ckpt and ".lowbit-tmp-" in src.name


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "injected I/O error"), KeyboardInterrupt()],
                         ids=["OSError", "KeyboardInterrupt"])
def test_failure_between_the_two_renames_puts_the_old_checkpoint_back(tiny8, ckpt, monkeypatch, exc):
    before = _snapshot(ckpt.parent)
    swap_in = _is_swap_in(ckpt)
    calls = _failing_rename(monkeypatch, lambda src, dst: exc if swap_in(src, dst) else None)
    with pytest.raises(type(exc)):
        lowbit.save_quantized(tiny8[0], ckpt, tiny8[1], overwrite=True)
    monkeypatch.undo()
    assert any(swap_in(Path(s), Path(d)) for s, d in calls)  # the failure was injected where meant
    assert _snapshot(ckpt.parent) == before  # the old checkpoint, nothing else
    assert load_quantized(ckpt)[0].lowbit_recipe.name == "w4a16-g32"


def test_replacement_interrupted_twice_is_restored_by_the_next_run(tiny8, ckpt, monkeypatch):
    """Ctrl-C at the second rename and again while the old one is put back: the target is
    missing and the old checkpoint sits in a hidden folder; the next run puts it back."""
    before = _snapshot(ckpt.parent)
    _failing_rename(monkeypatch, lambda src, dst: KeyboardInterrupt() if dst == ckpt else None)
    with pytest.raises(KeyboardInterrupt):
        lowbit.save_quantized(tiny8[0], ckpt, tiny8[1], overwrite=True)
    monkeypatch.undo()
    assert not ckpt.exists()
    assert [n for n in os.listdir(ckpt.parent) if ".lowbit-old-" in n]
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):  # it is back, so it exists
        check_output_dir(ckpt)
    assert _snapshot(ckpt.parent) == before
    lowbit.save_quantized(tiny8[0], ckpt, tiny8[1], overwrite=True)  # and can be replaced
    assert os.listdir(ckpt.parent) == ["ckpt"]


def test_backup_left_after_a_completed_replacement_is_deleted_by_the_next_run(tiny8, ckpt, monkeypatch):
    _failing_rename(monkeypatch, lambda src, dst: KeyboardInterrupt() if ".lowbit-del-" in str(dst) else None)
    with pytest.raises(KeyboardInterrupt):
        lowbit.save_quantized(tiny8[0], ckpt, tiny8[1], overwrite=True)
    monkeypatch.undo()
    assert len(os.listdir(ckpt.parent)) > 1  # the new checkpoint and the old one beside it
    new = _snapshot(ckpt)
    check_output_dir(ckpt, overwrite=True)
    assert os.listdir(ckpt.parent) == ["ckpt"] and _snapshot(ckpt) == new
    assert load_quantized(ckpt)[0].lowbit_recipe.name == "w8a16"


# -- 12: permissions follow the umask ------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_saved_checkpoint_has_the_permissions_the_umask_gives(tiny, tiny8, tmp_path, umask):
    old = os.umask(umask)
    try:
        path = lowbit.save_quantized(tiny[0], tmp_path / "ckpt", tiny[1])
        modes = [stat.S_IMODE(path.stat().st_mode)] + sorted({stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()})
        path = lowbit.save_quantized(tiny8[0], tmp_path / "ckpt", tiny8[1], overwrite=True)
        replaced = [stat.S_IMODE(path.stat().st_mode)] + sorted({stat.S_IMODE(f.stat().st_mode)
                                                                 for f in path.iterdir()})
    finally:
        os.umask(old)
    assert modes == replaced == [0o777 & ~umask, 0o666 & ~umask]


# -- 13: an unwritable place is refused before any work --------------------------------------------

@pytest.mark.parametrize("target", ["/sys/lowbit-test-checkpoint", "/proc/lowbit-test/checkpoint"])
def test_unwritable_parent_is_refused_naming_the_path(tiny, target):
    root = "/" + Path(target).parts[1]
    if not os.path.isdir(root):
        pytest.skip(f"no {root} here")
    match = "cannot write " + re.escape(repr(target)) + ": cannot create a folder in '/(sys|proc)'"
    with pytest.raises(PermissionError, match=match):
        check_output_dir(target)
    with pytest.raises(PermissionError, match=match):
        lowbit.save_quantized(tiny[0], target, tiny[1])
    assert not os.path.lexists(target)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes read-only folders")
def test_read_only_folder_is_refused_naming_the_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    try:
        with pytest.raises(PermissionError, match=re.escape(repr(str(ro / "ckpt")))):
            check_output_dir(ro / "ckpt")
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


def test_parent_that_is_a_file_is_refused_naming_it(tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    before = _snapshot(tmp_path)
    target = tmp_path / "notes.txt" / "ckpt"
    with pytest.raises(NotADirectoryError, match=re.escape(repr(str(tmp_path / "notes.txt"))) + " is not a folder"):
        lowbit.save_quantized(tiny[0], target, tiny[1])
    assert _snapshot(tmp_path) == before


# -- 14, 23: lowbit.json of the wrong shape, bad schemes, bad tensors and tokenizer files -----------

def _first_module(meta):
    return next(iter(meta["modules"]))


def _first_tensor(meta):
    return next(iter(meta["sha256"]))


BAD_META = {  # what to do to lowbit.json, and the field the message must name
    "a list": (lambda m: [m], "the file must be a JSON object"),
    "modules a list": (lambda m: m | {"modules": list(m["modules"])}, "modules must be an object"),
    "sha256 a list": (lambda m: m | {"sha256": list(m["sha256"])}, "sha256 must be an object"),
    "files a list": (lambda m: m | {"files": list(m["files"])}, "files must be an object"),
    "recipe a string": (lambda m: m | {"recipe": "w4a16-g32"}, "recipe must be an object"),
    "no recipe": (lambda m: {k: v for k, v in m.items() if k != "recipe"}, "missing key 'recipe'"),
    "no modules": (lambda m: {k: v for k, v in m.items() if k != "modules"}, "missing key 'modules'"),
    "no sha256": (lambda m: {k: v for k, v in m.items() if k != "sha256"}, "missing key 'sha256'"),
    "no dtype": (lambda m: {k: v for k, v in m.items() if k != "dtype"}, "missing key 'dtype'"),
    "no lowbit_version": (lambda m: {k: v for k, v in m.items() if k != "lowbit_version"},
                          "missing key 'lowbit_version'"),
    "format_version a string": (lambda m: m | {"format_version": "1"}, "format_version must be an integer"),
    "format_version true": (lambda m: m | {"format_version": True}, "format_version must be an integer"),
    "dtype unknown": (lambda m: m | {"dtype": "float8"}, "dtype 'float8' is unknown"),
    "module a string": (lambda m: m | {"modules": {_first_module(m): "int4-asym-g32-f16"}}, r"modules\['.*'\] must"),
    "module without kind": (lambda m: m | {"modules": {_first_module(m): {"weight": "int8-sym", "activation": None}}},
                            r"modules\['.*'\] has keys"),
    "module of unknown kind": (lambda m: m | {"modules": {_first_module(m): m["modules"][_first_module(m)]
                                                          | {"kind": "conv"}}}, r"modules\['.*'\]\.kind is 'conv'"),
    "weight scheme a number": (lambda m: m | {"modules": {_first_module(m): m["modules"][_first_module(m)]
                                                          | {"weight": 4}}}, r"modules\['.*'\]\.weight must be"),
    "sha256 not hex": (lambda m: m | {"sha256": m["sha256"] | {_first_tensor(m): "corrupt"}},
                       r"sha256\['.*'\] is not a SHA-256"),
    "files naming another folder": (lambda m: m | {"files": m["files"] | {"../config.json": "0" * 64}},
                                    r"files names '\.\./config\.json'"),
}


@pytest.mark.parametrize("case", BAD_META)
def test_description_of_the_wrong_shape_is_refused_naming_file_and_field(ckpt, case):
    edit, field = BAD_META[case]
    _write_meta(ckpt, edit(_meta(ckpt)))
    match = re.escape(str(ckpt / "lowbit.json")) + ": " + field
    with pytest.raises(CheckpointError, match=match):
        read_metadata(ckpt)
    with pytest.raises(CheckpointError, match=match):
        lowbit.load_model(ckpt)


@pytest.mark.parametrize("data, what", [(b"", "not valid JSON"), (b'{"format": "lowbit",', "not valid JSON"),
                                        (b'{"format": "l\xffwbit"}', "not valid JSON"),
                                        (b"[" * 100_000, "not valid JSON")])
def test_unparsable_description_is_refused_naming_it(ckpt, data, what):
    (ckpt / "lowbit.json").write_bytes(data)
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "lowbit.json")) + ": " + what):
        lowbit.load_model(ckpt)


@pytest.mark.parametrize("field, value", [("weight", "int5-sym"), ("weight", "int4-nonsense"),
                                          ("weight", "int8-sym-token"), ("activation", "int4-asym-g32")])
def test_bad_module_scheme_is_refused_naming_the_file_before_any_tensor(ckpt, field, value):
    meta = _meta(ckpt)
    meta["modules"][_first_module(meta)][field] = value
    _write_meta(ckpt, meta)
    (ckpt / "model.safetensors").write_bytes(b"")  # never reached: the description is checked first
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "lowbit.json")) + r": modules\['.*'\] \(.*"
                       + f"{field} '{value}'"):
        lowbit.load_model(ckpt)


def test_bad_recipe_is_refused_naming_the_file_before_any_tensor(ckpt):
    meta = _meta(ckpt)
    meta["recipe"]["weight"] = "int4-nonsense"
    _write_meta(ckpt, meta)
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "lowbit.json")) + r": recipe: .*int4-nonsense"):
        lowbit.load_model(ckpt)


@pytest.mark.parametrize("size", [0, 7, 100, -1])
def test_empty_or_truncated_tensors_file_is_refused_by_info(ckpt, size):
    """``lowbit info`` read only lowbit.json: it reported a 0-byte model.safetensors as
    holding every tensor."""
    from lowbit.cli import info_cmd

    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:size])
    match = re.escape(str(f)) + ": unreadable or truncated"
    for read in (info_cmd, read_metadata, lowbit.load_model):
        with pytest.raises(CheckpointError, match=match):
            read(ckpt)


def _without_file_checksums(ckpt):
    meta = _meta(ckpt)
    del meta["files"]
    _write_meta(ckpt, meta)


def test_broken_tokenizer_file_is_refused_naming_it(ckpt):
    _without_file_checksums(ckpt)  # with them, the checksum refuses it first
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "tokenizer.json")) + ": cannot be read"):
        lowbit.load_model(ckpt)


def test_broken_config_is_refused_naming_it(ckpt):
    _without_file_checksums(ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 60, "num_attention_heads": 7}))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "config.json")) + ": cannot be read"):
        lowbit.load_model(ckpt)


# -- fuzzing: mutated bytes are refused by name or load -----------------------------------------

# 30 inputs per file by default (about a second); HYPOTHESIS_PROFILE=thorough runs its 500
FUZZ_EXAMPLES = settings.default.max_examples if settings.default.max_examples > 40 else 30
fuzz_runs = {"lowbit.json": 0, "model.safetensors": 0}


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("loading took more than 20 s")


OPS = ["xor", "xor", "set", "set", "delete", "insert"]  # length-keeping edits twice as often


@st.composite
def _edits(draw, size: int, hot: int):
    """1-4 byte edits, half of them within the first ``hot`` bytes (a header), then maybe
    a truncation."""
    pos = st.one_of(st.integers(0, hot - 1), st.integers(0, size - 1))
    edits = draw(st.lists(st.tuples(st.sampled_from(OPS), pos, st.integers(0, 255)),
                          min_size=1, max_size=4))
    cut = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, size)))  # mostly not cut
    return edits, cut


def _mutate(data: bytes, edits, cut) -> bytes:
    b = bytearray(data)
    for op, pos, value in edits:
        pos = pos % max(len(b), 1)
        if op == "xor" and b:
            b[pos] ^= value or 0xFF
        elif op == "set" and b:
            b[pos] = value
        elif op == "delete" and b:
            del b[pos]
        else:
            b.insert(pos, value)
    return bytes(b if cut is None else b[:cut])


def _load_mutated(saved: Path, name: str, edits, cut) -> None:
    fuzz_runs[name] += 1
    with tempfile.TemporaryDirectory() as d:
        path = Path(shutil.copytree(saved, Path(d) / "ckpt"))
        f = path / name
        f.write_bytes(_mutate(f.read_bytes(), edits, cut))
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(20)
        try:
            model, _ = load_quantized(path)
        except (ValueError, OSError) as e:
            # a mismatch between the two files may be told from either side
            assert re.search(_names(path, "lowbit.json", "model.safetensors"), str(e)), repr(e)
        else:
            with torch.inference_mode():
                assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def _header_end(saved: Path) -> int:
    return 8 + int.from_bytes((saved / "model.safetensors").read_bytes()[:8], "little")


def test_mutated_description_loads_or_is_refused_by_name(saved):
    size = (saved / "lowbit.json").stat().st_size

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True)
    @given(_edits(size, size))
    def run(edits_cut):
        _load_mutated(saved, "lowbit.json", *edits_cut)

    run()
    assert fuzz_runs["lowbit.json"] >= FUZZ_EXAMPLES


def test_mutated_tensors_file_loads_or_is_refused_by_name(saved):
    size = (saved / "model.safetensors").stat().st_size

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True)
    @given(_edits(size, _header_end(saved)))
    def run(edits_cut):
        _load_mutated(saved, "model.safetensors", *edits_cut)

    run()
    assert fuzz_runs["model.safetensors"] >= FUZZ_EXAMPLES


def test_hf_folder_with_a_broken_tokenizer_names_the_folder(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{ broken")
    with pytest.raises(ValueError, match=f"{folder}: cannot load the tokenizer.*JSONDecodeError"):
        lowbit.load_model(folder)
