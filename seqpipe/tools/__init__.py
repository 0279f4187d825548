"""Analysis tools: FLOPs, memory, benchmarks, predictions, the oracle check, the device
plan's report. On top of the picture: they import the trainer's parts, and the trainer
never imports them; `plan` imports `step_cost` from here."""
