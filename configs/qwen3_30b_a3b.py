"""Qwen3-30B-A3B's shape (Qwen/Qwen3-30B-A3B config.json): 48 layers, d_model 2048, 32
query heads on 4 K/V heads of 128 with RMS-normed queries and keys, a mixture of 128
SwiGLU experts of width 768 in every layer, 8 per token (norm_topk_prob: renormalized),
vocabulary 151936, rope theta 1e6, RMS eps 1e-6, an untied head; 30.5B parameters, 3.3B
of them active per token.

Continued pretraining at 32768 tokens: Seq1F1B over 4 stages, 8 micro-batches of 8
segments, one sequence per micro-batch and replica (`mesh.data=-1` takes the devices the
stages leave). Start from the public weights with `--config.train.init_from=hf:DIR`.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=151936,
        num_layers=48,
        d_model=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        d_ff=6144,  # intermediate_size: a dense layer's, which this model has none of
        mlp="swiglu",
        num_experts=128,
        experts_per_token=8,
        expert_d_ff=768,
        router_renormalize=True,
        moe_aux_loss=0.001,  # router_aux_loss_coef
        norm_eps=1e-6,
        rope_base=1e6,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=8, segments=8, remat="full_layer")
    c.train.update(
        steps=1000,
        global_batch_size=8,
        seq_len=32768,
        learning_rate=1e-5,
        warmup_steps=50,
        weight_decay=0.1,
        log_every=10,
    )
    return c
