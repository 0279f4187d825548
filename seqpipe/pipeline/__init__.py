"""The pipeline executor: everything static about a step (`spec`), one unit of work, a
segment through a chunk (`units`), the ways a unit keeps what its backward needs
(`remat`, the table of policies; `remat_strategies`, their classes), the scan carry
(`carry`), and the executor that runs any schedule table inside `shard_map` (`executor`).
Above `models` and `schedule`; the trainer and the tools call `executor`.
"""
