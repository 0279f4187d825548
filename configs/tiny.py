"""The CPU demo: a 4-layer model on the Python standard library's sources, 8 fake devices."""

from seqpipe.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=2048, num_layers=4, d_model=128, num_heads=4, d_ff=512)
    c.mesh.update(data=8, stage=1)
    c.train.update(
        steps=200, global_batch_size=16, seq_len=128, learning_rate=3e-3, warmup_steps=20,
        log_every=20, eval_every=100,
    )
    return c
