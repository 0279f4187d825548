"""Qwen 2.5 7B's shape (Qwen/Qwen2.5-7B config.json): 28 layers, d_model 3584, 28 query
heads on 4 K/V heads of 128 with Q/K/V biases, SwiGLU d_ff 18944, vocabulary 152064, rope
theta 1e6 without scaling, RMS eps 1e-6, an untied head; about 7.6B parameters.

Continued pretraining at 65536 tokens: Seq1F1B over 4 stages (7 layers each), 8
micro-batches of 8 segments. Start from the public weights with
`--config.train.init_from=hf:DIR`.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=152064,
        num_layers=28,
        d_model=3584,
        num_heads=28,
        num_kv_heads=4,
        d_ff=18944,
        mlp="swiglu",
        qkv_bias=True,
        norm_eps=1e-6,
        rope_base=1000000.0,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=8, segments=8)
    c.train.update(
        steps=1000,
        global_batch_size=8,
        seq_len=65536,
        learning_rate=2e-5,
        warmup_steps=50,
        weight_decay=0.1,
        log_every=10,
    )
    return c
