"""`python -m seqpipe.bench`: the pipeline benchmark on fake CPU devices (`tools.bench`), or
with `--accelerator` the train step on the device JAX sees (`tools.accel`)."""

import sys

from seqpipe.tools import accel, bench


def main(argv: list[str]) -> int:
    if "--accelerator" in argv:
        return accel.main(argv)
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
