"""Training FLOPs per token of a model counted from its modules, for the generic families (FLA's ~40 classes and
transformers' causal LMs), on the meta device.

What one token costs in training (forward + backward = 3 x forward, 2 FLOPs per multiply-add):

- matmuls: 6 x the weights of the nn.Linear modules it goes through (FLA's models hold every projection in one,
  BitLinear included, and apply its fused norm/activation-linear functions to those modules' weights) and of
  transformers' Conv1D (GPT-2's projections), routers and stacked experts. The lm head is a matmul, tied or not;
  an embedding is a lookup and costs nothing. Biases, norm scales, decay and gate vectors, RWKV's lerp vectors and
  Mamba's A_log/D act elementwise and are not counted. Routed weights count for the share a token uses: top_k of
  num_experts experts, a MoM layer's topk of num_memories memories.
- convolutions (short convolutions of the linear-attention layers, Mamba's conv1d): a kernel of weight W costs
  2 x W per output position, so 6 x W per token (2 x kernel x channels forward for a depthwise one).
- the sequence mixers' products between activations, which have no weights (:func:`mixer_flops_per_token`).

Layers are recognised by their classes (FLA's in ``fla.layers`` and CAT's attention in its model's module,
transformers' attention and Gated DeltaNet by name); a block's mixer of any other class gets its matmuls only, and
:attr:`ModuleFlops.uncounted` names it.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from flame.models.common.flops import DELTA_RULE_CHUNK, chunked_delta_rule_flops_per_token

# Chunk size of FLA's chunked linear-attention kernels (GLA, RetNet, HGRN2, GSA, RWKV6, MesaNet, ...), as of the
# delta rule.
LINEAR_ATTENTION_CHUNK = DELTA_RULE_CHUNK

# FLA 0.6.0's layer classes (fla.layers), by what their training kernel computes.
# QK^T and the weighted sum of V over the context, like softmax attention.
FLA_SOFTMAX_ATTENTION = {
    "Attention",
    "BitAttention",
    "ForgettingAttention",
    "StickBreakingAttention",
    "SlidingWindowSharedKeyAttention",
    "WallAttention",
    # PaTH: softmax attention whose keys carry Householder transforms (the transforms are not counted)
    "PaTHAttention",
    # flame's layers in place of Attention and BitAttention where flash-attn is not installed (fla_attention.py)
    "FLAAttention",
    "FLABitAttention",
}
# Chunked (gated) linear attention: a K x V state per head.
FLA_LINEAR_ATTENTION = {
    "GatedLinearAttention",
    "MultiScaleRetention",
    "SimpleGatedLinearAttention",
    "LinearAttention",
    "RWKV6Attention",
    "HGRN2Attention",
    "LightNetAttention",
}
# Two chained linear attentions through num_slots memory slots: keys to slots (K x M), slots to values (M x V).
# Raven's slots are routed (topk of num_slots per token), but its kernel (GSA's) runs over every slot.
FLA_SLOT_ATTENTION = {"GatedSlotAttention", "ABCAttention", "Raven"}
# The chunked delta rule and its variants (per-channel gates, Householder products, DPLR, routed memories).
FLA_DELTA_RULE = {
    "DeltaNet",
    "GatedDeltaNet",
    "Comba",
    "GatedDeltaProduct",
    "KimiDeltaAttention",
    "PrecondGatedDeltaNet",
    "PrecondKDA",
    "RWKV7Attention",
    "MomAttention",
}
# Mamba2's SSD: chunked linear attention with a state of ssm_state_size x head_dim per head.
FLA_SSD = {"Mamba2"}
# Mamba's selective scan: a state of intermediate_size x ssm_state_size, updated and read out token by token.
FLA_SELECTIVE_SCAN = {"Mamba"}
# Modules of a block that are not its sequence mixer.
NOT_MIXERS = ("Norm", "MLP", "Mlp", "FeedForward", "Moe", "MoE", "Expert", "Dropout", "Identity")


@dataclass
class ModuleFlops:
    """A model's training FLOPs per token, by term."""

    matmul_params: int = 0  # weights of the matmuls one token goes through
    conv_flops: int = 0
    mixer_flops: int = 0
    uncounted: list[str] = field(default_factory=list)  # classes of block mixers with no mixer term

    @property
    def total(self) -> int:
        return 6 * self.matmul_params + self.conv_flops + self.mixer_flops


