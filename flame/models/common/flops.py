"""FLOPs per token of the sequence mixers, beyond the 6 FLOPs per parameter that every matmul weight costs.

Training FLOPs per token are ``6 x (non-embedding parameters) + sum over layers of the mixer's own term``
(:meth:`flame.models.common.args.ModelArgs.get_nparams_and_flops`): the parameters cover every projection, the MLP
and the lm head; the mixer terms cover the products between activations, which have no weights.

- Softmax attention (transformer layers and the attention layers of hybrids): ``12 x heads x head_dim x context``
  (QK^T and the weighted sum of V, 2 FLOPs per multiply-add, over the full square as torchtitan counts it; x3 for
  forward + backward; context = min(seq_len, window)).
- Chunked (gated) delta rule (DeltaNet and Gated DeltaNet layers): :func:`chunked_delta_rule_flops_per_token`.

The generic families (FLA's and transformers' classes) are counted from their modules with the same terms:
flame.models.common.module_flops.
"""

# Chunk size of the chunked delta-rule kernels (FLA's and flame.ops').
DELTA_RULE_CHUNK = 64


def chunked_delta_rule_flops_per_token(key_dim: int, value_dim: int, chunk: int = DELTA_RULE_CHUNK) -> int:
    """Training FLOPs per token of one head of the chunked (gated) delta rule, key dim K, value dim V, chunk C.

    Forward, per token, following FLA's kernels (2 FLOPs per multiply-add; causal masks not discounted, as for
    attention):

    - WY/UT transform: A = beta K K^T within the chunk (2CK), its inverse by blocked forward substitution (C^2/3),
      W = A (beta K) and U = A (beta V) (2C(K+V));
    - state read and write: V_new = U - W S (2KV), O += Q S (2KV), S += K^T V_new (2KV): 6KV;
    - chunk-local attention: Q K^T (2CK) and its product with V_new (2CV): 2C(K+V).

    Forward = 4C(K+V) + 2CK + C^2/3 + 6KV; training counts it x3 (backward ~ 2 x forward). Gates, beta and
    normalisations are elementwise and left out. For K = V = 128 and C = 64 this is ~545k FLOPs per head per token,
    what softmax attention costs at a context of ~350 tokens.
    """
    forward = (
        4 * chunk * (key_dim + value_dim) + 2 * chunk * key_dim + chunk * chunk // 3 + 6 * key_dim * value_dim
    )
    return 3 * forward
