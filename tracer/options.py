"""Every command-line option of ddpscope, declared once.

An ``Option`` holds a setting's flag, help, default and check. Config dataclasses (the
launch side's ``RunConfig`` & co., the capture side's ``CaptureConfig``) declare their
fields with ``Option.field()``; ``add_arguments`` builds an argparse parser from those
fields and ``check_fields`` (called from ``__post_init__``) validates them, raising a
``ValueError`` that names the flag. Torch-free: the dashboard and the CLI import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

MAX_NPROC = 64
MAX_BUCKET_CAP_MB = 10240.0  # 10 GiB: more than any real gradient bucket
MAX_STEPS = 100_000
WEEK_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Option:
    """One setting. ``check(value)`` returns an error text (without the flag) or None."""

    flag: str
    help: str
    default: Any = None
    type: Callable | None = None
    check: Callable[[Any], str | None] | None = None
    action: str | None = None  # "store_true" / "store_false" for switches
    metavar: str | None = None
    required: bool = False

    def field(self, default: Any = dataclasses.MISSING, **kw) -> Any:
        """A dataclass field for this option (``default`` overrides the option's own)."""
        value = self.default if default is dataclasses.MISSING else default
        if isinstance(value, (list, dict)):
            return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"option": self}, **kw)
        return dataclasses.field(default=value, metadata={"option": self}, **kw)

    def validate(self, value: Any) -> None:
        if self.required and not value:
            raise ValueError(f"{self.flag} {self.metavar or 'VALUE'} is required")
        if self.check is not None and value is not None:
            problem = self.check(value)
            if problem:
                raise ValueError(f"{self.flag} {problem}")


def in_range(lo: float, hi: float, what: str = "", lo_open: bool = False) -> Callable[[Any], str | None]:
    """A check that ``lo <= value <= hi`` (``lo < value`` with ``lo_open``), finite."""
    def check(v):
        ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if ok:
            return None
        if lo_open:
            return f"must be > {lo:g} and <= {hi:g}{what}, got {v!r}"
        return f"must be in {lo:g}..{hi:g}{what}, got {v!r}"
    return check


def one_of(choices) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(map(str, choices))}, got {v!r}"


# -- the options ---------------------------------------------------------------------
OUT = Option("--out", "new or empty folder for the trace (never overwritten)", metavar="DIR", required=True)
NPROC = Option("--nproc", "processes (ranks) on this node", 2, int, in_range(1, MAX_NPROC))
BUCKET_CAP_MB = Option(
    "--bucket-cap-mb", "DDP bucket_cap_mb in MiB, overriding the script's own (default: the script's value)",
    None, float, in_range(0, MAX_BUCKET_CAP_MB, " (MiB)", lo_open=True))
MAX_BUCKET_LIMITS = 10_000


def mib_list(value) -> tuple[float, ...]:
    """``"1,8,25"`` (or a sequence of numbers) -> ``(1.0, 8.0, 25.0)``; ``ValueError`` on
    anything that is not numbers separated by commas."""
    parts = str(value).split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(float(x) for x in parts if not isinstance(x, str) or x.strip())
    except (TypeError, ValueError):
        raise ValueError(f"must be sizes in MiB separated by commas (e.g. 1,8,25), got {value!r}") from None


def _mib_list_check(v) -> str | None:
    try:
        caps = mib_list(v)
    except ValueError as e:
        return str(e)
    if not caps or len(caps) > MAX_BUCKET_LIMITS:
        return f"must name 1 to {MAX_BUCKET_LIMITS} bucket sizes in MiB, got {v!r}"
    if not all(math.isfinite(c) and 0 < c <= MAX_BUCKET_CAP_MB for c in caps):
        return f"must each be > 0 and <= {MAX_BUCKET_CAP_MB:g} MiB, got {v!r}"
    return None


BUCKET_CAP_MB_LIST = Option(
    "--bucket-cap-mb-list", "DDP bucket_cap_mb_list: a size limit per bucket in MiB, in bucket order (bucket 0 "
    "holds the gradients ready first: the last layers'; the last limit repeats), comma-separated, overriding the "
    "script's bucket_cap_mb and bucket_cap_mb_list (PyTorch 2.13's C++ reducer; an older DDP without it takes the "
    "largest as bucket_cap_mb) (default: the script's)", None, str, _mib_list_check, metavar="MB,MB,...")


def _reshard_check(v) -> str | None:
    text = str(v).strip().lower()
    if text in ("true", "false") or text.isdigit() and int(text) >= 1:
        return None
    return f"takes true, false or a number of ranks N >= 1 (a factor of the shard group), got {v!r}"


