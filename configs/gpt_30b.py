"""The paper's 30B: 64 layers, d_model 6144, 64 heads, d_ff 24576, about 29.6B parameters,
sequences of 65536 tokens.

Seq1F1B over 8 stages, 16 micro-batches of one sequence, 4 segments each, every stage
split 8 ways by tensor parallelism: the paper's headline run on 64 devices (README: the
7B and 30B shapes). With more than one data replica set
train.global_batch_size=16 * mesh.data.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50304,
        num_layers=64,
        d_model=6144,
        num_heads=64,
        d_ff=24576,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=8, tensor=8)
    c.pipeline.update(schedule="seq1f1b", microbatches=16, segments=4, inflight="full")
    c.train.update(
        steps=20000,
        global_batch_size=16,
        seq_len=65536,
        learning_rate=1e-4,
        warmup_steps=2000,
        log_every=10,
        eval_every=1000,
    )
    return c
