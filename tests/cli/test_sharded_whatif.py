"""``ddpscope whatif`` on sharded runs: the rerun line it prints (pure; the tables are
tested on real runs in tests/tracer/capture/sharded/test_sharded.py, tests/viz/sharded/
test_deepspeed_peak.py and tests/tracer/capture/deepspeed/test_tracer.py)."""

from __future__ import annotations

import pytest

from ddpscope.cli.sharded_whatif import rerun_hint


def test_the_rerun_line_is_the_runs_own_with_the_settings_flags_in_place_of_its_own():
    run = {"command": "ddpscope run --nproc 2 --bucket-cap-mb 16 --zero-stage=2 --steps 5 --out runs/a -- "
                      "train.py --lr '3e-4 x'"}
    assert rerun_hint("deepspeed", run).startswith(
        "`ddpscope run --nproc 2 --steps 5 --zero-stage S --bucket-cap-mb MIB --out DIR -- train.py --lr '3e-4 x'`")
    run = {"command": "ddpscope run --nproc 4 --reshard-after-forward 2 --backward-prefetch 2 --out r -- -m pkg.train"}
    assert rerun_hint("fsdp2", run).startswith(
        "`ddpscope run --nproc 4 --reshard-after-forward true|false|N --out DIR -- -m pkg.train`")


@pytest.mark.parametrize("command", [None, 3, "", "torchrun train.py", "ddpscope run --out a", "ddpscope run 'open"])
def test_a_run_without_a_readable_command_gets_the_template(command):
    assert rerun_hint("fsdp2", {"command": command}).startswith(
        "`ddpscope run --reshard-after-forward true|false|N --out DIR -- SCRIPT`")