def softmax_attention_flops_per_token(num_heads: int, head_dim: int, seq_len: int, window: int | None) -> int:
    """QK^T and the weighted sum of V over the full square of min(seq_len, window) keys, as flame's transformer
    family and torchtitan count it (flame.models.common.flops): 2 x 2 x head_dim per key and head, x3."""
    context = min(seq_len, window) if window else seq_len
    return 12 * num_heads * head_dim * context


def chunked_linear_attention_flops_per_token(key_dim: int, value_dim: int, chunk: int) -> int:
    """Training FLOPs per token of one head of chunked linear attention, key dim K, value dim V, chunk C: the state
    readout Q S (2KV) and update S += K^T V (2KV), and the chunk-local Q K^T (2CK) and its product with V (2CV),
    over the full chunk square as for attention; x3. Gates and decays are elementwise and left out."""
    return 3 * (4 * key_dim * value_dim + 2 * chunk * (key_dim + value_dim))


def mesa_flops_per_token(key_dim: int, value_dim: int, chunk: int, cg_steps: int) -> int:
    """Training FLOPs per token of one MesaNet head (FLA's chunked kernels): the K x K and K x V states' updates
    (2K^2 + 2KV); the conjugate-gradient solve for the query, whose start and each of its ``cg_steps`` iterations
    multiply by the chunk's K x K state (2K^2) and by its keys twice (4CK); the solved query's readout, as in chunked
    linear attention (2KV + 2C(K+V)); x3."""
    k, v, c = key_dim, value_dim, chunk
    return 3 * (2 * k * k + 4 * k * v + 2 * c * (k + v) + (cg_steps + 1) * (2 * k * k + 4 * c * k))


def log_linear_flops_per_token(key_dim: int, value_dim: int, chunk: int, seq_len: int) -> int:
    """Training FLOPs per token of one head of FLA's chunked log-linear attention: chunked linear attention whose
    chunk i reads one K x V state per binary digit set in i (its Fenwick-tree levels), popcount(i) readouts of 2KV,
    averaged over the ceil(seq_len / C) chunks (rounded down); the state update 2KV and the chunk-local products
    2C(K+V) as in chunked linear attention; x3. The level scales and the merges of the states are elementwise."""
    chunks = math.ceil(seq_len / chunk)
    readouts = sum(i.bit_count() for i in range(chunks))
    per_chunk = 2 * key_dim * value_dim + 2 * chunk * (key_dim + value_dim)
    return 3 * (per_chunk * chunks + 2 * key_dim * value_dim * readouts) // chunks


def cat_attention_context(config, seq_len: int) -> float:
    """Keys per query of CAT's decoder attention (FLA's mask): the c + 2 positions of its own chunk (the chunk,
    the previous chunk's compression and a separator) and one compressed key per chunk, ceil(seq_len / c); averaged
    over the chunk sizes c it trains with, one per step in turn (the powers of two from min_train_chunk_size to
    max_chunk_size under train_chunk_size_schedule "power_of_2", else max_chunk_size)."""
    sizes = [config.max_chunk_size]
    if config.train_chunk_size_schedule == "power_of_2":
        sizes = [config.min_train_chunk_size]
        while sizes[-1] * 2 <= config.max_chunk_size:
            sizes.append(sizes[-1] * 2)
    return sum(c + 2 + math.ceil(seq_len / c) for c in sizes) / len(sizes)


