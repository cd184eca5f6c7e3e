"""Random tiny `transformers` DeepseekV4ForCausalLM models: the oracle our model is checked against."""
import torch

from model.weights import transformers_deepseek_v4

CASES = {
    # every attention type, hash + top-k MoE, 2 hc streams, YaRN on compressed layers
    "mixed": dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
                  num_attention_heads=4, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
                  o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3, sliding_window=8,
                  layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention"],
                  compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
                  mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2, partial_rotary_factor=0.5,
                  max_position_embeddings=256,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "beta_fast": 32, "beta_slow": 1}),
    # release-like ratios 4/16, 4 hc streams, three hash layers, plain RoPE, more experts per token
    "wide_hc": dict(vocab_size=80, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=5,
                    num_attention_heads=4, head_dim=32, q_lora_rank=24, num_experts_per_tok=3, n_routed_experts=8,
                    o_groups=4, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=12,
                    layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention", "compressed_sparse_attention"],
                    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 2, hc_mult=4, partial_rotary_factor=0.25,
                    max_position_embeddings=512),
    # compressed layers only, a window shorter than the CSA span, top-k larger than the entries early on
    "compressed_only": dict(vocab_size=48, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, head_dim=32, q_lora_rank=16, num_experts_per_tok=2,
                            n_routed_experts=6, o_groups=1, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
                            index_topk=6, sliding_window=4,
                            layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                         "compressed_sparse_attention"],
                            compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 10},
                            mlp_layer_types=["moe"] * 3, hc_mult=3, partial_rotary_factor=0.5,
                            max_position_embeddings=512,
                            rope_parameters={"rope_type": "yarn", "factor": 8.0,
                                             "original_max_position_embeddings": 32, "beta_fast": 16,
                                             "beta_slow": 2}),
    # tied embeddings, one hc stream; transformers ignores n_shared_experts (it writes one shared expert of
    # moe_intermediate_size) and norm_topk_prob (its routers always divide by the top-k sum), and so must we
    "tied": dict(vocab_size=40, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                 head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=2,
                 norm_topk_prob=False, routed_scaling_factor=2.5, tie_word_embeddings=True, o_groups=1, o_lora_rank=8,
                 index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=6,
                 layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"],
                 compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
                 mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=1, partial_rotary_factor=0.5,
                 max_position_embeddings=256),
}


def make_hf(case: str, seed: int = 0, **overrides):
    """A DeepseekV4ForCausalLM with every tensor randomized at a scale that makes each path matter (config:
    CASES[case] with overrides)."""
    DeepseekV4Config, DeepseekV4ForCausalLM = transformers_deepseek_v4()

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**CASES[case], **overrides})
    m = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim >= 2 and "hc" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        for layer in m.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                V, k, E = gate.tid2eid.shape[0], gate.tid2eid.shape[1], gate.num_experts
                gate.tid2eid.copy_(torch.rand(V, E, generator=g).argsort(-1)[:, :k])
            else:
                gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 0.1)
    return m
