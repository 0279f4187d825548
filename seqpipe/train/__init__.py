"""Training: the train state and the jitted step (`step`), the loop (`trainer`) with its
evaluation (`evaluation`), records (`report`) and stops (`stops`), checkpoints
(`checkpoint`), metrics (`metrics`), the optimizer (`optim`), and the step compiled ahead
of time for any target (`aot`). The top of the library: only the tools, the planner and
the commands import it.
"""
