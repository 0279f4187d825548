"""The model as pure functions of a params pytree (`model`: GPT and the Llama family), its
un-pipelined loss and gradients, the oracle every schedule must match (`reference`), and
packed rows' masks and positions (`document_mask`). Built on `kernels` and `parallel`;
the pipeline, the trainer and `hf` call it.
"""
