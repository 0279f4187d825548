"""Every test runs on CPU with 8 fake XLA devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


import multiprocessing  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402

import helpers  # noqa: E402
import pytest  # noqa: E402

from seqpipe.models import noise  # noqa: E402


@pytest.fixture(autouse=True)
def _executables_released_between_tests():
    yield
    helpers.release_executables_if_crowded()


@pytest.fixture(autouse=True, scope="session")
def _float64_in_a_process_of_its_own():
    """`noise.float64_reference` runs in a helper process, one per test worker: switching
    jax to 64-bit inside a process that also compiles through the persistent compilation
    cache crashed XLA's executable serialization (2 of 2 full runs, 2026-12-06)."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    original = noise.float64_reference

    def remote(params, batch, cfg):
        args = jax.device_get(params), jax.device_get(batch), cfg
        return pool.submit(helpers.float64_reference, *args).result()

    noise.float64_reference = remote
    try:
        yield
    finally:
        noise.float64_reference = original
        pool.shutdown()
