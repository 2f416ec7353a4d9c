"""Batched generation (``Runner.generate`` with a list of prompts) against one prompt at
a time on the bundled SmolLM2-135M."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu
from lowbit.nn import QuantLinear
from lowbit.runtime import BatchGeneration, Runner, _BatchCache

from .conftest import biased_llama

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time, in a"]


@pytest.fixture(scope="module")
def smol():
    return lowbit.load_model()


@pytest.fixture(scope="module")
def prompts(smol):
    return [torch.tensor(smol[1](p).input_ids) for p in PROMPTS]


def test_prompts_of_different_lengths(prompts):
    assert len({p.numel() for p in prompts}) > 1  # else the ragged prefill is not exercised


@torch.inference_mode()
def test_batch_prefill_logits_match_one_prompt_at_a_time(smol, prompts):
    r = Runner(smol[0])
    prompts = prompts + prompts[1::-1]  # two lengths twice: those prompts attend in one call
    cache = _BatchCache.empty(r, len(prompts), 32)
    batch = r._prefill_batch(prompts, cache)
    for b, p in enumerate(prompts):
        one = r.new_cache(32)
        want = r.forward(p, one)[0]
        # the same float32 ops on a taller matrix (M = all prompts' tokens): the matmuls
        # sum in another order, logits of magnitude ~20 over 30 layers stay below 1e-3
        torch.testing.assert_close(batch[b], want, rtol=0, atol=1e-3)
        assert int(cache.lengths[b]) == p.numel()
        for layer in (0, 29):  # the cache holds what the one-prompt run wrote, nothing past it
            torch.testing.assert_close(cache.keys[layer][b, :, :p.numel()], one.keys[layer][:, :p.numel()],
                                       rtol=0, atol=1e-4)
            assert not cache.values[layer][b, :, p.numel():].any()


@pytest.mark.parametrize("recipe", [None, "q4_0-a8", "w8a8", "w4a16-g128"])
def test_batch_greedy_tokens_equal_one_prompt_at_a_time(smol, prompts, recipe, request, monkeypatch):
    if recipe == "q4_0-a8":
        # Equal tokens are promised while the batch's rows stay within the row kernels'
        # limits: beyond them a GEMM path sums in another order, and with activations
        # rounded to int8 a last-bit difference can move a code by one, which 30 layers
        # amplify (on an AVX-512 Xeon the prefill's logits moved by up to 1.0 and one prompt's
        # 4th token changed).  The batch's prefill here has sum(len(p)) rows: the rows kernel.
        rows = sum(p.numel() for p in prompts)
        monkeypatch.setattr(cpu, "A8_ROWS_MAX_M", {4: rows, 8: rows})
        monkeypatch.setattr(cpu, "AVX2_A8_ROWS_MAX_M", {4: rows, 8: rows})
        monkeypatch.setattr(cpu, "AMX_A8_ROWS_MAX_M", {4: rows, 8: rows})
        monkeypatch.setattr(cpu, "_a8_amx_row", lambda *a: False)  # one row too (one prompt's decode)
        cpu.clear_plans()
        request.addfinalizer(cpu.clear_plans)  # forget the plans made under these limits
        assert cpu.BACKEND.plan(lowbit.QuantScheme.parse("int4-sym-g32-f16"), lowbit.QuantScheme.parse("int8-sym-g32"),
                                rows, 576, torch.float32).kernel == "a8_blocks"
    model = smol[0] if recipe is None else lowbit.quantize_model(smol[0], recipe, inplace=False)
    r = Runner(model)
    batch = r.generate(prompts, 12)
    assert isinstance(batch, BatchGeneration) and len(batch.sequences) == len(prompts)
    for p, seq in zip(prompts, batch.sequences):
        assert seq.prompt_tokens == p.numel()
        assert seq.tokens == r.generate(p, 12).tokens
    assert batch.new_tokens == 12 * len(prompts)
    assert batch.tokens_per_s > 0 and batch.decode_tokens_per_s > 0


def test_batch_attention_without_the_cpu_kernel_gives_the_same_tokens(smol, prompts):
    r = Runner(smol[0])
    want = [s.tokens for s in r.generate(prompts, 12).sequences]
    r._attend_rows = None  # as on a GPU: masked SDPA over every running sequence's cache
    r._native, r._decoders = False, {}  # not the C++ step (its own attention)
    assert [s.tokens for s in r.generate(prompts, 12).sequences] == want


def test_each_sequence_stops_at_its_own_end_token(smol, prompts):
    r = Runner(smol[0])
    alone = [r.generate(p, 10).tokens for p in prompts]
    eos = alone[0][2]  # the first prompt's third token ends it; others may go on
    seen = []
    batch = r.generate(prompts, 10, eos_token_id=eos, on_token=lambda i, t: seen.append((i, t)))
    for want, seq in zip(alone, batch.sequences):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert seq.tokens == want[:cut]
    assert len(batch.sequences[0].tokens) == 3
    assert any(len(s.tokens) == 10 for s in batch.sequences)  # the batch ran on without it
    for i, seq in enumerate(batch.sequences):  # on_token saw each sequence's tokens, in order
        assert [t for j, t in seen if j == i] == seq.tokens


def test_batch_sampling_is_reproducible_per_seed(smol, prompts):
    r = Runner(smol[0])
    a = r.generate(prompts[:2], 8, do_sample=True, temperature=1.0, seed=3)
    b = r.generate(prompts[:2], 8, do_sample=True, temperature=1.0, seed=3)
    c = r.generate(prompts[:2], 8, do_sample=True, temperature=1.0, seed=4)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    greedy = r.generate(prompts[:2], 8)
    top1 = r.generate(prompts[:2], 8, do_sample=True, top_k=1, seed=5)
    assert [s.tokens for s in top1.sequences] == [s.tokens for s in greedy.sequences]


def test_zero_new_tokens_runs_nothing(smol, prompts):
    b = Runner(smol[0]).generate(prompts, 0)
    assert [s.tokens for s in b.sequences] == [[]] * len(prompts) and b.prefill_seconds == 0


@pytest.mark.parametrize("ids, match", [
    ([], "empty list"),
    ([torch.tensor([1, 2]), torch.zeros(1, 3, dtype=torch.long)], r"ids\[1\] must be a non-empty 1-D"),
    ([torch.tensor([], dtype=torch.long)], r"ids\[0\] must be a non-empty 1-D"),
    ([torch.tensor([1]), "text"], r"ids\[1\] must be .* got str"),
])
def test_batch_refuses_bad_prompts(smol, ids, match):
    with pytest.raises(ValueError, match=match):
        Runner(smol[0]).generate(ids, 4)


def test_batch_refuses_a_prompt_past_max_positions_and_names_it(smol):
    ids = [torch.tensor([1, 2]), torch.zeros(8190, dtype=torch.long)]
    with pytest.raises(ValueError, match="prompt 1 .* max_position_embeddings=8192"):
        Runner(smol[0]).generate(ids, 8)


# -- the C++ decode step of a batch ------------------------------------------------------------

def _batch_step_covers(model, dtype, rows: int) -> bool:
    """Whether the cpu plan for ``rows`` rows of every quantized projection is a kernel the
    C++ decode step runs (the rule lowbit.runtime follows)."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            act = None if mod.act_scheme is None else lowbit.QuantScheme.parse(mod.act_scheme)
            if act is not None and act.granularity == "tensor":
                return False
            if cpu.BACKEND.plan(mod.qweight.scheme, act, rows, mod.in_features, dtype).kernel not in cpu.DECODE_KERNELS:
                return False
    return True