def fla_mixer_flops_per_token(module: nn.Module, seq_len: int) -> int | None:
    """Training FLOPs per token of one of FLA's layers beyond its weights; None for a class not classified. flame's
    subclasses of FLA's layers (FLA_LAYER_REPLACEMENTS) are counted as the FLA class they derive from."""
    name = next(
        (cls.__name__ for cls in type(module).__mro__ if cls.__module__.startswith("fla.")),
        type(module).__name__,
    )
    if name in FLA_SOFTMAX_ATTENTION:
        window = getattr(module, "window_size", None)
        return softmax_attention_flops_per_token(module.num_heads, module.head_dim, seq_len, window)
    if name == "MoBA":
        # Each query attends its own block and the topk - 1 earlier blocks it chooses.
        window = module.moba_topk * module.moba_chunk_size
        return softmax_attention_flops_per_token(module.num_heads, module.head_dim, seq_len, window)
    if name == "NativeSparseAttention":
        # Three branches per query: the compressed keys (one per block), the selected blocks and the sliding window.
        # The selection's scores, the compressed branch's QK^T again, run forward only and are left out.
        context = (
            math.ceil(seq_len / module.block_size)
            + min(seq_len, module.block_counts * module.block_size)
            + min(seq_len, module.window_size or 0)
        )
        return 12 * module.num_heads * module.head_dim * context
    if name == "DeltaFormerAttention":
        # Two passes over the earlier keys per query: the recurrence that builds u (its softmax scores and the
        # weighted sum of the earlier u), then softmax attention over u.
        return 2 * softmax_attention_flops_per_token(module.num_heads, module.head_dim, seq_len, None)
    if name == "Parallax":
        # Two score matrices over the keys (q's and r's) and two weighted sums of the values.
        window = module.window_size
        return 2 * softmax_attention_flops_per_token(module.num_heads, module.head_dim, seq_len, window)
    if name == "MesaNet":
        return module.num_heads * mesa_flops_per_token(
            module.head_k_dim, module.head_v_dim, LINEAR_ATTENTION_CHUNK, module.max_cg_step_training
        )
    if name == "HGRNAttention":
        return 0  # an elementwise gated recurrence: no product between activations
    if name == "CATDecoderAttention":
        # Softmax attention over cat_attention_context's keys, per query position as its weights are counted (the
        # decoder runs (c + 2) / c positions per token, which neither term counts). Its compressor's attention
        # within each chunk (c + 2 keys; half the heads and a quarter of the layers by default) is left out: under
        # 1% of this term at 4096 tokens.
        context = cat_attention_context(module.config, seq_len)
        return round(12 * module.num_heads * module.head_dim * context)
    if name == "CyclicFlowAttention":
        # Two chained chunked linear attentions through M = num_slots slots, as slot attention's (keys to slots,
        # K x M; slots to values, M x V; chunk 64), and between them each token's slot logits through the readout
        # table (R = num_slots - 1 rows of M, a parameter no nn.Linear holds) and its probabilities back through it:
        # 2 x 2RM, x3. The slots' rotations by the clock are elementwise.
        slots, chunk = module.num_slots, LINEAR_ATTENTION_CHUNK
        return module.num_heads * (
            chunked_linear_attention_flops_per_token(module.head_k_dim, slots, chunk)
            + chunked_linear_attention_flops_per_token(slots, module.head_v_dim, chunk)
            + 12 * module.num_readout_slots * slots
        )
    if name == "LogLinearMamba2":
        # Mamba2's SSD (K = ssm_state_size, V = head_dim) on FLA's log-linear kernel.
        return module.num_heads * log_linear_flops_per_token(
            module.ssm_state_size, module.head_dim, module.chunk_size, seq_len
        )
    if name == "Mamba3":
        # Counted as Mamba2's SSD (mamba_ssm's kernels, which FLA's layer calls; flame's layer runs Mamba2's scan): mimo_rank (1 without MIMO) keys and
        # queries per token, so rank x the SSD term over chunks of rank x chunk_size rows. The trapezoidal rule
        # (a two-band factor on the chunk's mask) and the rotary angles act elementwise.
        rank = module.mimo_rank
        chunk = rank * module.chunk_size
        per_head = chunked_linear_attention_flops_per_token(module.ssm_state_size, module.head_dim, chunk)
        return rank * module.num_heads * per_head
    if name == "MultiheadLatentAttention":
        # Keys of qk_head_dim and values of v_head_dim per head: half the term above with each.
        context = min(seq_len, module.window_size) if module.window_size else seq_len
        return 6 * module.num_heads * (module.qk_head_dim + module.v_head_dim) * context
    if name in FLA_LINEAR_ATTENTION:
        # HGRN2 and LightNet name their key and value dims forget and input dims.
        key_dim = getattr(module, "head_k_dim", None) or module.head_f_dim
        value_dim = getattr(module, "head_v_dim", None) or module.head_i_dim
        return module.num_heads * chunked_linear_attention_flops_per_token(
            key_dim, value_dim, LINEAR_ATTENTION_CHUNK
        )
    if name == "RodimusAttention":
        # One head of chunked gated linear attention: keys of mem_size, values of d_inner.
        return chunked_linear_attention_flops_per_token(
            module.mem_size, module.d_inner, LINEAR_ATTENTION_CHUNK
        )
    if name in FLA_SLOT_ATTENTION:
        slots, chunk = module.num_slots, LINEAR_ATTENTION_CHUNK
        return module.num_heads * (
            chunked_linear_attention_flops_per_token(module.head_k_dim, slots, chunk)
            + chunked_linear_attention_flops_per_token(slots, module.head_v_dim, chunk)
        )
    if name in FLA_DELTA_RULE:
        heads = getattr(module, "num_v_heads", None) or module.num_heads
        key_dim = getattr(module, "head_k_dim", None) or getattr(module, "head_qk_dim", None)
        key_dim = key_dim or module.head_dim  # RWKV7
        per_head = chunked_delta_rule_flops_per_token(key_dim, module.head_v_dim)
        # Each token runs num_householder delta steps (GatedDeltaProduct), or through its topk memories and the
        # shared one (MoM).
        steps = getattr(module, "num_householder", 1)
        if name == "MomAttention":
            steps = module.topk + int(module.shared_mem)
        return steps * heads * per_head
    if name in FLA_SSD:
        return module.num_heads * chunked_linear_attention_flops_per_token(
            module.ssm_state_size, module.head_dim, module.chunk_size
        )
    if name in FLA_SELECTIVE_SCAN:
        # The state's update (delta B x, 2 per entry) and readout (C h, 2 per entry), x3: the linear-attention
        # state terms with K = ssm_state_size and V = intermediate_size; exp(delta A) is elementwise.
        return 3 * 4 * module.intermediate_size * module.ssm_state_size
    return None


