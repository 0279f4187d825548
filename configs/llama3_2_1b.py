"""Llama 3.2 1B's shape (meta-llama/Llama-3.2-1B config.json): 16 layers, d_model 2048,
32 query heads on 8 K/V heads of 64, SwiGLU d_ff 8192, vocabulary 128256, rope theta
500000 with llama3 scaling (factor 32 over an original 8192 tokens), RMS eps 1e-5, the
head tied to the embedding; about 1.24B parameters.

Continued pretraining at 32768 tokens: Seq1F1B over 4 stages, 8 micro-batches of 4
segments. Start from the public weights with `--config.train.init_from=hf:DIR`.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=128256,
        num_layers=16,
        d_model=2048,
        num_heads=32,
        num_kv_heads=8,
        d_ff=8192,
        mlp="swiglu",
        tie_embeddings=True,
        norm_eps=1e-5,
        rope_base=500000.0,
        rope_scaling=dict(
            type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=8, segments=4)
    c.train.update(
        steps=1000,
        global_batch_size=8,
        seq_len=32768,
        learning_rate=3e-5,
        warmup_steps=50,
        weight_decay=0.1,
        log_every=10,
    )
    return c
