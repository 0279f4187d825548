"""The XLA flags set on GPUs: only there, never over the user's own."""

from seqpipe.targets import xla_flags

LHS = "--xla_gpu_enable_latency_hiding_scheduler"


def test_added_on_gpu_kept_off_cpu():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_flags.apply(env, gpu=False) == [] and LHS not in env["XLA_FLAGS"]
    assert xla_flags.apply(env, gpu=True) == [f"{LHS}=true"]
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {LHS}=true"
    assert xla_flags.apply(env, gpu=True) == []  # idempotent: already named


def test_the_users_value_wins_and_can_switch_all_off():
    env = {"XLA_FLAGS": f"{LHS}=false"}
    assert xla_flags.apply(env, gpu=True) == [] and env["XLA_FLAGS"] == f"{LHS}=false"
    env = {"SEQPIPE_XLA_GPU_FLAGS": "0"}
    assert xla_flags.apply(env, gpu=True) == [] and "XLA_FLAGS" not in env
    env = {}
    assert xla_flags.apply(env, gpu=True) and env["XLA_FLAGS"] == f"{LHS}=true"


def test_backend_guess_from_jax_platforms():
    assert xla_flags.gpu_expected({"JAX_PLATFORMS": "cuda"})
    assert xla_flags.gpu_expected({"JAX_PLATFORMS": "cuda,cpu"})
    assert not xla_flags.gpu_expected({"JAX_PLATFORMS": "cpu"})
    assert not xla_flags.gpu_expected({"JAX_PLATFORMS": "tpu"})
