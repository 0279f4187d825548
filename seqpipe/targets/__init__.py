"""What a step is compiled for, below everything that builds one: Cloud TPU slices and
NVIDIA GPU systems as compile-only devices (`topology`, `gpu_topology`), the trainer's
XLA flags on GPUs (`xla_flags`), reading compiled HLO (`hlo`), and where the supported
JAX releases differ (`compat`). Nothing here knows about the model or the pipeline.
"""
