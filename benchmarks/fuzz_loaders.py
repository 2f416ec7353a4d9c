"""Damaged files fed to lowbit's loaders: does every one load or get refused cleanly?

    python benchmarks/fuzz_loaders.py                       # 2000 inputs per loader
    python benchmarks/fuzz_loaders.py --examples 300 --loaders gguf recipe
    python benchmarks/fuzz_loaders.py --replay checkpoint:17  # one input, in this process

Each input is a small valid file with a few seeded random edits, read the way a user
reads it:

    gguf        lowbit.formats.gguf_file.read_gguf on a tiny Llama GGUF (tests/test_bad_gguf.py's)
    gguf-load   lowbit.load_model on the same file: the check, then transformers' conversion
    gguf-native lowbit.load_model(..., gguf="native"): the check, then lowbit's own modules
    gguf-stock  gguf.GGUFReader alone, as lowbit read GGUF files before read_gguf: the
                baseline (not run unless named: its hangs each cost --timeout seconds)
    checkpoint  lowbit.load_model on a lowbit checkpoint folder of a tiny random Llama
                quantized w4a16-g32; the edits hit lowbit.json or model.safetensors
    recipe      lowbit.Recipe.get on a recipe JSON file
    foreign     lowbit.load_model on a compressed-tensors folder (lowbit export of the same
                tiny model); the edits hit config.json or model.safetensors

Edits are byte edits (overwrite with a random or a boundary value, insert, delete,
truncate; most land in the file's header, where the structure is) or, for JSON files,
edits of the parsed document (a value replaced by another type or a boundary value, a
key deleted or added).  Input N of a loader is the same for a given --seed on every run,
so the report's input recipe and --replay reproduce it; the three GGUF loaders read the
same inputs.

Outcomes: accepted; refused (a ValueError or OSError whose message names the file);
unnamed (a ValueError or OSError that does not name it); crashed (any other exception,
or the worker process died); hung (no answer in --timeout seconds: the worker is killed
and a new one started).  For gguf-load, "late" counts the refusals raised only after
transformers had started (its errors re-raised by load.py), i.e. damage that read_gguf's
checks missed.  Inputs run one at a time in one worker process, so a hang or a dying
process costs one input; the worker (and --replay) runs under an address-space limit
(--memory-gb), so a runaway allocation (the stock reader's hang grows a list by about a
GB a second) is a MemoryError or a hang, not the machine's memory.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import multiprocessing
import os
import random
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOADERS = ("gguf", "gguf-load", "gguf-native", "checkpoint", "recipe", "foreign", "gguf-stock")
DEFAULT_LOADERS = LOADERS[:6]
# the file (or folder) a loader is given, in the seed folder
TARGET = {"gguf": "tiny-llama.gguf", "gguf-load": "tiny-llama.gguf", "gguf-stock": "tiny-llama.gguf",
          "gguf-native": "tiny-llama.gguf",
          "checkpoint": "ckpt", "recipe": "recipe.json", "foreign": "ct"}
# the files of that target whose bytes get edited
EDITED = {"gguf": ["tiny-llama.gguf"], "gguf-load": ["tiny-llama.gguf"], "gguf-stock": ["tiny-llama.gguf"],
          "gguf-native": ["tiny-llama.gguf"],
          "checkpoint": ["ckpt/lowbit.json", "ckpt/model.safetensors"], "recipe": ["recipe.json"],
          "foreign": ["ct/config.json", "ct/model.safetensors"]}
LATE = "passed lowbit's GGUF checks"  # load.py's message when transformers fails after read_gguf

BOUNDARY_INTS = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
                 2**63 - 1, 2**63, 2**64 - 1]
BOUNDARY_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63) - 1, 1e308, -0.0, 0.5, "", "x",
                   "\u00e9\u4e2d", "int4-asym-g32-f16", "int8-sym", "nope", "(", "a" * 300, [], {}, [None],
                   {"x": 1}, json.loads("[" * 20 + "]" * 20)]


# -- the inputs ---------------------------------------------------------------------------------

def build_seeds(folder: Path) -> None:
    """The valid files every input starts from."""
    import torch
    import transformers

    import lowbit
    from lowbit.recipe import DECODER_LINEARS

    sys.path.insert(0, str(ROOT))  # the tiny GGUF model is the tests' own
    from tests.test_bad_gguf import tiny_llama, write_gguf

    write_gguf(folder / TARGET["gguf"], *tiny_llama(n_layer=1))

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    quantized = lowbit.quantize_model(model, "w4a16-g32")
    lowbit.save_quantized(quantized, folder / TARGET["checkpoint"])
    from lowbit.formats.compressed_tensors import export_compressed_tensors

    export_compressed_tensors(quantized, None, folder / TARGET["foreign"])

    recipe = lowbit.Recipe(weight="int4-asym-g64-f16", modules=(DECODER_LINEARS,),
                           overrides=((r"layers\.0\.", {"weight": "int8-sym"}),
                                      (r"down_proj", {"weight": None})),
                           lm_head="int8-sym", name="fuzz")
    (folder / TARGET["recipe"]).write_text(json.dumps(recipe.to_dict(), indent=1))


@functools.cache
def header_size(seed_file: Path) -> int:
    """Bytes at the start of a seed file that hold its structure (the rest is tensor data)."""
    if seed_file.suffix == ".gguf":
        from lowbit.formats.gguf_file import read_gguf

        return int(read_gguf(seed_file).data_offset)
    if seed_file.suffix == ".safetensors":
        return 8 + struct.unpack("<Q", seed_file.read_bytes()[:8])[0]
    return seed_file.stat().st_size  # JSON: all structure


def edit_bytes(rng: random.Random, data: bytearray, header: int) -> list[str]:
    """1 to 4 byte edits of `data`, in place; what was done, readably."""
    done = []
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        at = rng.randrange(min(header, len(data))) if rng.random() < 0.75 else rng.randrange(len(data))
        op = rng.choice(["byte", "byte", "int", "insert", "delete", "truncate"])
        if op == "byte":
            value = rng.choice([rng.randrange(256), 0, 0xFF, 0x7F, 0x80])
            data[at] = value
            done.append(f"byte {at} = 0x{value:02x}")
        elif op == "int":
            width = rng.choice([4, 8])
            value = rng.choice(BOUNDARY_INTS) & ((1 << 8 * width) - 1)
            data[at:at + width] = value.to_bytes(width, "little")
            done.append(f"bytes {at}..{at + width} = {value} (u{8 * width} LE)")
        elif op == "insert":
            new = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            data[at:at] = new
            done.append(f"insert {new.hex()} at {at}")
        elif op == "delete":
            n = rng.randint(1, 16)
            del data[at:at + n]
            done.append(f"delete {n} bytes at {at}")
        else:
            del data[at:]
            done.append(f"truncate to {at} bytes")
    return done


def _nodes(doc, path=()):
    """(path, value) of every node of a JSON document."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def edit_json(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """One edit of the parsed document: a value replaced, a key deleted or added."""
    doc = json.loads(data)
    path, node = rng.choice(list(_nodes(doc)))
    shown = "$" + "".join(f"[{p!r}]" for p in path)
    op = rng.choice(["set", "set", "set", "delete", "add"])
    if op == "delete" and path:
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        del parent[path[-1]]
        done = f"json delete {shown}"
    elif op == "add" and isinstance(node, dict):
        key, value = rng.choice(["extra", "weight", "", "modules"]), rng.choice(BOUNDARY_VALUES)
        node[key] = value
        done = f"json add {shown}[{key!r}] = {json.dumps(value)[:60]}"
    else:
        value = rng.choice(BOUNDARY_VALUES)
        if not path:
            doc = value
        else:
            parent = doc
            for p in path[:-1]:
                parent = parent[p]
            parent[path[-1]] = value
        done = f"json set {shown} = {json.dumps(value)[:60]}"
    return json.dumps(doc, indent=1).encode(), [done]


def make_input(seeds: Path, loader: str, index: int, seed: int, out: Path) -> tuple[Path, list[str]]:
    """Input `index` of `loader`: the seed target copied to `out` with seeded edits;
    returns the path to load and the edits done."""
    rng = random.Random(f"{seed}:{TARGET[loader]}:{index}")  # the GGUF loaders read the same inputs
    source = seeds / TARGET[loader]
    target = out / TARGET[loader]
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)
    name = rng.choice(EDITED[loader])
    data = (seeds / name).read_bytes()
    if name.endswith(".json") and rng.random() < 0.5:
        data, done = edit_json(rng, data)
    else:
        buf = bytearray(data)
        done = edit_bytes(rng, buf, header_size(seeds / name))
        data = bytes(buf)
    (out / name).write_bytes(data)
    return target, [f"{Path(name).name}: {d}" for d in done]


# -- running one input ---------------------------------------------------------------------------

def load(loader: str, path: Path, cache: Path) -> None:
    import lowbit
    from lowbit.formats.gguf_file import read_gguf

    if loader == "gguf":
        read_gguf(path)
    elif loader in ("gguf-load", "gguf-native"):
        os.environ["LOWBIT_CACHE"] = str(cache)
        try:
            lowbit.load_model(path, progress=False, gguf="native" if loader == "gguf-native" else "float")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    elif loader == "gguf-stock":
        import gguf

        gguf.GGUFReader(path)
    elif loader in ("checkpoint", "foreign"):
        lowbit.load_model(path)
    else:
        lowbit.Recipe.get(str(path))


def classify(loader: str, path: Path, cache: Path) -> tuple[str, str]:
    """(outcome, detail) of loading one input."""
    try:
        load(loader, path, cache)
        return "accepted", ""
    except (ValueError, OSError) as e:
        message = f"{type(e).__name__}: {e}"
        if str(path) not in str(e):
            return "unnamed", message
        return ("late" if LATE in str(e) else "refused"), message
    except Exception:
        return "crashed", traceback.format_exc()


def limit_memory(memory_gb: float) -> None:
    limit = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # a runaway allocation is a MemoryError


def worker(conn, memory_gb: float, cache: str) -> None:
    """Load what the parent sends, answer with the outcome, until it sends None."""
    limit_memory(memory_gb)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    import lowbit
    import transformers

    del lowbit, transformers  # imported once, before the first input's clock starts

    conn.send("ready")
    while (job := conn.recv()) is not None:
        loader, path = job
        conn.send(classify(loader, Path(path), Path(cache)))


class Worker:
    """One worker process; a hung or dead one is replaced."""

    def __init__(self, memory_gb: float, cache: Path, log: Path):
        self.memory_gb, self.cache, self.log = memory_gb, cache, log
        self.start()

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with open(self.log, "a") as log:  # the worker's own output (warnings) goes to the log
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                self.process = ctx.Process(target=worker, args=(child, self.memory_gb, str(self.cache)), daemon=True)
                self.process.start()
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        child.close()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError(f"the worker did not start; see {self.log}")

    def run(self, loader: str, path: Path, timeout: float) -> tuple[str, str]:
        self.conn.send((loader, str(path)))
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except EOFError:
            pass
        alive = self.process.is_alive()
        self.process.kill()
        self.process.join()
        code = self.process.exitcode
        self.start()
        if alive:
            return "hung", f"no answer in {timeout} s"
        return "crashed", f"the worker process died (exit code {code})"

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


# -- the report ---------------------------------------------------------------------------------

OUTCOMES = ("accepted", "refused", "late", "unnamed", "crashed", "hung")


def signature(detail: str) -> str:
    """A crash's exception line and innermost frame: one line per distinct crash."""
    lines = [ln for ln in detail.strip().splitlines() if ln.strip()]
    frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
    return f"{lines[-1] if lines else detail} @ {frames[-1] if frames else '?'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="inputs per loader (default 2000)")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(DEFAULT_LOADERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds one input may take (default 20)")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="address-space limit of the worker")
    parser.add_argument("--show", type=int, default=3, help="distinct crashes / unnamed refusals shown per loader")
    parser.add_argument("--replay", metavar="LOADER:N", help="run input N of LOADER here, with its full traceback")
    args = parser.parse_args()
    if args.examples < 1:
        parser.error(f"--examples must be >= 1, got {args.examples}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory(prefix="lowbit-fuzz-") as tmp:
        work = Path(tmp)
        seeds = work / "seeds"
        seeds.mkdir()
        build_seeds(seeds)
        if args.replay:
            loader, _, index = args.replay.partition(":")
            if loader not in LOADERS or not index.isdigit():
                parser.error(f"--replay takes LOADER:N with LOADER one of {LOADERS}, got {args.replay!r}")
            out = work / "input"
            out.mkdir()
            path, done = make_input(seeds, loader, int(index), args.seed, out)
            print(f"{loader} input {index} (seed {args.seed}): {'; '.join(done)}")
            limit_memory(args.memory_gb)
            load(loader, path, work / "cache")
            print("accepted")
            return

        log = work / "worker.log"
        w = Worker(args.memory_gb, work / "cache", log)
        print(f"{args.examples} inputs per loader, seed {args.seed}, timeout {args.timeout:g} s, "
              f"worker memory limit {args.memory_gb:g} GiB\n")
        rows, examples = [], {}
        try:
            for loader in args.loaders:
                outcome, detail = w.run(loader, seeds / TARGET[loader], 300)  # warm-up, and the seed must load
                if outcome != "accepted":
                    raise RuntimeError(f"the unedited {loader} input is not accepted: {outcome}: {detail}")
                counts = collections.Counter()
                shown = collections.defaultdict(dict)  # outcome -> signature -> (index, edits, detail)
                start = time.perf_counter()
                for i in range(args.examples):
                    out = work / "input"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    path, done = make_input(seeds, loader, i, args.seed, out)
                    outcome, detail = w.run(loader, path, args.timeout)
                    counts[outcome] += 1
                    if outcome in ("crashed", "unnamed", "hung", "late"):
                        key = signature(detail) if outcome == "crashed" else detail.replace(str(path), "<file>")[:200]
                        shown[outcome].setdefault(key, (i, done, detail.replace(str(out), "<input>")))
                seconds = time.perf_counter() - start
                rows.append((loader, counts, seconds))
                examples[loader] = shown
        finally:
            w.close()

    print(f"{'loader':<11}{'inputs':>8}" + "".join(f"{o:>10}" for o in OUTCOMES) + f"{'time s':>9}{'ms/input':>10}")
    for loader, counts, seconds in rows:
        n = sum(counts.values())
        print(f"{loader:<11}{n:>8}" + "".join(f"{counts[o]:>10}" for o in OUTCOMES)
              + f"{seconds:>9.1f}{1000 * seconds / n:>10.1f}")
    for loader, shown in examples.items():
        for outcome in ("crashed", "hung", "unnamed", "late"):
            if not shown[outcome]:
                continue
            print(f"\n{loader}: {len(shown[outcome])} distinct {outcome}, the first {min(args.show, len(shown[outcome]))}:")
            for key, (i, done, detail) in list(shown[outcome].items())[:args.show]:
                print(f"  input {i} (--replay {loader}:{i}): {'; '.join(done)}")
                body = detail.strip().splitlines()
                for line in body[-12:] if outcome == "crashed" else body[:3]:
                    print(f"      {line}")


if __name__ == "__main__":
    main()
