"""One of two processes restoring the newest checkpoint of a workdir, where process 1 alone
cannot read checkpoint 2 (a file its host cannot read): run by tests/test_multihost.py.

usage: python tests/two_process_restore.py WORKDIR PORT PROCESS_ID
"""

import sys

import jax

from seqpipe.parallel import sharding
from seqpipe.run import config as config_lib
from seqpipe.run import run_config
from seqpipe.train import checkpoint, optim
from seqpipe.train import step as step_lib


def main(workdir: str, port: str, process_id: int) -> None:
    from helpers import ONE_BY_EIGHT, tiny_config

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    config = config_lib.resolve(tiny_config(**ONE_BY_EIGHT), jax.device_count())
    read = checkpoint._read_step

    def read_on_this_host(manager, step, *args):
        if jax.process_index() == 1 and step == 2:
            raise OSError(5, "Input/output error")
        return read(manager, step, *args)

    checkpoint._read_step = read_on_this_host
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    run = run_config.resolve(config, jax.devices())
    abstract = step_lib.abstract_state(run, mesh, optim.make_optimizer(config.train))
    manager = checkpoint.make_manager(workdir, config)
    step, _, _ = checkpoint.restore_latest(manager, abstract, config)
    manager.close()
    print(f"restored step {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
