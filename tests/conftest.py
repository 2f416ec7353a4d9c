import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The kernel plan's built-in thresholds, not a calibration this machine may have saved
# (tests/test_calibration.py tests that path with its own files).
os.environ["LOWBIT_KERNEL_CALIBRATION"] = "0"
# Triton's interpreter runs the triton backend's kernels on CPU tensors (tests/test_triton.py;
# CI has no GPU).  Triton reads the variable when it decorates a kernel and again while one
# runs, so it is set for the whole session, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from lowbit.kernels import available_backends  # noqa: E402
from lowbit.kernels import triton as triton_kernels  # noqa: E402

settings.register_profile(
    "default", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Every backend that can run here: the reference, cpu, and triton through its interpreter
# (CPU tensors, slow: a test whose shapes are large skips it with `skip_large_for_interpreter`).
BACKENDS = available_backends("cpu") + (["triton"] if triton_kernels.supports(torch.device("cpu")) else [])
FAST_BACKENDS = [b for b in BACKENDS if b != "reference"]
INTERPRETER_MAX_MACS = 1 << 19  # multiply-adds per matmul the interpreter runs in about a second


def skip_large_for_interpreter(backend: str, *dims: int) -> None:
    """Skip a matmul of m * n * k multiply-adds above INTERPRETER_MAX_MACS on the triton backend."""
    if backend == "triton" and math.prod(dims) > INTERPRETER_MAX_MACS:
        pytest.skip(f"triton's interpreter runs small shapes only ({dims})")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def biased_llama(dtype: torch.dtype):
    """A 2-layer random Llama (vocab 96, hidden 128, 4 heads on 2 kv heads, 64 positions) in
    dtype, every attention and MLP projection with a bias that is not zero."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return m


TINY_POSITIONS = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Hugging Face folder: a 1-layer random Llama with max_position_embeddings=48."""
    import transformers

    from lowbit.models.load import bundled_model_path, convert_gguf

    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=TINY_POSITIONS, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    for f in convert_gguf(bundled_model_path(), progress=False).iterdir():  # the bundled model's tokenizer
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out
