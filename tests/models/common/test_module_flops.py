"""FLOPs per token of the generic families counted from their modules (flame.models.common.module_flops), on the
meta device: the matmul weights against hand counts from the configs, the mixers' terms against the formulas of
docs/metrics.md and flame's own families' counts for the same shapes."""

import logging

import pytest
import torch
from fla.layers import attn as fla_attn

from flame.models import build_model, model_args_from_dict
from flame.models.common.flops import chunked_delta_rule_flops_per_token
from flame.models.common.module_flops import ModuleFlops, module_flops

SEQ_LEN = 96


@pytest.fixture
def fla_attention(monkeypatch):
    """FLA's Attention refuses to be built without flash_attn, which only its forward calls."""
    monkeypatch.setattr(fla_attn, "flash_attn_func", object())


def counted(config: dict, impl: str = "auto", seq_len: int = SEQ_LEN) -> tuple[ModuleFlops, int]:
    """The module count of the model a config describes and its get_nparams_and_flops total."""
    args, _ = model_args_from_dict(config, impl=impl)
    with torch.device("meta"):
        model = build_model(args)
    _, total = args.get_nparams_and_flops(model, seq_len)
    blocks = [block for name in model.flame_blocks for block in model.get_submodule(name)]
    return module_flops(model, blocks, seq_len), total


LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
FLA_BASE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}