def _same_batch_steps(model, prompts, steps, monkeypatch):
    """A batch's prefill, then decode steps of fewer and fewer running sequences (every
    other one drops out: rows that are not 0..N-1, at ragged positions) through the C++
    step and the Python path: the same logits and caches, bit for bit."""
    native = Runner(model)
    monkeypatch.setenv("LOWBIT_NATIVE_DECODE", "0")
    python = Runner(model)
    # the same prompt attention and norms on both sides: the steps are compared
    python._prefill, python._rms_many = native._prefill, native._rms_many
    caches = [_BatchCache.empty(r, len(prompts), max(p.numel() for p in prompts) + steps) for r in (native, python)]
    with torch.inference_mode():
        a, b = (r._prefill_batch(prompts, c) for r, c in zip((native, python), caches))
        assert torch.equal(a, b), "prefill"  # q/k/v and gate/up through the C++ step's groups, or one by one
        rows, ran = torch.arange(len(prompts)), []
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, model.config.vocab_size, (rows.numel(),), generator=gen)
            if native._rows_decoder(rows.numel()) is not None:
                ran.append(rows.numel())
            a, b = (r._decode_batch(ids, rows, c) for r, c in zip((native, python), caches))
            assert torch.equal(a, b), f"{rows.numel()} rows"
            rows = rows[1::2] if rows.numel() > 1 else rows
    assert all(torch.equal(x, y) for x, y in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values))
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    return native, ran


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w4a16-g128", "w8a16", "w8a16-asym", "q4_0", "w8a8", "w8a8-asym",
                                    "w4a8-g128", "w4a8-sym", "q4_0-a8", "q8_0-a8", "q4_1-a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_batch_step_is_bit_identical_to_the_python_path(recipe, dtype, monkeypatch):
    m = biased_llama(dtype)
    recipe = {"w8a16-asym": lowbit.Recipe(weight="int8-asym"),
              "w8a8-asym": lowbit.Recipe(weight="int8-sym", activation="int8-asym-token"),
              "w4a8-sym": lowbit.Recipe(weight="int4-asym-g128-f16", activation="int8-sym-token"),
              "q4_1-a8": lowbit.Recipe(weight="int4-asym-g32-zpmin-f16", activation="int8-sym-g32")}.get(recipe, recipe)
    if recipe is not None:
        m = lowbit.quantize_model(m, recipe, inplace=False)
    # 64 rows, then 32, 16, 8, 4, 2, 1: past the row kernels' limits and AMX's, then below
    # them; W8A8's 32 and 16 on gemm_int8's rows16_linear, 64 and 8 on its panels
    prompts = [torch.randint(0, 96, (3 + i % 7,), generator=torch.Generator().manual_seed(i)) for i in range(64)]
    native, ran = _same_batch_steps(m, prompts, 7, monkeypatch)
    for n in (64, 32, 16, 8, 4, 2, 1):  # the C++ step ran wherever the plans allow it
        assert (n in ran) == _batch_step_covers(m, dtype, n), n
    if dtype != torch.float16 or recipe is None:  # float16 x has no int8-block or W4A8 kernel for every plan
        assert ran, "the C++ step never ran"


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w4a16-g128", "w8a16", "w8a8", "w8a8-asym", "w4a8-g128", "q4_0-a8",
                                    "q8_0-a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_runs_the_groups_in_one_call_with_the_same_bits(recipe, dtype):
    # Runner.forward's prefill takes q/k/v, o, gate/up and down through the C++ step planned
    # for its rows where that runs each group as one call (W8A8 on gemm_int8's panels or AMX
    # tiles; int8 blocks of x on the row kernel or AMX tiles; W4A8 on AMX tiles or VNNI panels;
    # weight-only on AMX bf16 tiles, or on gemm_bf16.cpp's panels: bf16 x, or float32 x on
    # gemm_f32_fma's), else one by one; a
    # float model's projections stay on torch's linear (transformers' bits)
    m = biased_llama(dtype)
    recipe = {"w8a8-asym": lowbit.Recipe(weight="int8-sym", activation="int8-asym-token")}.get(recipe, recipe)
    if recipe is not None:
        m = lowbit.quantize_model(m, recipe, inplace=False)
    r = Runner(m)
    ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(0))
    d = r._rows_decoder(60)  # None where a projection has no C++ step kernel at 60 rows
    fused = set() if d is None else {d.fuses(i, which, 60) for i in range(len(r.layers)) for which in range(4)}
    lin = m.model.layers[0].self_attn.q_proj
    if recipe is not None:
        act = None if lin.act_scheme is None else lowbit.QuantScheme.parse(lin.act_scheme)
        kernel = cpu.BACKEND.plan(lin.qweight.scheme, act, 60, lin.in_features, dtype).kernel
        # the W8A8, int8-block and weight-only kernels that take several weights at once (W8A8:
        # AVX-512 VNNI's panels or AMX; AVX2's int16 panels run each projection alone; W4A8's
        # panels where they are VNNI's)
        multi = ("gemm_int8", "int8_amx", "a8_blocks", "a8_amx", "w4a8_amx", "gemm_bf16_amx")
        multi += ("w4a8_panels",) if cpu._C.has_w4a8_panels() else ()
        multi += ("gemm_bf16", "gemm_fma") if dtype == torch.bfloat16 else ("gemm_f32_fma",)
        assert fused == ({kernel in multi} if d is not None else set())
    else:
        assert True not in fused
    with torch.inference_mode():
        a = r.forward(ids, r.new_cache(64), all_logits=True)
        r._rows_decoder = lambda rows: None  # every projection on its own
        b = r.forward(ids, r.new_cache(64), all_logits=True)
    assert torch.equal(a, b)


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", [None, "w8a8", "w4a16-g64", "w4a16-g128-head8"])
def test_native_batch_step_on_the_bundled_model(recipe, prompts, monkeypatch):
    m = lowbit.load_model(dtype=torch.bfloat16)[0]
    if recipe is not None:
        m = lowbit.quantize_model(m, recipe, inplace=False)
    _, ran = _same_batch_steps(m, prompts * 8, 3, monkeypatch)  # 32 sequences, then 16 and 8
    assert ran == [n for n in (32, 16, 8) if _batch_step_covers(m, torch.bfloat16, n)]


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
def test_row_counts_whose_projections_take_the_same_kernels_share_one_step(smol):
    from lowbit.runtime import _step_kernels

    r = Runner(smol[0])
    kernels = {n: _step_kernels(r, n) for n in (2, 3, 40)}
    for a, b in ((2, 3), (3, 40)):
        assert r._rows_decoder(a) is not None
        assert (r._rows_decoder(a) is r._rows_decoder(b)) == (kernels[a] == kernels[b])
    assert len(r._decoders) == len(set(kernels.values()))


