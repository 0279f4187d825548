"""HuggingFace checkpoints: a `config.json` as seqpipe's `model.` keys and back (`config`,
pure Python, which `run.config` reads for `--config hf:DIR`), safetensors weights in and
out, each device reading its own slices (`weights`), and `python -m seqpipe.hf`
(`__main__`, a command, on the top level). Above `models`, below the run.
"""
