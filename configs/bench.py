"""`make bench`: one model and global batch for every schedule, on 4 fake CPU devices.

Long enough sequences that activations and KV caches dominate a stage's memory, small
enough that compiling and running every schedule fits in minutes on two CPU cores.
"""

from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    # xla attention: XLA's FLOP counts of a unit are exact for it (a blockwise loop's body
    # is counted once, and its backward recomputes the scores), so the executed/analytic
    # ratios compare schedules, and runs across commits.
    c.model.update(
        vocab_size=2048, num_layers=8, d_model=128, num_heads=4, d_ff=512, attention="xla"
    )
    c.mesh.update(data=1, stage=4)
    # remat none, the paper's setting: no recomputation (the other policies: a table of
    # their own in the benchmark's report).
    c.pipeline.update(schedule="seq1f1b", microbatches=8, segments=4, inflight="full", remat="none")
    c.train.update(global_batch_size=8, seq_len=512)
    return c
