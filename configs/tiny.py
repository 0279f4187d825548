"""The CPU demo: Seq1F1B on a 2 x 4 mesh of fake CPU devices, a 4-layer model, real text
(the Python standard library's own sources, tokenized with a BPE trained on them)."""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=2048, num_layers=4, d_model=128, num_heads=4, d_ff=512)
    c.mesh.update(data=2, stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=4, segments=4, inflight="full")
    c.train.update(
        steps=200,
        global_batch_size=16,
        seq_len=128,
        learning_rate=3e-3,
        warmup_steps=20,
        log_every=20,
        eval_every=100,
    )
    return c
