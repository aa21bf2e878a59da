"""torchtitan's own trainer (0.3: ``python -m torchtitan.train``, its llama3 debug model,
FSDP2 as torchtitan applies it), traced by ``ddpscope run`` with no change to it. On
this CPU-only machine torchtitan needs shims (``workers/torchtitan_shims.py``: the
tests', never ddpscope's). Checked against the untraced run (bit-identical parameters,
the same losses), the model's own sizes (messages), and the ZeRO paper's model states."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.viz.sharded.comm_volume import compute_comm_volume
from ddpscope.viz.sharded.metrics import compute_stage_comparison
from ddpscope.viz.sharded.predict import predict_peak, predict_step_ms
from ddpscope.viz.trace import load_run
from tests.conftest import run_cli
from tests.tracer.capture.autotrace.test_autotrace import WORKERS, checks, trace_script, untraced

pytest.importorskip("torchtitan")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.frameworks
WORKER = str(WORKERS / "torchtitan_train.py")
STEPS = 3
ARGS = ("--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(STEPS),
        "--training.seq_len", "128", "--training.local_batch_size", "2", "--debug.seed", "7",
        # FSDP2's plain fully_shard (the default SPMD backend asks for a newer torch's DTensor mesh)
        "--parallelism.spmd_backend", "partial_dtensor")
UNITS = ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm, lm_head"]
_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def _assets(root: Path) -> Path:
    """torchtitan's debug model reads ``tests/assets/tokenizer`` and ``tests/assets/c4_test``
    under the working folder: a small BPE tokenizer (2,000 tokens, the debug model has
    2,048) and 400 documents, made here (the package ships neither)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = (Path(__file__).resolve().parents[4] / "README.md").read_text().split()
    docs = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(400)]
    data = root / "tests" / "assets" / "c4_test"
    data.mkdir(parents=True)
    (data / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2000, special_tokens=special))
    folder = root / "tests" / "assets" / "tokenizer"
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": special[0], "eos_token": special[1]}))
    return root


def _losses(text: str) -> list[tuple[int, str, str]]:
    return sorted(set(_LOSS.findall(_COLOUR.sub("", text))))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """torchtitan's default FSDP on 2 ranks, traced: (tmp folder, assets root, run folder, report, process)."""
    tmp_path = tmp_path_factory.mktemp("torchtitan")
    root = _assets(tmp_path / "root")
    traced, out, report = trace_script(tmp_path, WORKER, str(root), *ARGS)
    assert traced.returncode == 0, traced.stderr[-3000:]
    return tmp_path, root, out, report, traced


def test_torchtitan_trains_bit_identically_traced_per_unit_with_its_own_sizes(fsdp):
    tmp_path, root, out, report, traced = fsdp
    plain_report = untraced(tmp_path, WORKER, str(root), *ARGS)
    # nothing torchtitan computes changes
    assert checks(report) == checks(plain_report)
    plain = (tmp_path / "plain.log").read_text()
    losses = _losses(plain)
    assert [s for s, _, _ in losses] == [str(s) for s in range(1, STEPS + 1)]
    assert _losses(traced.stdout + traced.stderr) == losses

    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["kind"] == fmt.KIND_SHARDED and run["status"] == fmt.COMPLETE
    assert run["fsdp_trained_by"] == {"framework": "torchtitan"}  # its trainer: --parallelism.fsdp_... sets it
    trace = load_run(out)
    units = trace.shards.units
    assert units["name"].tolist() == UNITS  # torchtitan's fully_shard calls: embeddings, each layer, norm + head
    assert trace.shards.stage == 3 and set(trace.steps["step"]) == set(range(STEPS))
    # bf16 parameters gathered, fp32 gradients reduced (torchtitan's mixed precision): the messages are
    # each unit's parameters at those sizes, every step
    numel = dict(zip(units["unit"], units["numel"]))
    colls = trace.shards.colls
    for (rank, step), c in colls.groupby(["rank", "step"]):
        rs = c[c["collective"] == "reduce_scatter"].groupby("unit")["bytes"].sum()
        assert rs.to_dict() == {u: 4 * n for u, n in numel.items()}, (rank, step)
        ag = c[c["collective"] == "all_gather"].groupby("unit")["bytes"]
        assert all(b % (2 * numel[u]) == 0 and b > 0 for u, b in ag.sum().items()), (rank, step)
        # torchtitan clips the gradients each step (its max_norm): DTensor all-reduces the stack of
        # each parameter's partial norm (float32), a collective of no unit named for torch's norm
        none = c[c["unit"] == -1]
        assert none["by"].tolist() == ["all_reduce (torch.nn.utils.clip_grad._get_total_norm)"], (rank, step)
        assert none["bytes"].tolist() == [4 * sum(len(u["params"]) for u in run["sharding"]["units"])]
    # model states per rank: the ZeRO paper's stage 3 with this run's K and N
    measured = compute_stage_comparison(trace).dropna(subset=["measured/predicted"])
    assert len(measured) == 2 and measured["measured/predicted"].between(0.98, 1.02).all(), measured
    # where the user sets reshard_after_forward: torchtitan's own flag, as whatif says it
    said = run_cli("whatif", str(out), "--json")
    assert said.returncode == 0, said.stderr
    assert json.loads(said.stdout)["in_code"].startswith(
        "in your code: torchtitan's --parallelism.fsdp_reshard_after_forward always (true) or never (false)")