def transformers_mixer_flops_per_token(module: nn.Module, seq_len: int) -> int | None:
    """Training FLOPs per token of one of transformers' attention or Gated DeltaNet layers; None for others."""
    name = type(module).__name__
    # Causal self-attention only: the linear-attention classes (MiniMax's lightning attention, Kimi's delta
    # attention, ...) and cross-attention do not set is_causal.
    if (
        name.endswith("Attention")
        and getattr(module, "is_causal", False) is True
        and hasattr(module, "head_dim")
    ):
        config = module.config
        q_proj = getattr(module, "q_proj", None)
        if isinstance(q_proj, nn.Linear):
            heads = q_proj.out_features // module.head_dim
        else:
            heads = getattr(module, "num_heads", None) or config.num_attention_heads
        return softmax_attention_flops_per_token(heads, module.head_dim, seq_len, attention_window(module))
    if name.endswith("GatedDeltaNet"):
        return module.num_v_heads * chunked_delta_rule_flops_per_token(module.head_k_dim, module.head_v_dim)
    return None


def attention_window(module: nn.Module) -> int | None:
    """The sliding window of one of transformers' attention layers: the layer's own where the class sets it (None
    for the full-attention layers of layer_types), else the config's for every layer (Mistral)."""
    return getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))


# flame's modules that stand in for FLA's layers (FLA_LAYER_REPLACEMENTS): counted as the layers they replace.
FLAME_FLA_LAYERS = (
    "flame.models.layers.fla_attention",
    "flame.models.layers.fla_mamba",
    "flame.models.layers.fla_mamba2",
    "flame.models.layers.fla_mamba3",
    "flame.models.layers.fla_log_linear_mamba2",
)
# FLA's layers defined in a model's module rather than in fla.layers.
FLA_MODEL_LAYERS = ("fla.models.cat.modeling_cat",)  # CATDecoderAttention


