"""Every test runs on CPU with 8 fake XLA devices, set before jax is imported; `--shard i/N`
keeps the i-th of N deterministic shards of the selected tests (`make test-shard`)."""

import os

# XLA:CPU's code generation at -O0: the tests' steps are tiny, so compiling them is most
# of their time (a pipelined oracle case: 3.9 s of compile at the default level, 2.9 s at
# 0, on this 2-core machine, 2026-12-08). Subprocesses inherit it (`helpers.subprocess_env`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import subprocess  # noqa: E402
import zlib  # noqa: E402

import helpers  # noqa: E402
import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only shard I of N (0 <= I < N): the tests whose id hashes to I",
    )


def shard_of(nodeid: str, count: int) -> int:
    """A test's shard: the same on every machine, run and worker (CRC-32 of its id)."""
    return zlib.crc32(nodeid.encode()) % count


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--shard {shard!r}: give I/N with 0 <= I < N, e.g. 3/8")
    mine = [shard_of(item.nodeid, int(count)) == int(index) for item in items]
    config.hook.pytest_deselected(items=[i for i, m in zip(items, mine, strict=True) if not m])
    items[:] = [i for i, m in zip(items, mine, strict=True) if m]


@pytest.fixture(autouse=True)
def _executables_released_between_tests():
    yield
    helpers.release_executables_if_crowded()


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a real file system that fills up (mounting needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)
