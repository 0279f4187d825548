"""GPT-3 XL shape, about 1.3B parameters: 24 layers, d_model 2048, 16 heads, seq 2048."""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50304,
        num_layers=24,
        d_model=2048,
        num_heads=16,
        d_ff=8192,
        dtype="bfloat16",
        param_dtype="float32",
    )
    # Data parallel over every device there is: one GPU, eight, or a TPU slice (on CPU,
    # train.py makes one fake device). Pipelining: --config.mesh.stage=8 and a schedule.
    c.mesh.update(data=-1, stage=1)
    c.train.update(
        steps=20000,
        global_batch_size=32,
        seq_len=2048,
        learning_rate=2e-4,
        warmup_steps=1000,
        log_every=10,
        eval_every=1000,
    )
    return c
