"""Checkpoints: exact resume, every/keep, a different mesh, incomplete and foreign checkpoints."""

import json
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from helpers import (
    PIPELINED,
    read_event_protos,
    run_of,
    run_train,
    tiny_config,
)
from jax.sharding import PartitionSpec as P

from seqpipe.data.loader import DataError
from seqpipe.parallel import layout, sharding
from seqpipe.run import config as config_lib
from seqpipe.run.config import ConfigError
from seqpipe.train import checkpoint, optim
from seqpipe.train import step as step_lib
from seqpipe.train import trainer as trainer_lib


def _steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in checkpoint.directory(workdir).iterdir() if p.name.isdigit())


@pytest.mark.oldest  # also on the oldest supported release
def test_resume_is_exact(tmp_path):
    """8 steps straight == 4 steps, a restart, then 4 more: bit for bit on CPU."""
    straight = trainer_lib.run(tiny_config(), str(tmp_path / "a"))
    first = trainer_lib.run(tiny_config(**{"train.stop_at": "4"}), str(tmp_path / "b"))
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert _steps(tmp_path / "b") == [4]
    # As if an earlier attempt had crashed after logging step 5 and half of step 6.
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.0}\n{"step": 6, "lo')
    second = trainer_lib.run(tiny_config(), str(tmp_path / "b"))
    assert [r["step"] for r in second] == [5, 6, 7, 8]
    expect = {r["step"]: r["loss"] for r in straight}
    assert [r["loss"] for r in second] == [expect[s] for s in (5, 6, 7, 8)]
    assert [r["loss"] for r in first] == [expect[s] for s in (1, 2, 3, 4)]
    # The data iterator resumed too: without it step 5 would see batch 1 again.
    assert second[0]["grad_norm"] == next(r for r in straight if r["step"] == 5)["grad_norm"]
    logged = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").open()]
    assert logged == list(range(1, 9))  # what followed the checkpoint was dropped
    # TensorBoard is told to drop events from step 5 on, too (a SessionLog START at 5).
    latest = sorted((tmp_path / "b").glob("events.out.tfevents.*"))[-1]
    assert any(e.session_log.status == 1 and e.step == 5 for e in read_event_protos(latest))
    # A finished run has nothing left to do.
    assert trainer_lib.run(tiny_config(), str(tmp_path / "b")) == []


def test_packed_rows_train_evaluate_and_resume_exactly(tmp_path):
    """The trainer on packed rows, pipelined: 8 steps straight == 4, a restart, 4 more, bit
    for bit (the iterator's place in the packed epoch is restored); the packed evaluation
    runs; and the rows were read packed (the losses differ from the unpacked run's)."""
    corpus = tmp_path / "docs.jsonl"  # short documents of real text: many per row
    lines = [x.strip() for x in Path(json.__file__).read_text().splitlines() if x.strip()]
    corpus.write_text("".join(json.dumps({"text": x}) + "\n" for x in lines * 20))
    packed = {
        **PIPELINED,
        "data.source": "jsonl",
        "data.path": str(corpus),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.packing": "best_fit",
        "train.eval_every": "4",
    }
    straight = trainer_lib.run(tiny_config(**packed), str(tmp_path / "a"))
    trainer_lib.run(tiny_config(**packed, **{"train.stop_at": "4"}), str(tmp_path / "b"))
    second = trainer_lib.run(tiny_config(**packed), str(tmp_path / "b"))
    expect = {r["step"]: r for r in straight}
    assert [r["step"] for r in second] == [5, 6, 7, 8]
    assert [r["loss"] for r in second] == [expect[s]["loss"] for s in (5, 6, 7, 8)]
    assert second[-1]["eval_loss"] == expect[8]["eval_loss"]
    unpacked = trainer_lib.run(
        tiny_config(**{**packed, "data.packing": "none"}), str(tmp_path / "c")
    )
    assert all(np.isfinite(r["loss"]) for r in straight)
    assert [r["loss"] for r in unpacked] != [r["loss"] for r in straight]


def test_every_keep_and_final(tmp_path):
    trainer_lib.run(
        tiny_config(**{"train.steps": "7", "checkpoint.every": "2", "checkpoint.keep": "2"}),
        str(tmp_path),
    )
    assert _steps(tmp_path) == [6, 7]  # 2, 4 dropped; 7 is the end, not a multiple of 2
    manager = checkpoint.make_manager(tmp_path, tiny_config())
    assert manager.latest_step() == 7
    manager.close()


def test_incomplete_checkpoint_is_skipped(tmp_path):
    """A save cut short (still under orbax's temporary name) is never restored."""
    trainer_lib.run(tiny_config(**{"train.stop_at": "3"}), str(tmp_path))
    ckpt = checkpoint.directory(tmp_path)
    (ckpt / "5.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
    records = trainer_lib.run(tiny_config(**{"train.stop_at": "4"}), str(tmp_path))
    assert [r["step"] for r in records] == [4]


def test_different_model_is_refused(tmp_path):
    trainer_lib.run(tiny_config(**{"train.stop_at": "1"}), str(tmp_path))
    with pytest.raises(ConfigError, match="different model.*model.d_model=32 saved, 64 now"):
        trainer_lib.run(tiny_config(**{"model.d_model": "64"}), str(tmp_path))
    with pytest.raises(ConfigError, match="batch order.*train.global_batch_size=8 saved, 16"):
        trainer_lib.run(tiny_config(**{"train.global_batch_size": "16"}), str(tmp_path))

    # From the command line: one line on stderr, exit 2, the workdir untouched.
    def snapshot():
        files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
        return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]

    before = snapshot()
    proc = run_train(tmp_path, **{"model.d_model": "64"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "different model" in proc.stderr
    assert snapshot() == before


def test_another_packing_is_another_batch_order(tmp_path):
    """The saved data position counts rows of one packing: under another it would point
    into other rows, so it is refused as another batch order is."""
    trainer_lib.run(tiny_config(**{"train.stop_at": "1"}), str(tmp_path))
    for packing, also in (("concat", "data.reset_positions=None saved, True now"), ("none", "")):
        config = config_lib.resolve(tiny_config(**{"data.packing": packing}), 8)
        tx = optim.make_optimizer(config.train)
        abstract = step_lib.abstract_state(run_of(config), sharding.mesh_of(config), tx)
        manager = checkpoint.make_manager(tmp_path, config)
        try:
            if packing == "none":  # what the run was trained with: restores
                assert checkpoint.restore_latest(manager, abstract, config)[0] == 1
                continue
            with pytest.raises(ConfigError, match="batch order") as e:
                checkpoint.restore_latest(manager, abstract, config)
            assert "data.packing='none' saved, 'concat' now" in str(e.value) and also in str(
                e.value
            )
        finally:
            manager.close()


def test_keys_that_hold_no_parameter_and_the_optimizer_may_change_on_resume_in_one_line(
    tmp_path, capfd
):
    """model.attention, model.loss_chunk (how the step computes) and the optimizer's
    settings go on changed; one line names each change."""
    trainer_lib.run(tiny_config(**{"train.stop_at": "1"}), str(tmp_path))
    capfd.readouterr()
    changed = {
        "model.attention": "blockwise",
        "model.loss_chunk": "32",
        "train.learning_rate": "0.001",
        "train.b1": "0.8",
        "train.weight_decay": "0.05",
    }
    records = trainer_lib.run(tiny_config(**changed, **{"train.stop_at": "2"}), str(tmp_path))
    assert [r["step"] for r in records] == [2]
    notes = [x for x in capfd.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(notes) == 1, notes
    for part in (
        "model.attention='auto' saved, 'blockwise' now",
        "model.loss_chunk=8192 saved, 32 now",
        "train.learning_rate=0.003 saved, 0.001 now",
        "train.b1=0.9 saved, 0.8 now",
        "train.weight_decay=0.1 saved, 0.05 now",
    ):
        assert part in notes[0], notes[0]
    # Unchanged since: no line.
    trainer_lib.run(tiny_config(**changed, **{"train.stop_at": "3"}), str(tmp_path))
    assert "note:" not in capfd.readouterr().err


def _restore(workdir, config, data, stage):
    mesh = sharding.make_mesh(data, stage)
    tx = optim.make_optimizer(config.train)
    manager = checkpoint.make_manager(workdir, config)
    step, state, data_state = checkpoint.restore_latest(
        manager, step_lib.abstract_state(run_of(config), mesh, tx), config
    )
    manager.close()
    return step, state, data_state, mesh


def test_another_tokenizer_is_refused(tmp_path):
    """Checkpoints resume only with the tokenizer they were trained with: the same ids under
    another tokenizer are other text. The refusal overwrites nothing; the saved
    tokenizer.json, as the message suggests, resumes."""
    byte_run = tmp_path / "byte"
    trainer_lib.run(tiny_config(**{"train.stop_at": "1"}), str(byte_run))
    bpe = {"data.tokenizer": "bpe", "model.vocab_size": "300", "data.cache_dir": str(tmp_path)}
    with pytest.raises(DataError, match="trained with no BPE .* data.tokenizer=bpe"):
        trainer_lib.run(tiny_config(**bpe), str(byte_run))
    assert not (byte_run / "tokenizer.json").exists()

    bpe_run = tmp_path / "bpe"
    trainer_lib.run(tiny_config(**bpe, **{"train.stop_at": "1"}), str(bpe_run))
    saved = bpe_run / "tokenizer.json"
    before = saved.read_bytes()
    with pytest.raises(DataError, match=f"trained with the BPE in {saved}, not the .*=byte"):
        trainer_lib.run(tiny_config(**{"model.vocab_size": "300"}), str(bpe_run))
    other = json.loads(before)
    other["model"]["merges"] = other["model"]["merges"][:-1]  # one merge fewer
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(DataError, match=f"data.tokenizer_path={saved}\\) or use a new"):
        trainer_lib.run(
            tiny_config(**bpe, **{"data.tokenizer_path": str(tmp_path / "other.json")}),
            str(bpe_run),
        )
    assert saved.read_bytes() == before and _steps(bpe_run) == [1]
    resumed = trainer_lib.run(
        tiny_config(**bpe, **{"data.tokenizer_path": str(saved), "train.stop_at": "2"}),
        str(bpe_run),
    )
    assert [r["step"] for r in resumed] == [2]


def test_restore_into_another_mesh(tmp_path):
    """Written on 8 x 1 (data parallel), restored on 2 x 4 with layers split over stages,
    and on 1 x 8; the values are the same and training goes on to the same losses."""
    dp = tiny_config(**{"train.stop_at": "3"})
    straight = trainer_lib.run(tiny_config(**{"train.stop_at": "4"}), str(tmp_path / "straight"))
    trainer_lib.run(dp, str(tmp_path / "run"))
    step, s8, data8, _ = _restore(tmp_path / "run", dp, 8, 1)
    pp = tiny_config(**PIPELINED)
    step24, s24, data24, mesh24 = _restore(tmp_path / "run", pp, 2, 4)
    assert step == step24 == 3 and data8 == data24
    chex.assert_trees_all_equal(s8, s24)
    wq = s24["params"]["layers"]
    leaf = jax.tree.leaves(wq)[0]
    assert leaf.sharding.spec == P(sharding.STAGE) and leaf.sharding.mesh.shape == {
        "data": 2,
        "stage": 4,
        "context": 1,
        "tensor": 1,
    }
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 4
    moments = [
        x
        for path, x in jax.tree_util.tree_leaves_with_path(s24["opt_state"])
        if "layers" in jax.tree_util.keystr(path)
    ]
    # Split over stages by layers, and over the two replicas (the sharded optimizer).
    assert moments and all(
        x.sharding.spec[0] == sharding.STAGE and sharding.DATA in x.sharding.spec[1:]
        for x in moments
    )
    # Step 4 on the pipelined 2 x 4 mesh from the 8 x 1 checkpoint: same loss as straight on.
    resumed = trainer_lib.run(
        tiny_config(**{**PIPELINED, "train.stop_at": "4"}), str(tmp_path / "run")
    )
    assert [r["step"] for r in resumed] == [4]
    np.testing.assert_allclose(resumed[0]["loss"], straight[-1]["loss"], rtol=1e-5)


def test_a_sharded_optimizer_resumes_on_another_mesh_and_unsharded(tmp_path):
    """Saved with the optimizer state split over 2 replicas (2 x 4), resumed split over 4
    (4 x 2) and then whole on every replica: the losses of a straight run."""
    on = {**PIPELINED, "train.shard_optimizer": "on"}
    straight = trainer_lib.run(tiny_config(**on, **{"train.stop_at": "4"}), str(tmp_path / "a"))
    run = str(tmp_path / "b")
    trainer_lib.run(tiny_config(**on, **{"train.stop_at": "2"}), run)
    four = {"mesh.data": "4", "mesh.stage": "2", "train.stop_at": "3"}
    resumed = trainer_lib.run(tiny_config(**{**on, **four}), run)
    off = {"train.shard_optimizer": "off", "train.stop_at": "4"}
    resumed += trainer_lib.run(tiny_config(**PIPELINED, **off), run)
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in straight[2:]], rtol=1e-6
    )


def test_checkpoint_dir_layout(tmp_path):
    trainer_lib.run(tiny_config(**{"train.stop_at": "2"}), str(tmp_path))
    step_dir = Path(checkpoint.directory(tmp_path)) / "2"
    assert {"state", "data", "meta"} <= {p.name for p in step_dir.iterdir()}


# Interleaved Seq1F1B on 2 x 4 with two chunks per stage: the train state's layers are in
# stage order (`seqpipe.parallel.layout`), not the canonical order checkpoints keep.
INTERLEAVED = {
    **PIPELINED,
    "pipeline.schedule": "seq1f1b_interleaved",
    "pipeline.virtual_stages": "2",
    "pipeline.microbatches": "4",
    "model.num_layers": "8",
}


def test_checkpoints_are_canonical_whatever_the_layout(tmp_path):
    """A V = 2 run's state (stage order) is saved canonically: restored on 8 x 1 and with
    V = 1 it is the canonical state, with V = 2 the state as it was. Training on from
    V = 2 to V = 1 and back to V = 2 gives the losses (and held-out loss) of V = 2."""
    layers8 = {"model.num_layers": "8", "train.eval_every": "1"}

    def v2(stop):
        return tiny_config(**{**INTERLEAVED, **layers8, "train.stop_at": stop})

    def v1(stop):
        return tiny_config(**{**PIPELINED, **layers8, "train.stop_at": stop})

    straight = trainer_lib.run(v2("4"), str(tmp_path / "straight"))
    run = str(tmp_path / "run")
    trainer = trainer_lib.Trainer(run_of(v2("2")), run)
    try:
        assert [r["step"] for r in trainer.train()] == [1, 2]
    finally:
        trainer.close()
    live = trainer.state
    canonical = layout.to_canonical(live, layout.Placement.even(8, 4, 2))
    wq = [np.asarray(s["params"]["layers"]["wq"]) for s in (live, canonical)]
    assert not np.array_equal(*wq)  # V = 2 really holds another order
    chex.assert_trees_all_equal(_restore(run, tiny_config(**layers8), 8, 1)[1], canonical)
    chex.assert_trees_all_equal(_restore(run, v1("2"), 2, 4)[1], canonical)
    chex.assert_trees_all_equal(_restore(run, v2("2"), 2, 4)[1], live)
    resumed = trainer_lib.run(v1("3"), run) + trainer_lib.run(v2("4"), run)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "eval_loss"):
        np.testing.assert_allclose(
            [r[key] for r in resumed], [r[key] for r in straight[2:]], rtol=1e-5
        )


def test_an_uneven_split_saves_canonically_and_resumes_under_any_split(tmp_path):
    """Six layers as 2, 2, 1, 1 on four stages: the state holds 4 x 2 layers (two of them
    zero padding, with zero gradients and moments), a checkpoint the six canonical ones
    (six do not split over four stages: whole on every device). Restored without a
    pipeline it is the canonical state; training on with the flops split and then evenly
    on two stages gives the losses of the uneven run straight on."""
    six = {**PIPELINED, "model.num_layers": "6", "train.eval_every": "1"}

    def uneven(stop, split="2,2,1,1", **more):
        return tiny_config(**{**six, "pipeline.layers_per_stage": split, "train.stop_at": stop})

    straight = trainer_lib.run(uneven("4"), str(tmp_path / "straight"))
    run = str(tmp_path / "run")
    trainer = trainer_lib.Trainer(run_of(uneven("2")), run)
    try:
        assert [r["step"] for r in trainer.train()] == [1, 2]
    finally:
        trainer.close()
    live = trainer.state
    placement = layout.Placement(4, 1, (2, 2, 1, 1))
    padding = placement.positions() < 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(live):
        if "layers" in jax.tree_util.keystr(path):
            assert leaf.shape[0] == 8 and not np.asarray(leaf)[padding].any()
    canonical = layout.to_canonical(live, placement)
    restored = _restore(run, tiny_config(**{"model.num_layers": "6"}), 8, 1)[1]
    chex.assert_trees_all_equal(restored, canonical)
    flops = {**six, "pipeline.layers_per_stage": "flops", "train.stop_at": "3"}
    even = {**six, "mesh.data": "4", "mesh.stage": "2", "train.stop_at": "4"}
    resumed = trainer_lib.run(tiny_config(**flops), run) + trainer_lib.run(tiny_config(**even), run)
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "eval_loss"):
        np.testing.assert_allclose(
            [r[key] for r in resumed], [r[key] for r in straight[2:]], rtol=1e-5
        )