@pytest.fixture
def fma_gemm(request, monkeypatch):
    """LOWBIT_FMA_GEMM set to the test's parameter, the plans made again before and after."""
    monkeypatch.setenv("LOWBIT_FMA_GEMM", request.param)
    cpu.clear_plans()
    yield request.param
    monkeypatch.undo()
    cpu.clear_plans()


def _assert_groups_fused_with_the_same_bits(r, rows, dtype):
    """Layer 0's q/k/v and gate/up of `rows` rows of `dtype` x, each group in one call of r's
    rows decoder: each output in dtype and the bits of its projection alone, bias included."""
    L = r.layers[0]
    d = r._rows_decoder(rows)
    x = torch.randn(rows, L.q.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        for which, mods in ((0, (L.q, L.k, L.v)), (2, (L.gate, L.up))):
            assert d.fuses(0, which, rows)
            ys = d.project(0, which, x)
            for y, mod in zip(ys, mods, strict=True):
                assert y.dtype == dtype and torch.equal(y, mod(x))


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
@pytest.mark.parametrize("fma_gemm", ["0", "1"], indirect=True)
@pytest.mark.parametrize("recipe", ["w4a16-g64", "w8a16", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [40, 100])
def test_weight_only_panels_run_q_k_v_and_gate_up_in_one_call_with_the_same_bits(recipe, rows, fma_gemm):
    # gemm_bf16.cpp's panels (gemm_bf16, or gemm_fma where LOWBIT_FMA_GEMM=1) take q/k/v and
    # gate/up of bf16 rows in one call (weight_only_panels_into: one parallel region, x widened
    # once): each output the bits of lowbit.linear on its projection alone, bias included;
    # 40 rows of gemm_bf16 are its rows form, 100 its panels
    m = lowbit.quantize_model(biased_llama(torch.bfloat16), recipe, inplace=False)
    r = Runner(m)
    L = r.layers[0]
    kernel = cpu.BACKEND.plan(L.q.qweight.scheme, None, rows, L.q.in_features, torch.bfloat16).kernel
    if kernel not in ("gemm_bf16", "gemm_fma"):
        pytest.skip(f"{rows} rows of {recipe} take {kernel} here")
    assert kernel == ("gemm_fma" if fma_gemm == "1" and rows > cpu.FMA_GEMM_MIN_M else "gemm_bf16")
    _assert_groups_fused_with_the_same_bits(r, rows, torch.bfloat16)


@pytest.mark.skipif(cpu._C is None, reason="needs lowbit._C")
@pytest.mark.parametrize("recipe", ["w4a16-g64", "w8a16", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [7, 100])
def test_float32_panels_run_q_k_v_and_gate_up_in_one_call_with_the_same_bits(recipe, rows):
    # a float32 model's weight-only projections beyond the decode kernels' rows take
    # gemm_f32_fma's panels, q/k/v and gate/up in one call each (weight_only_panels_f32_into):
    # each output the bits of lowbit.linear on its projection alone, bias included
    m = lowbit.quantize_model(biased_llama(torch.float32), recipe, inplace=False)
    r = Runner(m)
    L = r.layers[0]
    kernel = cpu.BACKEND.plan(L.q.qweight.scheme, None, rows, L.q.in_features, torch.float32).kernel
    if kernel != "gemm_f32_fma":
        pytest.skip(f"{rows} rows of {recipe} take {kernel} here")
    _assert_groups_fused_with_the_same_bits(r, rows, torch.float32)
