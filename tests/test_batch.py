"""Batched generation (``Runner.generate`` with a list of prompts) against one prompt at
a time on the bundled SmolLM2-135M."""

import pytest
import torch

import lowbit
from lowbit.kernels import cpu
from lowbit.runtime import BatchGeneration, Runner, _BatchCache

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
        monkeypatch.setattr(cpu, "A8_ROWS_MAX_M", rows)
        monkeypatch.setattr(cpu, "AVX2_A8_ROWS_MAX_M", {4: rows, 8: rows})
        monkeypatch.setattr(cpu, "AMX_A8_ROWS_MAX_M", {4: rows, 8: rows})
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
