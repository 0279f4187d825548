"""A run's configuration: the schema, overrides and one-line validation (`config`), the
configuration resolved once for its devices or a `--topology` target (`run_config`),
with `auto` attention and remat chosen by compiling (`attention_auto`, `remat_auto`),
and the command-line plumbing every command shares (`cli`). Above the pipeline, which a
resolved run names; below the trainer.
"""
