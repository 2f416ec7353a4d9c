"""The real client: llama.cpp (``pip install 'lowbit[llama]'``, which builds it from
source) loads lowbit's GGUF export, tokenizes like lowbit, answers through the chat
template and scores lowbit's corpus within 0.5% of lowbit's own perplexity.  Slow, so
outside the default run: ``pytest -m slow tests/test_llama_cpp.py``."""

import importlib.util
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

import lowbit  # noqa: E402
from lowbit.evaluation import default_corpus, evaluate, windows  # noqa: E402
from lowbit.formats.gguf_export import export_gguf  # noqa: E402


def bench():
    spec = importlib.util.spec_from_file_location("gguf_bench", Path(__file__).parents[1] / "benchmarks" / "gguf_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_cpp_runs_the_q4_0_export_like_lowbit(tmp_path):
    b = bench()
    model, tok = lowbit.load_model(progress=False)
    q = lowbit.quantize_model(model, "q4_0", inplace=False)
    out = export_gguf(q, tok, tmp_path / "q4_0.gguf", strict=True)
    assert all(t.exact for t in out.tensors)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "q4_0.gguf"), n_ctx=1024, n_batch=512, logits_all=True,
                          verbose=False)
    text, _ = default_corpus()
    wins, first = windows(tok, text, 512, 4, "llama")
    for w in wins:  # llama.cpp's tokenizer, from the exported metadata, agrees with lowbit's
        assert llm.tokenize(tok.decode(w).encode(), add_bos=False, special=False) == w.tolist()
    theirs = b.llama_cpp_perplexity(llm, wins, first)
    ours = evaluate({"q4_0": q}, tok, max_windows=4, protocol="llama", speed=False)[0]["perplexity"]
    assert abs(theirs / ours - 1) < 0.005, (theirs, ours)
    assert "Paris" in b.chat(llm)
