"""Where the supported JAX releases differ (0.10.2, the oldest, on Python 3.11; 0.12 on
3.12+): each difference once, here, so that no other module asks which release it runs on."""

import jax


def gpu_target(device_kind: str = "NVIDIA H200"):
    """A context in which Pallas GPU (Triton) kernels trace and lower for `device_kind` on
    a machine without that GPU (`.trace(...)` and `.lower(lowering_platforms=("cuda",))`
    both inside it: the trace keeps the mesh the lowering asks).

    jax 0.12 asks the mesh in context which GPU a Triton kernel is for and refuses ("No
    supported GPU devices found") when it is no GPU; 0.10.2 took compute capability 9.0
    (H100/H200) without asking, and ignores the mesh. One abstract single-device mesh
    holding the GPU's kind serves both."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def scan_carry(eqn) -> list:
    """The carry operands of a `scan` equation in a jaxpr: jax 0.12 describes a scan's
    operands with a flat tree `ft_in` (consts, carry, xs), 0.10.2 with counts."""
    if "ft_in" in eqn.params:
        _, carry, _ = eqn.params["ft_in"].update(eqn.invars).unpack()
        return list(carry)
    start = eqn.params["num_consts"]
    return list(eqn.invars[start : start + eqn.params["num_carry"]])