RESHARD_AFTER_FORWARD = Option(
    "--reshard-after-forward", "FSDP2 scripts: reshard_after_forward for every unit but the root, overriding the "
    "script's: true (ZeRO-3), false (ZeRO-2) or N (resharded to N ranks after forward, a hybrid)",
    None, str, _reshard_check, metavar="true|false|N")
FORWARD_PREFETCH = Option("--forward-prefetch", "FSDP2 scripts: each unit all-gathers this many next units ahead of "
                          "its forward (FSDP's set_modules_to_forward_prefetch; 0 = FSDP's default, none)",
                          None, int, in_range(0, 64), metavar="N")
BACKWARD_PREFETCH = Option("--backward-prefetch", "FSDP2 scripts: each unit all-gathers this many next units "
                           "(backward order) ahead of its backward (FSDP's default: 1)", None, int, in_range(1, 64),
                           metavar="N")
ZERO_STAGE = Option("--zero-stage", "DeepSpeed scripts: the ZeRO stage (1, 2 or 3), overriding the stage in the config "
                    "the script hands deepspeed.initialize (a model built partitioned for stage 3 keeps 3)",
                    None, int, in_range(1, 3), metavar="S")
STEPS = Option("--steps", "end the job cleanly after this many traced optimizer steps (default: run to the end)",
               None, int, in_range(1, MAX_STEPS))
TIMEOUT = Option("--timeout", "watchdog: stop the job after this many seconds", 900.0, float,
                 in_range(0, WEEK_S, " seconds (at most a week)", lo_open=True))
HANG_TIMEOUT = Option("--hang-timeout", "hang watchdog: when no rank moves for this many seconds (plus 120 s before "
                      "the first step), name the stuck rank(s), save every rank's stacks and stop the job (0: off)",
                      60.0, float, in_range(0, WEEK_S, " seconds"))
NNODES = Option("--nnodes", "torchrun --nnodes (multi-node)", 1, int, in_range(1, 10_000))


def _rate_check(v) -> str | None:
    from ddpscope.tracer.launch.lab import parse_rate  # torch-free, like this module

    try:
        parse_rate(v)
    except ValueError as e:
        return str(e)
    return None


EMULATE_NODES = Option("--emulate-nodes", "run N nodes on this machine: network namespaces joined through links "
                       "shaped to --link, --nproc ranks each, gloo between them over those links (needs root or "
                       "CAP_NET_ADMIN; emulates each link's bandwidth, not its latency)", None, int,
                       in_range(2, 64), metavar="N")
LINK = Option("--link", "with --emulate-nodes: each node's link rate, both ways, in tc's units (100mbit, 1gbit, "
              "10gbit; default 1gbit)", None, str, _rate_check, metavar="RATE")
NODE_RANK = Option("--node-rank", "torchrun --node-rank", 0, int, in_range(0, 9_999))
RDZV_ENDPOINT = Option("--rdzv-endpoint", "torchrun --rdzv-endpoint HOST:PORT (node 0 hosts it)", None, str,
                       metavar="HOST:PORT")
DEMO_MODELS = ("mlp", "gpt")  # tracer/workloads/demo/models.py builds them
DEMO = Option("--demo", "run the bundled demo training script instead of your own: mlp or gpt", None, str,
              one_of(DEMO_MODELS), metavar="MODEL")
MODEL = Option("--model", "demo model: mlp or gpt", "mlp", str, one_of(DEMO_MODELS))
PROFILE = Option("--profile", "also record torch.profiler (Kineto) on --profile-steps traced steps after step 0 "
                 "(its warm-up), into RUN/profile/ (one file per rank), to check the trace against", False,
                 action="store_true")
PROFILE_STEPS = Option("--profile-steps", "traced steps --profile records (steps 1..N)", 5, int, in_range(1, 1000))
CAPTURES = ("python", "compiled")
CAPTURE = Option("--capture", "how all-reduces and gradient-ready times are taken: compiled (C++ beside DDP's "
                 "reducer, built once per torch version before the ranks start; the python hooks where it cannot be "
                 "had: no compiler, a device other than CPU or CUDA, a script's own Python comm hook) or python (DDP communication hook and gradient "
                 "hooks)", "compiled", str, one_of(CAPTURES))
