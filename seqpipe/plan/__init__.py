"""The planner: the fastest pipelined setting of a model that fits a slice, found on this
machine before renting it (`python -m seqpipe.plan`).

`space` enumerates candidates, `memory` and `timing` price them without compiling,
`search` applies them to the config, `rank` orders them and says why the others lost,
`bounds` says how far the memory estimate is trusted, `confirm` compiles the best few for
the target (with the trainer's `compile_config`, passed in), `render` prints, `plan` runs
the steps and `__main__` parses the command line and sets the slice's environment before
jax loads. docs/planner.md says what each figure rests on. On top of the picture, beside
`tools`: the trainer never imports it.
"""
