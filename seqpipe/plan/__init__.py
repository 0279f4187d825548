"""The planner: the fastest pipelined setting of a model that fits a slice, found on this
machine before renting it (`python -m seqpipe.plan`).

`space` enumerates candidates, `memory` and `timing` price them without compiling,
`search` applies them to the config, `rank` orders them and says why the others lost,
`confirm` compiles the best few for the target, `render` prints, `plan` runs the steps
and `cli` parses the command line. docs/planner.md says what each figure rests on.
"""
