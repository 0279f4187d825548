"""Fit `seqpipe.tools.step_cost`'s roofline (a matmul rate, a memory rate, a fixed cost
per kernel) to steps measured on a GPU, from their compiled HLO (docs/performance.md).

    XLA_FLAGS=--xla_dump_to=/tmp/cal/ref python scripts/gpu_compile_calibration.py \\
        OLD_CHECKOUT --config.train.global_batch_size=32 --config.train.seq_len=2048
    python scripts/gpu_roofline_fit.py ref:/tmp/cal/ref:1:1:2.14 f1b:/tmp/cal/f1b:8:1:2.60 ...

Each argument is NAME:DUMP_DIR:MICROBATCHES:SEGMENTS:MEASURED_SECONDS. Prints, for each
fixed cost per kernel, the rates that minimise the worst relative error, then each step's
estimate with the best fit.
"""

import glob
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from seqpipe.tools import step_cost  # noqa: E402

PER_KERNEL_US = (0, 1, 2, 4, 6, 8)


def fit(costs, measured, per_kernel):
    """(worst relative error, matmul rate, memory rate) on a grid, for one fixed cost."""
    best = None
    for flops in np.arange(300e12, 1000e12, 25e12):
        for nbytes in np.arange(2.0e12, 6.01e12, 0.1e12):
            estimates = [c.seconds(flops, nbytes, per_kernel) for c in costs]
            worst = max(abs(e / t - 1) for e, t in zip(estimates, measured, strict=True))
            if best is None or worst < best[0]:
                best = (worst, flops, nbytes)
    return best


def main(args: list[str]) -> None:
    names, costs, measured = [], [], []
    for arg in args:
        name, path, m, k, seconds = arg.rsplit(":", 4)
        (dump,) = glob.glob(f"{path}/*jit_train_step*after_optimizations.txt")
        text = open(dump).read()
        names.append(name)
        costs.append(step_cost.step_cost(text, int(m), int(k)))
        measured.append(float(seconds))
    fits = {us: fit(costs, measured, us * 1e-6) for us in PER_KERNEL_US}
    for us, (worst, flops, nbytes) in fits.items():
        rates = f"{flops / 1e12:.0f} TFLOP/s, {nbytes / 1e12:.1f} TB/s"
        print(f"{us} us a kernel: {rates}, worst {worst:.1%}")
    us = min(fits, key=lambda u: fits[u][0])
    _, flops, nbytes = fits[us]
    print("\n| step | kernels | TB moved | matmul TFLOP | measured s | estimate s | error |")
    print("|---|---|---|---|---|---|---|")
    for name, c, t in zip(names, costs, measured, strict=True):
        s = c.seconds(flops, nbytes, us * 1e-6)
        print(
            f"| {name} | {c.total('kernels'):,.0f} | {c.total('bytes') / 1e12:.2f} | "
            f"{c.total('flops') / 1e12:.0f} | {t:.2f} | {s:.2f} | {s / t - 1:+.1%} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