def test_a_rerun_that_keeps_units_gathered_peaks_where_the_whatif_said_with_torchtitans_own_gathers(fsdp, tmp_path):
    """torchtitan's chunked loss ``unshard()``s its last unit (norm, lm_head) itself and keeps it
    gathered through every chunk's forward and backward (``set_reshard_after_backward(False)``),
    then sets it to reshard after forward whatever it was built with: no
    ``reshard_after_forward`` changes that. The what-if keeps that unit as measured where the
    samples' per-unit split says the script held it, so ``--reshard-after-forward false``
    (ZeRO-2) peaks where it predicted, to the byte (before the split: 1 MiB, the unit, under);
    its step keeps that unit's gathers as measured."""
    _, root, out, _, _ = fsdp
    source = load_run(out)
    last = int(source.shards.units["unit"].max())
    # the script's own gather: held at samples where the run's settings (False for the last unit, as
    # torchtitan builds it) would not hold it, and released where they would
    held = [last in m for m in source.shards.memory[source.shards.memory["phase"] == "backward"]["unsharded_by_unit"]]
    assert any(held) and not all(held)
    proc, again, _ = trace_script(tmp_path, WORKER, str(root), *ARGS, name="false",
                                  ddpscope=("--reshard-after-forward", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rerun = load_run(again)
    assert rerun.shards.stage == 2
    predicted = predict_peak(source, reshard_after_forward=False).set_index("rank")
    measured = predict_peak(rerun).set_index("rank")  # its own settings: its measured peak
    assert predicted["predicted_peak_bytes"].to_dict() == measured["measured_peak_bytes"].to_dict()
    assert (predicted["predicted_peak_bytes"] > predicted["measured_peak_bytes"]).all()  # ZeRO-2 holds more
    # the step: the last unit is gathered again in backward at every step whatever it was built with
    # (the chunked loss's doing, the rerun's too), so resharding every unit changes nothing in a run whose
    # other units reshard already: predicted as measured (before, its forward gathers were added)
    units = source.shards.units
    assert units["reshard_after_forward"].tolist() == [True] * (len(UNITS) - 1) + [False]
    steps = predict_step_ms(source, True)
    assert (steps["predicted_step_ms"] == steps["measured_step_ms"]).all(), steps
    assert (predict_step_ms(source, False)["predicted_step_ms"] < steps["measured_step_ms"]).all()  # no regathers


def test_torchtitan_ddp_by_fsdp2_is_stage_0_with_each_units_gradient_all_reduced(tmp_path):
    """torchtitan's DDP (``data_parallel_replicate_degree 2``, ``data_parallel_shard_degree
    1``): it still applies ``fully_shard``, on a mesh whose shard dimension is 1, so nothing
    is sharded. Traced as stage 0: no all-gather, no reduce-scatter, each unit's whole fp32
    gradient all-reduced across the replicas once a step (the last unit's in two: its
    lm_head's at the last chunk of torchtitan's chunked loss, before the decoder's backward
    has given its norm a gradient, then the norm's), DDP's volume, the model states the
    ZeRO model's at N = 1; training bit-identical to the untraced run's."""
    root = _assets(tmp_path / "root")
    args = (*ARGS, "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
    traced, out, report = trace_script(tmp_path, WORKER, str(root), *args)
    assert traced.returncode == 0, traced.stderr[-3000:]
    plain_report = untraced(tmp_path, WORKER, str(root), *args)
    assert checks(report) == checks(plain_report)
    losses = _losses((tmp_path / "plain.log").read_text())
    assert len(losses) == STEPS and _losses(traced.stdout + traced.stderr) == losses

    trace = load_run(out)
    units = trace.shards.units
    assert trace.shards.stage == 0 and units["name"].tolist() == UNITS
    assert (units["shard_size"] == 1).all() and (units["replicate_size"] == 2).all()
    numel = dict(zip(units["unit"], units["numel"]))
    colls = trace.shards.colls
    for (rank, step), c in colls[colls["unit"] >= 0].groupby(["rank", "step"]):
        assert set(c["collective"]) == {"all_reduce"}, (rank, step)
        last = c[c["unit"] == len(UNITS) - 1]["bytes"].tolist()
        assert last == [4 * 2048 * 256, 4 * 256], (rank, step)  # lm_head.weight (vocab x dim), then norm.weight
        assert c.groupby("unit").size().to_dict() == {**{u: 1 for u in numel}, len(UNITS) - 1: 2}, (rank, step)
        assert c.groupby("unit")["bytes"].sum().to_dict() == {u: 4 * n for u, n in numel.items()}, (rank, step)
    vol = compute_comm_volume(trace).set_index("collective")
    assert vol.loc["total", "ring_D"] == pytest.approx(1.0)  # DDP's 2D x (N-1)/N at N = 2
    measured = compute_stage_comparison(trace).dropna(subset=["measured/predicted"])
    assert len(measured) == 2 and measured["measured/predicted"].between(0.98, 1.02).all(), measured
    # torchtitan's trainer ran it, but units sharded over 1 rank have nothing to reshard: no flag to name
    assert trace.run["fsdp_trained_by"] == {"framework": "torchtitan"}
    said = run_cli("whatif", str(out), "--json")
    assert said.returncode == 0 and json.loads(said.stdout)["in_code"] is None, said.stderr
