"""Every test runs on CPU with 8 fake XLA devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop each module's compiled programs after it. Every live executable keeps its code
    mapped, and a worker holding all it compiled in a whole run came near the kernel's
    65530 mappings (vm.max_map_count; 28k at 93% of a run): XLA aborts the process when a
    mapping fails."""
    yield
    from seqpipe.tools import flops

    flops.release()  # its own cache of compiled units, jax's caches, a collection
