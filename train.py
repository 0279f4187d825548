"""Train a GPT with seqpipe: python train.py --config configs/tiny.py --workdir runs/demo.

--compile_only                 compile the step, print memory and FLOPs as JSON, exit
--coordinator HOST:PORT --num_processes N --process_id I    one process of N
"""

import json
import sys

from seqpipe import cli


def main(argv: list[str]) -> int:
    config, args = cli.load_or_exit(argv, "train.py", cli.train_flags)
    cli.init_distributed(args)  # imports jax: only after the device count is set
    from seqpipe import train

    if args.compile_only:
        result = cli.run_or_exit(lambda: train.compile_only(config))
        mem = result["memory_per_device_bytes"]
        print(
            f"per device: arguments {mem['arguments'] / 2**30:.2f} GiB, outputs "
            f"{mem['outputs'] / 2**30:.2f} GiB (aliased {mem['aliased'] / 2**30:.2f}), "
            f"temporaries {mem['temporaries'] / 2**30:.2f} GiB; "
            f"{result['flops_per_step']:.3e} model FLOPs per step"
        )
        print(json.dumps(result))
        return 0
    try:
        cli.run_or_exit(lambda: train.run(config, args.workdir))
    except train.TrainingError as e:
        # Every file is closed by now; what orbax's threads print on the way out would bury
        # the one line that says what to do.
        cli.fail(str(e), code=1, at_once=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
