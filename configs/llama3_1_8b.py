"""Llama 3.1 8B's shape (meta-llama/Llama-3.1-8B config.json): 32 layers, d_model 4096,
32 query heads on 8 K/V heads of 128, SwiGLU d_ff 14336, vocabulary 128256, rope theta
500000 with llama3 scaling (factor 8 over an original 8192 tokens), RMS eps 1e-5, an
untied head; about 8.0B parameters.

Continued pretraining at 65536 tokens: Seq1F1B over 8 stages, 8 micro-batches of 8
segments, one sequence per micro-batch and replica (`mesh.data=-1` takes the devices the
stages leave). Start from the public weights with `--config.train.init_from=hf:DIR`.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=128256,
        num_layers=32,
        d_model=4096,
        num_heads=32,
        num_kv_heads=8,
        d_ff=14336,
        mlp="swiglu",
        norm_eps=1e-5,
        rope_base=500000.0,
        rope_scaling=dict(
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=8)
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
