"""seqpipe: a JAX/XLA trainer for GPT-style models with Seq1F1B pipeline parallelism.

Shape letters used in names throughout: B batch, L sequence, D model width, H heads,
E head dim, F ffn width, V vocab, S stages, K segments, M micro-batches, N layers.
"""
