"""Attention of one sequence segment against the keys and values before it: the contract,
the `xla` oracle and `attend`, which picks by `model.attention` (`attention`), and its
implementations (`blockwise`, `splash`, `pallas_gpu`), with what they read: the K/V cache's
storage (`kv_cache`), RoPE tables (`rope`) and the residual names `remat=dots` keeps
(`attention_residuals`). The model calls them; they import nothing of seqpipe.
"""
