"""GPT-3 Small shape (about 125M parameters with a 50k vocabulary)."""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50304,
        num_layers=12,
        d_model=768,
        num_heads=12,
        d_ff=3072,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=1, stage=1)
    c.train.update(
        steps=10000,
        global_batch_size=64,
        seq_len=2048,
        learning_rate=6e-4,
        warmup_steps=500,
        log_every=10,
        eval_every=500,
    )
    return c