def test_a_restored_uneven_split_holds_its_layers_once_and_warns_nothing(tmp_path):
    """Six layers as 2, 2, 1, 1: the checkpoint's six canonical layers become the state's
    4 x 2 in stage order. XLA cannot donate a stack to one of another shape: the old
    buffers stayed alive while the restore lasted, with jax's three-line warning on the
    console. Each is now deleted as soon as its copy is made."""
    import gc
    import warnings

    six = {**PIPELINED, "model.num_layers": "6", "pipeline.layers_per_stage": "2,2,1,1"}
    trainer_lib.run(tiny_config(**six, **{"train.stop_at": "1"}), str(tmp_path))
    config = config_lib.resolve(tiny_config(**six), 8)
    mesh, tx = sharding.mesh_of(config), optim.make_optimizer(config.train)
    manager = checkpoint.make_manager(tmp_path, config)
    gc.collect()
    before = sum(x.nbytes for x in jax.live_arrays())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state, _ = checkpoint.restore_latest(
            manager, step_lib.abstract_state(run_of(config), mesh, tx), config
        )
    manager.close()
    assert step == 1
    assert not [w for w in caught if "donated" in str(w.message)], caught
    gc.collect()
    assert sum(x.nbytes for x in jax.live_arrays()) - before == sum(
        x.nbytes for x in jax.tree.leaves(state)
    )
    # The move itself: the canonical leaves given up are gone, the rest kept.
    placement = layout.of_config(config)
    canonical = layout.on_arrays(layout.to_canonical, state, placement)
    flat = jax.tree_util.tree_leaves_with_path(canonical)
    moved = layout.on_arrays(layout.to_stage_order, canonical, placement, donate=True)
    for path, leaf in flat:
        assert leaf.is_deleted() == sharding.in_layers(path), jax.tree_util.keystr(path)
    chex.assert_trees_all_equal(moved, state)