#: steps with a gradient-ready mark per parameter whatever --grad-marks-every says: DDP's first
#: iteration and its rebuilt layout's first steps, which the what-if replays (tracer/capture/ddp/recorder.py)
GRAD_MARKS_FIRST_STEPS = 5
GRAD_MARKS_EVERY = Option(
    "--grad-marks-every", f"DDP runs: a gradient-ready mark per parameter on the first {GRAD_MARKS_FIRST_STEPS} "
    "steps and then on every Nth step only (the others keep their step, pass, bucket and optimizer spans and where "
    "backward compute ended): fewer events a step, for a launch-bound GPU model, where a device event per parameter "
    "per step is a large part of the tracer's cost; the what-if replays the marked steps (default 1: every step)",
    1, int, in_range(1, MAX_STEPS), metavar="N")
VERBOSE = Option("--verbose", "show every rank's output, each line marked with its rank (default: rank 0's output "
                 "as it comes; every rank's is kept in RUN/logs/)", False, action="store_true")
QUIET = Option("--quiet", "show ddpscope's own lines only (progress, notes), none of the script's output", False,
               action="store_true")
# ring
RING_NPROC = Option("--nproc", "ranks in the ring (per node with --emulate-nodes or --nnodes)", 4, int,
                    in_range(1, MAX_NPROC))
RING_MB = Option("--mb", "tensor size per rank, in MiB", 4.0, float, in_range(0, 4096.0, " (MiB)", lo_open=True))
RING_REPEAT = Option("--repeat", "timed rounds after one warm-up", 5, int, in_range(1, 1000))
RING_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32")
RING_DTYPE = Option("--dtype", "element type", "float32", str, one_of(RING_DTYPES))
RING_CALIBRATION = Option("--no-calibration", "skip the two small sizes used to fit latency and bandwidth",
                          True, action="store_false")
# zero
ZERO_NPROC = Option("--nproc", "ranks", 2, int, in_range(2, MAX_NPROC, " (sharding needs two ranks)"))
ZERO_STEPS = Option("--steps", "steps per stage; the last is measured", 3, int,
                    in_range(2, 100, " (the last step is measured after warm-up)"))
ZERO_STAGES = Option("--stages", "comma-separated ZeRO stages", "0,1,2,3", str)
# calibrate / whatif
CALIBRATE_MAX_MB = Option("--max-mb", "largest all-reduce of the sweep, in MiB (4 KiB x4 up to it)", 256.0, float,
                          in_range(0.01, 4096.0, " (MiB)"))
WHATIF_CAPS = Option("--caps", "bucket_cap_mb values to predict, in MiB, comma-separated "
                     "(default 0.25,0.5,1,2,4,8,16,25,32,64,128,256); a DeepSpeed run: reduce_bucket_size values, "
                     "MiB of the communication dtype (default 0.25,1,4,16,64)", None, str, metavar="MB,MB,...")
WHATIF_CAP_LIST = Option("--cap-list", "also predict this bucket_cap_mb_list: a size limit per bucket in MiB, "
                         "in bucket order, comma-separated (as ddpscope run --bucket-cap-mb-list)", None, str,
                         _mib_list_check, metavar="MB,MB,...")
WHATIF_APPLY = Option("--apply", "rerun the traced script (same ranks, steps, emulated nodes) with the recommended "
                      "setting, then print predicted against measured, bucket by bucket", False, action="store_true")
WHATIF_OUT = Option("--apply-out", "the rerun's folder with --apply (new; default: beside RUN, named RUN-advised)",
                    metavar="DIR")


def parse_caps(text: str) -> list[float]:
    """``"1,4,25"`` -> [1.0, 4.0, 25.0]; ``ValueError`` naming --caps on anything else."""
    try:
        caps = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--caps must be numbers in MiB separated by commas (e.g. 1,4,25), got {text!r}") from None
    bad = [c for c in caps if not (math.isfinite(c) and 0 < c <= MAX_BUCKET_CAP_MB)]
    if not caps or bad:
        raise ValueError(f"--caps must each be > 0 and <= {MAX_BUCKET_CAP_MB:g} MiB, got {text!r}")
    return caps


SHORT_FLAGS = {"--verbose": ("-v",), "--quiet": ("-q",)}


def option_fields(cls) -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per ``Option`` field of the dataclass ``cls`` (dest = the field's name).
    Required options are checked by the config (one message for the CLI and the page)."""
    for f, o in option_fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "help": o.help + (f" (default {default})" if default not in
                                                                (None, False, True) else "")}
        if o.action:
            kw["action"] = o.action
        else:
            kw.update(type=o.type or str, default=default, metavar=o.metavar)
        flags = [o.flag, *SHORT_FLAGS.get(o.flag, ())]
        parser.add_argument(*flags, **kw)


def check_fields(obj) -> None:
    """Run every option's check on ``obj``'s values (``ValueError`` names the flag)."""
    for f, o in option_fields(type(obj)):
        o.validate(getattr(obj, f.name))
