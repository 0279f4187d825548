"""Mixtral 8x7B's shape (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, d_model
4096, 32 query heads on 8 K/V heads of 128, a mixture of 8 SwiGLU experts of width 14336 in
every layer, 2 per token (their weights renormalized), vocabulary 32000, rope theta 1e6,
RMS eps 1e-5, an untied head; 46.7B parameters, 12.9B of them active per token.

Continued pretraining at 32768 tokens: Seq1F1B over 8 stages, 8 micro-batches of 8
segments, one sequence per micro-batch and replica (`mesh.data=-1` takes the devices the
stages leave). Start from the public weights with `--config.train.init_from=hf:DIR`.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=32000,
        num_layers=32,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        d_ff=14336,
        mlp="swiglu",
        num_experts=8,
        experts_per_token=2,
        router_renormalize=True,
        moe_aux_loss=0.02,  # router_aux_loss_coef
        norm_eps=1e-5,
        rope_base=1e6,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=8)
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
