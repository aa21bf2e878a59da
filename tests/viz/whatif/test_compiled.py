"""A torch.compile'd model's gradient-ready times at another cap (``viz.whatif.compiled``):
DDPOptimizer's pieces, spread over the traced pieces' backward time by bytes. Made-up steps
(the pieces a real compiled run gives are in tests/tracer/capture/autotrace/test_torch_compile.py)."""

from __future__ import annotations

import pytest

from ddpscope.viz.whatif.compiled import at_cap
from ddpscope.viz.whatif.layout import cap_bytes
from ddpscope.viz.whatif.model import RankStep, StepInputs

MIB = 2**20
# four Linear layers registered in forward order, each a 1 MiB weight and a 4 KiB bias
NAMES = [f"{k}.{w}" for k in range(4) for w in ("weight", "bias")]
SIZES = [MIB if n.endswith("weight") else 4096 for n in NAMES]
RUN = {"param_names": NAMES, "param_bytes": SIZES, "bucket_cap_bytes": 25 * MIB,
       "torch_compile": {"optimize_ddp": "ddp_optimizer"}}


def traced_step() -> StepInputs:
    """As traced at DDP's default: the last layer (DDPOptimizer's first piece, past 1 MiB) ready
    at 100 µs of backward work, the three others together at 400, each weight's accumulation
    taking longer than the bias's (80 µs: more than the wait between two small pieces)."""
    work = {6: 100.0, 7: 104.0}
    work.update({p: 400.0 + (80 if p % 2 == 0 else 4) * i for i, p in enumerate(range(6))})
    return StepInputs(step=3, ranks={0: RankStep(b0=0.0, work=work, work_end=430.0, head=5.0, finalize=1.0,
                                                 tail=2.0)})


def ready(inputs) -> dict[int, float]:
    return inputs[0].ranks[0].work


def test_at_the_traced_cap_each_piece_is_ready_when_its_last_gradient_was():
    for cap in (None, 25.0, 4.0):
        got = ready(at_cap([traced_step()], RUN, cap))
        assert {got[6], got[7]} == {104.0} and {got[p] for p in range(6)} == {max(traced_step().ranks[0].work.values())}


def test_a_smaller_cap_splits_the_later_piece_by_bytes_and_never_splits_a_module():
    got = ready(at_cap([traced_step()], RUN, 1.0))
    assert got[6] == got[7] == 104.0
    # 104 -> the last gradient spread over layers 2, 1, 0 (the graph's order from its output), a third each
    third = (max(traced_step().ranks[0].work.values()) - 104.0) / 3
    for layer, k in ((2, 1), (1, 2), (0, 3)):
        assert got[2 * layer] == got[2 * layer + 1] == pytest.approx(104.0 + k * third, abs=0.01)
    step = at_cap([traced_step()], RUN, 1.0)[0].ranks[0]
    assert (step.work_end, step.head, step.finalize, step.tail) == (430.0, 5.0, 1.0, 2.0)  # the rest as traced


def test_ddp_optimizer_splits_at_a_lists_largest_limit():
    assert cap_bytes((0.25, 1.0, 4.0)) == 4 * MIB and cap_bytes(None) == 25 * MIB
    assert ready(at_cap([traced_step()], RUN, (0.5, 1.0))) == ready(at_cap([traced_step()], RUN, 1.0))


def test_a_run_json_that_says_nothing_usable_of_the_compile_is_an_eager_run():
    from ddpscope.viz.whatif.layout import runnable, smallest_cap_bytes

    for odd in ("yes", ["ddp_optimizer"], {"optimize_ddp": "python_reducer"}, None, {}):
        assert smallest_cap_bytes({"torch_compile": odd}) == 0 and runnable({"torch_compile": odd}, 0.25)
    assert smallest_cap_bytes(RUN) == MIB and not runnable(RUN, 0.5) and runnable(RUN, (0.25, 1.0))
    odd_cap = {**RUN, "bucket_cap_bytes": "lots"}  # DDP's default then
    assert ready(at_cap([traced_step()], odd_cap, 1.0)) == ready(at_cap([traced_step()], RUN, 1.0))
