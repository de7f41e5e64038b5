"""The planner tests' small dense and mixture-of-experts models, as transformers config
dicts."""

DENSE = dict(
    name="tiny-dense",
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=160,
    tie_word_embeddings=False,
)
MOE = dict(
    DENSE,
    name="tiny-moe",
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
