"""The paper's 7B (LLaMA-7B shape, GPT layers): 32 layers, d_model 4096, 32 heads, d_ff
16384, about 6.9B parameters, sequences of 32768 tokens.

Seq1F1B over 8 stages, 16 micro-batches of 4 segments each. The global batch of 64 is 16
micro-batches of one sequence per replica on 32 devices (4 x 8, the paper's count); with
fewer replicas each micro-batch holds more sequences. The optimizer state is split over
the replicas (train.shard_optimizer=auto). Fitting 32k tokens per micro-batch in 80 GB
also needs tensor parallelism (mesh.tensor, e.g. 1 x 4 x 8) and O(L)-memory attention
(README: the 7B and 30B shapes).
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.model.update(
        vocab_size=50304,
        num_layers=32,
        d_model=4096,
        num_heads=32,
        d_ff=16384,
        dtype="bfloat16",
        param_dtype="float32",
    )
    c.mesh.update(data=-1, stage=8)
    c.pipeline.update(schedule="seq1f1b", microbatches=16, segments=4, inflight="full")
    c.train.update(
        steps=20000,
        global_batch_size=64,
        seq_len=32768,
        learning_rate=1.2e-4,
        warmup_steps=2000,
        log_every=10,
        eval_every=1000,
    )
    return c
