"""Pipeline schedules as data: generate, validate, lower to slot tables, measure, draw.

`tables` generates and validates, `lowering` turns a table into slot indices and
`statistics` measures it: this package's names. `render` draws a table (text, JSON, PNG)
and `cli` is `python -m seqpipe.schedule`; both are imported by name
(`seqpipe.schedule.render`), as nothing that runs a schedule needs them. `partition` cuts
the work the tables order: segments along the sequence, layers across stages. Below
`parallel` and the pipeline, above `host` only (the command writes files whole).

A schedule is a static table: for every synchronous tick and every stage, a cell of at
most one operation of each kind: F (forward), B (backward) and W (the weight-gradient
half of a split backward: `zb_h1`, `seq_zb_h1`). An operation acts on a unit
(micro-batch, segment, local chunk); the local chunk c of stage r holds global layer
chunk g = c*S + r. Within a tick a stage runs its F, then its B, then its W; then
results move one hop (forward outputs to stage (r+1) % S, input cotangents to stage
(r-1) % S) and can be used from the next tick.

Letters: S stages, M micro-batches, K segments per micro-batch, V chunks per stage.
Pure Python/NumPy; nothing here knows about the model.
"""

from seqpipe.schedule.lowering import (  # noqa: F401 (the package's API)
    Program,
    lower,
)
from seqpipe.schedule.statistics import (  # noqa: F401 (the package's API)
    kind_costs,
    op_costs,
    stats,
)
from seqpipe.schedule.tables import (  # noqa: F401 (the package's API)
    DEPTHS,
    GENERATORS,
    INTERLEAVED,
    KINDS,
    NAMES,
    SCHEDULES,
    B,
    Cell,
    F,
    Generator,
    Kind,
    Op,
    Schedule,
    ScheduleError,
    Unit,
    W,
    build,
    cell_unit,
    forward_only,
    generator,
    has_weight_ops,
    make_cell,
    validate,
)
