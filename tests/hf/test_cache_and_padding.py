"""flame's HF classes (flame/hf/modeling.py) with a cache and padded batches, on CPU in float32: greedy generation
with the cache equals generation without it, a prompt fed in pieces gives the logits of one forward, and padded
rows (left or right) get the logits and generations they get alone."""

import subprocess
import sys

import pytest
import torch

from flame.hf.configuration import CONFIG_CLASSES
from flame.hf.modeling import MODEL_CLASSES, FlameCache
from tests.utils.helpers import REPO, tiny_model, tokens

# Float32 CPU runs of the same math in another order (chunked recurrences over other chunk boundaries, attention
# over a longer key list): differences are rounding only.
ATOL, RTOL = 2e-5, 1e-5
PAD_ID = 0

CASES = {
    "transformer": ("transformer", {}),
    "transformer-softpick-window": ("transformer", {"attn_impl": "parallel_scaled_softpick_attn", "window_size": 6}),
    "gated-deltanet": ("gated_deltanet", {"allow_neg_eigval": True}),
    "delta-net": ("delta_net", {}),
    "hybrid": ("gated_deltanet", {"attn": {"layers": [1], "num_heads": 4, "norm_order": "post"}}),
}  # fmt: skip


def flame_hf_model(family: str, **overrides):
    """flame's HF class of a family with the weights of tests.utils.helpers.tiny_model(family, **overrides)."""
    flame_model = tiny_model(family, **overrides)
    config_class, model_class = next(
        (c, m) for c, m in zip(CONFIG_CLASSES, MODEL_CLASSES) if c.family == family
    )
    values = {k: v for k, v in flame_model.args.to_dict().items() if k != "model_type"}
    model = model_class(config_class(**values))
    state = {k if k.startswith("lm_head") else f"model.{k}": v for k, v in flame_model.state_dict().items()}
    model.load_state_dict(state)
    return model.eval()


def hf_model(case: str):
    family, overrides = CASES[case]
    return flame_hf_model(family, **overrides)


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded to one length with random tokens (never PAD_ID alone: the mask must do the hiding)."""
    length = max(len(r) for r in rows)
    ids = tokens(len(rows), length, seed=7)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[i, where], mask[i, where] = row, 1
    return ids, mask


def cache_field(output) -> str:
    """The output's cache field (named past_key_values before transformers 5.2x)."""
    return "cache" if "cache" in output else "past_key_values"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_with_cache_equals_generation_without(case):
    model = hf_model(case)
    prompt = tokens(2, 10)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID, output_scores=True)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, return_dict_in_generate=True, **kwargs)
        uncached = model.generate(prompt, use_cache=False, return_dict_in_generate=True, **kwargs)
    assert isinstance(cached[cache_field(cached)], FlameCache)
    assert torch.equal(cached.sequences, uncached.sequences)
    for with_cache, without in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(with_cache, without, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_fed_in_pieces_gives_the_logits_of_one_forward(case):
    model = hf_model(case)
    x = tokens(2, 80)
    cache = FlameCache()
    with torch.no_grad():
        whole = model(x).logits
        # Pieces shorter than the convolution window, single tokens, and one longer than a 64-token chunk.
        pieces = [model(x[:, a:b], cache=cache).logits for a, b in ((0, 2), (2, 3), (3, 9), (9, 80))]
    assert cache.seen_tokens == 80
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", list(CASES))
def test_padded_batch_logits_equal_each_row_alone(case, side):
    model = hf_model(case)
    rows = [tokens(1, n, seed=n)[0] for n in (70, 41, 9)]
    ids, mask = padded(rows, side)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batch[i][mask[i].bool()], alone, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_left_padded_batch_generates_what_each_row_generates_alone(case):
    model = hf_model(case)
    rows = [tokens(1, n, seed=n)[0] for n in (12, 5)]
    ids, mask = padded(rows, "left")
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], **kwargs)
            assert torch.equal(batch[i, ids.shape[1] :], alone[0, len(row) :])


def test_a_cache_of_another_kind_is_refused():
    from transformers import DynamicCache

    model = hf_model("transformer")
    with pytest.raises(TypeError, match="FlameCache"):
        model(tokens(1, 4), cache=DynamicCache())


def test_importing_the_model_module_first_still_registers_the_auto_classes():
    # flame.hf.modeling's own transformers imports run flame's registration hook while it is half imported.
    code = (
        "import flame.hf.modeling\n"
        "from transformers import AutoModelForCausalLM\n"
        "from flame.hf.configuration import FlameTransformerConfig\n"
        "from tests.utils.helpers import SMALL, SHAPES\n"
        "config = FlameTransformerConfig(**SMALL, **SHAPES['transformer'])\n"
        "print(type(AutoModelForCausalLM.from_config(config)).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["FlameTransformerForCausalLM"]
