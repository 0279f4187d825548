"""scripts/device_accel.sh run here with its commands recorded instead of run: a device
session (15 minutes, start-up included; 10 minutes a command) must not find a bad flag or
a part that outlasts its call."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from seqpipe.tools import accel, attention_check

REPO = Path(__file__).resolve().parent.parent
PER_CALL_S = 600  # the `run` tool's limit on one command
DEVICE_S = 900  # a session's device time, all calls and the machine's start together
START_S = 90  # what a start leaves out of that (the machine comes up in minutes at worst)
SETUP_S = 20  # a part's pip install of the carried wheels and nvidia-smi


def recorded(part: str, tmp_path: Path) -> list[list[str]]:
    """Each command the part runs, as [timeout limit or "", program, args...]."""
    bin_dir, log = tmp_path / f"bin-{part}", tmp_path / f"{part}.jsonl"
    bin_dir.mkdir()
    stubs = {
        # `timeout N cmd...` records N and runs cmd (a stub below).
        "timeout": '#!/bin/sh\nn=$1; shift; TIMEOUT=$n exec "$@"\n',
        "python3": (
            f"#!{sys.executable}\nimport json, os, sys\n"
            f"with open({str(log)!r}, 'a') as f:\n"
            "    f.write(json.dumps([os.environ.get('TIMEOUT', '')] + sys.argv[1:]) + '\\n')\n"
        ),
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    (wheels / "grain-0-py3-none-any.whl").touch()
    subprocess.run(
        ["bash", "scripts/device_accel.sh", part],
        cwd=REPO,
        env=_env(bin_dir, tmp_path, WHEELS=str(wheels)),
        check=True,
        capture_output=True,
        timeout=60,
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def _env(bin_dir: Path, tmp_path: Path, **extra) -> dict:
    path = f"{bin_dir}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), **extra}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device")
    return {part: recorded(part, tmp) for part in ("bench", "long", "extras")}


def test_every_command_parses_and_writes_its_own_json(parts):
    jsons = []
    for part, commands in parts.items():
        measured = [c for c in commands if c[1:3] != ["-m", "pip"]]
        assert measured, part
        for limit, *argv in measured:
            assert limit.isdigit(), (part, argv)  # every measurement is cut by a timeout
            assert argv[:1] == ["-m"], argv
            module, args = argv[1], argv[2:]
            if module == "seqpipe.bench":
                assert "--accelerator" in args
                config, flags, names, predicting = accel.parse(args)  # exits on bad input
                assert names or predicting, args
                jsons.append(flags.json)
            else:
                assert module == "seqpipe.tools.attention_check", argv
                jsons.append(attention_check.arguments(args).json)
    assert len(set(jsons)) == len(jsons), jsons  # no part overwrites another's results


def test_the_long_context_rows_are_those_issue_13_asks_for(parts):
    by_json = {}
    for _, *argv in parts["long"]:
        if argv[1] == "seqpipe.bench":
            config, flags, names, _ = accel.parse(argv[2:])
            by_json[Path(flags.json).name] = (config, flags, names)
    config, flags, names = by_json["accel_32k.json"]
    t = config.train
    assert (t.seq_len, t.global_batch_size, flags.microbatches) == (32768, 2, 2)
    assert names == ["seq1f1b:8@none"] and config.model.attention == "pallas_gpu"
    fused, plain = by_json["accel_8k_pallas.json"], by_json["accel_8k_xla.json"]
    for (c, _, n), attention in ((fused, "pallas_gpu"), (plain, "xla")):
        assert (c.train.seq_len, c.train.global_batch_size, n) == (8192, 8, ["ref"])
        assert c.model.attention == attention


def test_each_part_fits_its_call_and_the_first_two_the_session(parts):
    seconds = {
        part: SETUP_S + sum(int(c[0]) for c in commands if c[0]) for part, commands in parts.items()
    }
    assert all(s <= PER_CALL_S for s in seconds.values()), seconds
    assert START_S + seconds["bench"] + seconds["long"] <= DEVICE_S, seconds


@pytest.mark.parametrize(
    "part, message",
    [
        ("bench", "error: no wheels in {wheels}: download them as docs/performance.md says"),
        ("benhc", "error: unknown part 'benhc'; name bench, long, extras or all"),
    ],
)
def test_no_wheels_or_an_unknown_part_stops_it_at_once_in_one_line(tmp_path, part, message):
    """Before the pip install and any device time: on the device machine every step would
    fail on importing grain without the carried wheels."""
    wheels = tmp_path / "absent"
    result = subprocess.run(
        ["bash", "scripts/device_accel.sh", part],
        cwd=REPO,
        env=_env(tmp_path / "no-stubs", tmp_path, WHEELS=str(wheels)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(message.format(wheels=wheels)), line
    assert not (tmp_path / "out").exists()
