"""Compile gpt_1b's step, as an older commit of seqpipe builds it, for one H200 without a
GPU, to compare with what that commit measured on the device (docs/performance.md).

    git worktree add --detach /tmp/old 0952314
    python scripts/gpu_compile_calibration.py /tmp/old --config.train.seq_len=8192 ...

Commits before --topology h200 existed take jax.devices() for their mesh: it is pointed at
the compile-only H200 of this checkout's `seqpipe.targets.gpu_topology`.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def main(old_root: str, overrides: list[str]) -> None:
    sys.path.insert(0, str(HERE))
    from seqpipe.targets import gpu_topology

    h200 = gpu_topology.parse("h200")
    h200.prepare_env()
    devices = h200.devices()
    import jax

    jax.devices = jax.local_devices = lambda *a, **k: devices
    jax.device_count = lambda *a, **k: len(devices)
    for name in [m for m in sys.modules if m == "seqpipe" or m.startswith("seqpipe.")]:
        del sys.modules[name]  # the old commit's seqpipe from here on
    sys.path[0] = old_root
    from seqpipe.run import cli
    from seqpipe.train import aot

    argv = ["--config", f"{old_root}/configs/gpt_1b.py", "--config.mesh.data=1"]
    config, _ = cli.load_or_exit(argv + ["--config.mesh.stage=1", *overrides], "x", cli.train_flags)
    memory = aot.compile_only(config)["memory_per_device_bytes"]
    gib = {k: round(v / 2**30, 2) for k, v in memory.items()}
    print(f"temporaries {gib['temporaries']} GiB, total {gib['total']} GiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
