"""The process and its files, below everything that computes: the workdir checked and
locked by one run (`workdir`), files written whole (`files`), where checkpoints live
(`checkpoint_dir`), third-party logs (`logs`), signals at start-up (`signals`), a lost
process of a multi-process run (`peers`) and the C++ runtime's output (`runtime_log`).

None of it imports jax at module level or anything of seqpipe above `errors`.
"""
