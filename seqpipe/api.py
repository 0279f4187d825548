"""seqpipe's public API: what a script imports (`from seqpipe import api`). Every other
module is internal and may change without notice; these names keep their meaning.

A config (`load_config`, then its keys set like any `ml_collections.ConfigDict`) is
resolved once for its devices (`resolve`), then compiled without allocating anything
(`compile_only`) or trained (`run`); `verify` checks its pipeline against the
un-pipelined model, and `plan` finds the fastest setting that fits a target. The model is
pure functions of a params pytree (`init_params`, `forward`, `loss`), and HuggingFace
checkpoints come in and go out with `load_hf` and `save_hf`.
"""

from seqpipe.hf.weights import load as load_hf
from seqpipe.hf.weights import save as save_hf
from seqpipe.models.model import GPTConfig, forward, init_params, loss
from seqpipe.plan.__main__ import main as plan
from seqpipe.run.config import base_config
from seqpipe.run.config import load as load_config
from seqpipe.tools.verify import verify
from seqpipe.train.aot import compile_only, resolve
from seqpipe.train.trainer import run

__all__ = [
    "GPTConfig",
    "base_config",
    "compile_only",
    "forward",
    "init_params",
    "load_config",
    "load_hf",
    "loss",
    "plan",
    "resolve",
    "run",
    "save_hf",
    "verify",
]
