"""How the mesh cuts the model: its axes and every leaf's sharding (`sharding`), tensor
parallelism's collectives and which dimension of each parameter it splits (`tensor`),
and where the layers live across stages (`layout`). Below the model, which calls the
collectives; above `schedule`, whose layer split `layout` places.
"""