def swiglu(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up and down projections


def test_llama_counts_its_projections_and_causal_attention_as_flame_does():
    count, total = counted(LLAMA)
    d, kv = 32, 2 * 8  # hidden; kv heads x head_dim (32 / 4)
    per_layer = d * d + 2 * d * kv + d * d + swiglu(d, 64)
    assert count.matmul_params == 2 * per_layer + 4096 * d  # the untied lm head; the embedding is a lookup
    assert count.mixer_flops == 2 * 12 * 4 * 8 * SEQ_LEN
    assert (count.conv_flops, count.uncounted) == (0, [])
    assert total == 6 * count.matmul_params + count.mixer_flops
    tied, _ = counted({**LLAMA, "tie_word_embeddings": True})
    assert tied.matmul_params == count.matmul_params  # a tied lm head is still one matmul


def test_fla_transformer_counts_projections_and_a_sliding_window(fla_attention):
    config = {**FLA_BASE, "model_type": "transformer", "num_heads": 4, "num_kv_heads": 2, "window_size": 40}
    count, _ = counted(config, impl="fla")
    d = 64
    assert count.matmul_params == 2 * (2 * d * d + 2 * d * 32 + swiglu(d, 96)) + 256 * d
    assert count.mixer_flops == 2 * 12 * 4 * 16 * 40  # each query sees min(seq_len, window) keys


def test_fla_mla_counts_keys_and_values_of_their_own_widths():
    config = {**FLA_BASE, "model_type": "mla", "num_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "qk_head_dim": 12, "v_head_dim": 10}  # fmt: skip
    count, _ = counted(config)
    # QK^T over 12-wide keys and the sum of 10-wide values, 2 FLOPs per multiply-add, x3, per head and key.
    assert count.mixer_flops == 2 * 6 * 4 * (12 + 10) * SEQ_LEN
    assert count.uncounted == []


def test_fla_gla_counts_low_rank_gate_and_chunked_state():
    # The low-rank gate is 16 wide: GLA's layer default (GLAConfig has no key for it).
    config = {**FLA_BASE, "model_type": "gla", "num_heads": 4, "expand_k": 0.5, "expand_v": 1}
    count, _ = counted(config)
    d, key, value = 64, 32, 64
    attention = d * key * 2 + d * value * 2 + (d * 16 + 16 * key) + value * d  # q k, v g, low-rank gk, o
    assert count.matmul_params == 2 * (attention + swiglu(d, 96)) + 256 * d
    # Per head (K 8, V 16, chunk 64): state readout and update 4KV, chunk-local 2C(K+V); x3.
    assert count.mixer_flops == 2 * 4 * 3 * (4 * 8 * 16 + 2 * 64 * (8 + 16))
    assert count.conv_flops == 0


def test_fla_mamba2_counts_in_and_out_projections_conv_and_ssd():
    config = {"model_type": "mamba2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "expand": 2, "head_dim": 16, "num_heads": 8, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
              "chunk_size": 32}  # fmt: skip
    count, _ = counted(config)
    d, inner, state, heads = 64, 128, 16, 8
    in_proj = d * (2 * inner + 2 * state + heads)  # z, x, B, C and dt
    assert count.matmul_params == 2 * (in_proj + inner * d) + 256 * d  # no MLP in Mamba2's blocks
    assert count.conv_flops == 2 * 6 * (inner + 2 * state) * 4  # depthwise over x, B and C
    # SSD per head: a state of state_size x head_dim, chunk 32.
    assert count.mixer_flops == 2 * heads * 3 * (4 * state * 16 + 2 * 32 * (state + 16))


def test_fla_gated_deltanet_counts_projections_convs_and_the_delta_rule():
    config = {**FLA_BASE, "model_type": "gated_deltanet", "num_heads": 2, "head_dim": 16, "expand_v": 2}
    count, _ = counted(config, impl="fla")
    d, key, value = 64, 32, 64
    attention = 2 * d * key + d * value + 2 * d * 2 + d * value + value * d  # q k, v, a b, g, o
    assert count.matmul_params == 2 * (attention + swiglu(d, 96)) + 256 * d
    assert count.conv_flops == 2 * 6 * (key + key + value) * 4  # q, k and v short convolutions, kernel 4
    assert count.mixer_flops == 2 * 2 * chunked_delta_rule_flops_per_token(16, 32)


def test_mixture_of_experts_counts_the_routed_experts_only():
    config = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    count, _ = counted(config)
    d = 32
    experts = 4 * swiglu(d, 64) * 2 // 4  # 2 of 4 experts per token
    assert count.matmul_params == 2 * (2 * d * d + 2 * d * 16 + 4 * d + experts) + 4096 * d  # router 4 x d


def test_gpt2_counts_its_conv1d_projections():
    count, _ = counted({"model_type": "gpt2", "vocab_size": 4096, "n_embd": 32, "n_layer": 2, "n_head": 4})
    d = 32
    assert count.matmul_params == 2 * (d * 3 * d + d * d + 2 * d * 4 * d) + 4096 * d  # qkv, o, MLP; tied head
    assert count.mixer_flops == 2 * 12 * 4 * 8 * SEQ_LEN


@pytest.mark.parametrize(
    ("config", "contexts"),
    [
        ({"model_type": "mistral", "sliding_window": 40}, [40, 40]),  # the config's window, every layer
        ({"model_type": "qwen2", "sliding_window": 40, "use_sliding_window": True, "max_window_layers": 1},
         [SEQ_LEN, 40]),  # layer_types: full, then sliding
    ],
)  # fmt: skip
def test_transformers_sliding_windows_count_per_layer(config, contexts):
    count, _ = counted({**LLAMA, **config})
    assert count.mixer_flops == sum(12 * 4 * 8 * context for context in contexts)


def test_transformers_linear_attention_is_not_counted_as_softmax_attention():
    config = {**LLAMA, "model_type": "minimax", "num_local_experts": 2, "num_experts_per_tok": 1,
              "layer_types": ["full_attention", "linear_attention"]}  # fmt: skip
    count, _ = counted(config)
    assert count.mixer_flops == 12 * 4 * 8 * SEQ_LEN  # the full-attention layer
    assert count.uncounted == ["transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention"]


def vector_params(model: torch.nn.Module) -> int:
    """Norm scales, decay parameters and biases: what flame's families count as 6 FLOPs each and the module count
    does not."""
    return sum(p.numel() for p in model.parameters() if p.ndim == 1)


def test_transformer_described_by_flame_and_llama_gives_the_same_count():
    flame_config = {"model_type": "transformer", "vocab_size": 4096, "hidden_size": 32, "num_heads": 4,
                    "num_kv_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2}  # fmt: skip
    args, _ = model_args_from_dict(flame_config)
    with torch.device("meta"):
        flame_model = build_model(args)
    _, flame_total = args.get_nparams_and_flops(flame_model, SEQ_LEN)
    count, llama_total = counted(LLAMA)
    assert count.mixer_flops == args.layer_flops_per_token(SEQ_LEN)
    # flame's own families count 6 x every non-embedding parameter, norm scales included.
    assert llama_total == flame_total - 6 * vector_params(flame_model) > 0


def test_flame_families_and_fla_classes_count_the_same_mixers(fla_attention):
    hybrid = {**FLA_BASE, "model_type": "gated_deltanet", "num_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
              "attn": {"layers": [1], "num_heads": 4, "window_size": 40}}  # fmt: skip
    transformer = {**FLA_BASE, "model_type": "transformer", "num_heads": 4, "window_size": 40}
    delta_net = {**FLA_BASE, "model_type": "delta_net", "num_heads": 4}
    for config in (hybrid, transformer, delta_net):
        args, _ = model_args_from_dict(config, impl="flame")
        with torch.device("meta"):
            flame_model = build_model(args)
        _, flame_total = args.get_nparams_and_flops(flame_model, SEQ_LEN)
        count, fla_total = counted(config, impl="fla")
        assert count.mixer_flops == args.layer_flops_per_token(SEQ_LEN), config["model_type"]
        assert fla_total == flame_total - 6 * vector_params(flame_model), config["model_type"]


def test_layers_without_a_mixer_term_are_named_in_a_warning(caplog):
    config = {**LLAMA, "model_type": "minimax", "num_local_experts": 2, "num_experts_per_tok": 1,
              "layer_types": ["linear_attention", "linear_attention"]}  # fmt: skip
    lightning = "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention"
    with caplog.at_level(logging.WARNING):
        count, total = counted(config)
    assert count.uncounted == [lightning] and count.mixer_flops == 0
    assert total == 6 * count.matmul_params + count.conv_flops
    assert caplog.records[-1].getMessage().endswith(f"(MFU reads low): {lightning}")


def test_hgrns_elementwise_scan_adds_nothing_and_is_counted():
    config = {"model_type": "hgrn", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2}
    count, total = counted(config)
    assert count.uncounted == [] and count.mixer_flops == 0 and total == count.total


@pytest.mark.parametrize(("topk", "context"), [(3, 3 * 16), (8, SEQ_LEN)])
def test_moba_counts_its_own_and_its_chosen_blocks(topk, context):
    """Each query attends topk blocks of 16 keys (its own and topk - 1 chosen), at most the sequence."""
    config = {**FLA_BASE, "model_type": "moba", "num_heads": 4, "moba_chunk_size": 16, "moba_topk": topk}
    count, total = counted(config)
    assert count.mixer_flops == 2 * 12 * 4 * 16 * context  # 2 layers of 4 heads of 64 / 4 channels
    assert count.uncounted == [] and count.total == total


def test_native_sparse_attention_counts_its_three_branches():
    config = {**FLA_BASE, "model_type": "nsa", "num_heads": 16, "num_kv_heads": 1, "head_dim": 8,
              "block_size": 16, "block_counts": 2, "window_size": 40}  # fmt: skip
    count, total = counted(config)
    compressed, selected, window = 96 // 16, 2 * 16, 40
    assert count.mixer_flops == 2 * 12 * 16 * 8 * (compressed + selected + window)
    assert count.uncounted == [] and count.total == total


def test_flame_hybrid_and_its_transformers_olmo_hybrid_export_count_the_same():
    """transformers' Gated DeltaNet and attention layers, as flame's --format olmo_hybrid export describes them."""
    from flame.models.gated_deltanet.state_dict_adapter import OlmoHybridAdapter

    config = {**FLA_BASE, "model_type": "gated_deltanet", "num_hidden_layers": 4, "num_heads": 4, "head_dim": 16,
              "expand_v": 2, "allow_neg_eigval": True, "output_norm_eps": 1e-5,
              "attn": {"layers": [3], "num_heads": 4, "qk_norm": True, "qk_norm_scope": "full",
                       "norm_order": "post"}}  # fmt: skip
    args, _ = model_args_from_dict(config)
    with torch.device("meta"):
        flame_model = build_model(args)
    _, flame_total = args.get_nparams_and_flops(flame_model, SEQ_LEN)
    export = {k: v for k, v in OlmoHybridAdapter(args).hf_config().items() if k != "architectures"}
    count, olmo_total = counted(export)
    assert count.mixer_flops == args.layer_flops_per_token(SEQ_LEN) and count.uncounted == []
    assert olmo_total == flame_total - 6 * vector_params(flame_model)


def test_fla_mamba_counts_projections_conv_and_the_selective_scans_state():
    """Mamba (v1), built as flame's layer on flame's scan without mamba_ssm: in, x (dt rank, B, C), dt and out
    projections; the depthwise conv1d; the scan's state update and readout, 12 x intermediate x state."""
    config = {"model_type": "mamba", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": 8}  # fmt: skip
    count, total = counted(config)
    d, inner, state, rank = 64, 128, 16, 8
    layer = d * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * d
    assert count.matmul_params == 2 * layer + 256 * d  # no MLP in Mamba's blocks; the lm head
    assert count.conv_flops == 2 * 6 * inner * 4
    assert count.mixer_flops == 2 * 12 * inner * state
    assert count.uncounted == [] and count.total == total


def test_fla_path_attention_counts_softmax_attention_over_the_context():
    config = {**FLA_BASE, "model_type": "path_attn", "num_heads": 4}
    count, total = counted(config)
    assert count.mixer_flops == 2 * 12 * 4 * 16 * SEQ_LEN  # heads of 64 / 4 channels over all 96 keys
    assert count.uncounted == [] and count.total == total


def test_rodimus_counts_one_head_of_chunked_linear_attention():
    """Keys of expand_ratio (16) channels, values of d_inner (2 x 64), one head, chunk 64."""
    config = {"model_type": "rodimus", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "block_type": "rodimus", "expand_ratio": 16}  # fmt: skip
    count, total = counted(config)
    assert count.mixer_flops == 2 * 3 * (4 * 16 * 128 + 2 * 64 * (16 + 128))
    assert count.uncounted == [] and count.total == total


def test_raven_counts_gsas_two_linear_attentions_over_every_slot():
    """Raven routes each token to topk of num_slots slots, and GSA's kernel runs over all of them: per head, K x
    slots and slots x V (K = V = 16, 16 slots), chunk 64."""
    config = {"model_type": "raven", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
              "num_slots": 16, "topk": 4}  # fmt: skip
    count, total = counted(config)
    assert count.mixer_flops == 2 * 4 * 2 * 3 * (4 * 16 * 16 + 2 * 64 * (16 + 16))
    assert count.uncounted == [] and count.total == total


def test_deltaformer_counts_its_recurrence_and_its_attention_over_the_context():
    config = {**FLA_BASE, "model_type": "deltaformer", "num_heads": 4}
    count, total = counted(config)
    assert count.mixer_flops == 2 * 2 * 12 * 4 * 16 * SEQ_LEN  # 2 layers, two passes over all 96 keys
    assert count.uncounted == [] and count.total == total


def test_mesa_net_counts_its_states_conjugate_gradient_and_readout():
    """K = V = 16, chunk 64, 5 conjugate-gradient iterations after the start: per head the state updates
    2K^2 + 2KV, six products with the K x K state and the chunk's keys (2K^2 + 4CK), the readout 2KV + 2C(K+V)."""
    config = {**FLA_BASE, "model_type": "mesa_net", "num_heads": 4, "head_dim": 16, "max_cg_step_training": 5}
    count, total = counted(config)
    states, solve, readout = 2 * 256 + 2 * 256, 6 * (2 * 256 + 4 * 64 * 16), 2 * 256 + 2 * 64 * 32
    assert count.mixer_flops == 2 * 4 * 3 * (states + solve + readout)
    assert count.uncounted == [] and count.total == total


@pytest.mark.parametrize(("window", "context"), [(None, SEQ_LEN), (40, 40)])
def test_parallax_counts_two_attentions_over_its_window(window, context):
    config = {**FLA_BASE, "model_type": "parallax", "num_heads": 4, "window_size": window}
    count, total = counted(config)
    assert count.mixer_flops == 2 * 2 * 12 * 4 * 16 * context  # 2 layers; q's and r's scores, two value sums
    assert count.uncounted == [] and count.total == total


@pytest.mark.parametrize(
    ("schedule", "contexts"),
    [("power_of_2", [4 + 2 + 24, 8 + 2 + 12, 16 + 2 + 6]), ("none", [16 + 2 + 6])],
)
def test_cat_counts_its_chunk_and_the_compressed_keys_over_the_chunk_sizes_it_trains_with(schedule, contexts):
    """Each decoder query attends the c + 2 positions of its chunk and one compressed key per chunk (96 / c):
    power_of_2 trains with chunk sizes 4, 8 and 16 in turn (the mean of their contexts), "none" with 16 only.
    4 heads of 16 channels."""
    config = {**FLA_BASE, "model_type": "cat", "num_heads": 4, "max_chunk_size": 16, "min_train_chunk_size": 4,
              "train_chunk_size_schedule": schedule}  # fmt: skip
    count, total = counted(config)
    assert count.mixer_flops == 2 * 12 * 4 * 16 * sum(contexts) // len(contexts)
    assert count.uncounted == [] and count.total == total


def test_cyclic_flow_attention_counts_two_slot_attentions_and_its_readout_table():
    """Per head, K = V = 16 and 8 slots, chunk 64: keys to slots (K x 8) and slots to values (8 x V) as chunked
    linear attention, and the logits through the 7 x 8 readout table and back (2 x 2 x 7 x 8); x3."""
    config = {**FLA_BASE, "model_type": "cyclic_flow_attention", "num_heads": 4, "head_dim": 16,
              "num_slots": 8}  # fmt: skip
    count, total = counted(config)
    linear_attention = 4 * 16 * 8 + 2 * 64 * (16 + 8)
    assert count.mixer_flops == 2 * 4 * 3 * (2 * linear_attention + 4 * 7 * 8)
    assert count.uncounted == [] and count.total == total


@pytest.mark.parametrize(("seq_len", "readouts"), [(SEQ_LEN, 1 / 2), (4096, 3)])
def test_log_linear_mamba2_reads_the_level_states_its_chunk_index_sets(seq_len, readouts):
    """4 heads, K = state_size 16, V = head_dim 32, chunk 64: chunk i reads popcount(i) level states, 2KV each:
    0.5 per token over chunks 0 and 1 (96 tokens), 192 / 64 = 3 over 64 chunks (4096 tokens); the update 2KV and
    the chunk-local products 2C(K+V); x3."""
    config = {"model_type": "log_linear_mamba2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "expand": 2, "head_dim": 32, "state_size": 16}  # fmt: skip
    count, total = counted(config, seq_len=seq_len)
    k, v = 16, 32
    assert count.mixer_flops == 2 * 4 * 3 * (2 * k * v * (1 + readouts) + 2 * 64 * (k + v))
    assert count.uncounted == [] and count.total == total


@pytest.mark.parametrize(("mimo", "rank"), [(False, 1), (True, 2)])
def test_mamba3_counts_mamba2s_ssd_per_mimo_rank(mimo, rank):
    """Built on the meta device (its kernels need mamba_ssm): 4 heads, K = state_size 16, V = head_dim 32, chunk 32;
    with MIMO rank 2, two keys and queries per token: 2 x the SSD term over chunks of 2 x 32 rows."""
    config = {"model_type": "mamba3", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "expand": 2,
              "head_dim": 32, "state_size": 16, "chunk_size": 32, "is_mimo": mimo, "mimo_rank": 2}  # fmt: skip
    count, total = counted(config)
    assert count.mixer_flops == 2 * rank * 4 * 3 * (4 * 16 * 32 + 2 * rank * 32 * (16 + 32))
    assert count.uncounted == [] and count.total == total
