"""Train a GPT with seqpipe: python train.py --config configs/tiny.py --workdir runs/demo.

--compile_only                 compile the step, print memory and FLOPs as JSON, exit
--compile_only --topology v5p-16    the same for a Cloud TPU slice, from any machine
--compile_only --topology h200-8     the same for NVIDIA GPUs (8 H200s), from any machine
--coordinator HOST:PORT --num_processes N --process_id I    one process of N

The command is `seqpipe.train.__main__`; an installed package runs it as
`python -m seqpipe.train` or `seqpipe-train`.
"""

import sys

from seqpipe.train.__main__ import _mesh_text, entry, main, summary  # noqa: F401

if __name__ == "__main__":
    sys.exit(entry("train.py"))