def mixer_flops_per_token(module: nn.Module, seq_len: int) -> int | None:
    """Training FLOPs per token of a sequence mixer beyond its weights, None where its class is not classified."""
    where = type(module).__module__
    if where.startswith("fla.layers.") or where in FLAME_FLA_LAYERS or where in FLA_MODEL_LAYERS:
        return fla_mixer_flops_per_token(module, seq_len)
    if where.startswith("transformers.models."):
        return transformers_mixer_flops_per_token(module, seq_len)
    return None


def routed_fractions(model: nn.Module) -> dict[int, float]:
    """The share of its weights each routed module applies per token, by module id: a MoM layer's per-memory
    projections (the topk of num_memories memories a token is routed to) and transformers' stacked experts (3-D
    parameters, top_k of num_experts: the module's top_k, else the config's num_experts_per_tok)."""
    fractions = {}
    for module in model.modules():
        if type(module).__name__ == "MomAttention":
            for child in module.children():
                if isinstance(child, nn.ModuleList) and len(child) == module.num_memories:
                    for linear in child.modules():
                        fractions[id(linear)] = module.topk / module.num_memories
        elif stacked_experts(module):
            top_k = getattr(module, "top_k", None) or model.config.num_experts_per_tok
            fractions[id(module)] = top_k / module.num_experts
    return fractions


def matmul_weights(module: nn.Module) -> int:
    """The weights of the matmuls a module applies itself: nn.Linear's (and subclasses'), transformers' Conv1D,
    a router's weight (transformers' *Router modules apply it with F.linear) and stacked experts' 3-D weights."""
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
        return module.weight.numel()
    if type(module).__name__.endswith("Router") and isinstance(getattr(module, "weight", None), nn.Parameter):
        return module.weight.numel()
    return sum(p.numel() for p in stacked_experts(module))


def stacked_experts(module: nn.Module) -> list[nn.Parameter]:
    """transformers' stacked expert weights: a module's 3-D parameters of num_experts matrices."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        return []
    return [p for p in module.parameters(recurse=False) if p.ndim == 3 and p.shape[0] == experts]


def module_flops(model: nn.Module, blocks: Iterable[nn.Module], seq_len: int) -> ModuleFlops:
    """Training FLOPs per token of ``model`` at ``seq_len``; ``blocks`` are its decoder layers, whose mixers of
    unclassified classes :attr:`ModuleFlops.uncounted` names."""
    count = ModuleFlops()
    fractions = routed_fractions(model)
    matmul_params = 0.0
    mixers = set()
    for module in model.modules():
        if isinstance(module, nn.Conv1d):
            count.conv_flops += 6 * module.weight.numel()
            continue
        matmul_params += fractions.get(id(module), 1.0) * matmul_weights(module)
        if (flops := mixer_flops_per_token(module, seq_len)) is not None:
            count.mixer_flops += flops
            mixers.add(id(module))
    count.matmul_params = round(matmul_params)
    uncounted = set()
    for block in blocks:
        for child in block.children():
            name = type(child).__name__
            if any(part in name for part in NOT_MIXERS) or isinstance(child, (nn.Linear, nn.Conv1d)):
                continue
            if not any(id(m) in mixers for m in child.modules()) and any(True for _ in child.parameters()):
                uncounted.add(f"{type(child).__module__}.{name}")
    count.uncounted = sorted(uncounted)
    return count
