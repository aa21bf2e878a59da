"""A stand-in accelerator for tests (``standin_device.cpp``): PyTorch's PrivateUse1 device
with a GPU's streams and timing events on the host, so that the tracer's device path runs
where there is no GPU. A stand-in, said where it is used; see the C++ file for what it
models (a drifting device clock, streams behind the host, float32 elapsed times, counted
synchronisations).

``load()`` builds it once per torch version and source (under the same cache root as
ddpscope's own extension, behind a file lock, so parallel test processes build it once)
and registers it; a process can then make ``torch.Event(device=DEVICE)`` and use
``stream()`` / ``new_stream()``. ``StandInTracer`` is ``DDPTracer`` timing a CPU model's
run with the stand-in's events, as it times a CUDA model's with CUDA's: the same clock
(``CudaEventClock``, given the stand-in's events and streams) and the same compiled capture
(its device rings and anchors), where the real one would refuse a device it does not know.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("standin_device.cpp")
NAME = "ddpscope_standin_device"
DEVICE = "privateuseone:0"
_module = None


def build_dir() -> Path:
    from ddpscope.tracer.capture.native.build import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = f"torch-{importlib.metadata.version('torch')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / "standin" / f"{version}-{digest}"


def load():
    """The stand-in's module, built if needed and loaded (its device registered)."""
    global _module
    if _module is None:
        import torch.distributed  # noqa: F401 - the extension links against torch's libraries
        from torch.utils import cpp_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _module = cpp_extension.load(NAME, sources=[str(SOURCE)], build_directory=str(folder),
                                         extra_cflags=["-O2"], verbose=False)
    return _module


def stream(stream_id: int | None = None):
    """The calling thread's current stand-in stream (or stream ``stream_id``) as a ``torch.Stream``."""
    import torch

    module = load()
    sid = module.current_stream_id() if stream_id is None else stream_id
    return torch.Stream(stream_id=sid, device_index=0, device_type=module.DEVICE_TYPE)


def new_stream():
    """A new stand-in stream (``torch.Stream``)."""
    import torch

    return torch.Stream(device=torch.device(DEVICE))


def make_clock(pinned: bool = False):
    """``CudaEventClock`` on the stand-in: its ``torch.Event``s, its current stream, a new
    idle stream for the anchors; ``pinned``: stamps on stream 0 (the compute stream), as the
    FSDP2 tracer pins CUDA's."""
    import torch

    from ddpscope.tracer.capture.clock import CpuClock
    from ddpscope.tracer.capture.cuda_clock import CudaEventClock

    device = torch.device(DEVICE)
    clock = CudaEventClock(host_clock=CpuClock(), device=device,
                           event_factory=lambda: torch.Event(device=device, enable_timing=True),
                           current_stream=stream, idle_stream=new_stream())
    if pinned:
        clock.pin_stream(stream(0))
    return clock


def make_tracer_class():
    """``StandInTracer``: ``DDPTracer`` with the stand-in as its timing device (a class made
    on demand: importing this package must not import ddpscope's tracer)."""
    import torch

    from ddpscope.tracer import DDPTracer
    from ddpscope.tracer.capture.ddp.compiled import load_extension

    load()
    device = torch.device(DEVICE)

    class StandInTracer(DDPTracer):
        encode_in_backward = True  # as on a GPU host with cores to spare (backward_encoder.worth_it)

        def _timing_device(self, params):
            return device

        def _make_clock(self, _device):
            return make_clock()

        def _compiled_extension(self, device):
            if self.config.capture == "python":
                return None, self.config.capture_note
            return load_extension()

    return StandInTracer


def make_fsdp_tracer_class():
    """``StandInFSDPTracer``: the FSDP2 tracer with its clock on the stand-in, pinned to the
    stand-in's stream 0 (the compute stream, as the real one pins CUDA's current stream)."""
    from ddpscope.tracer.capture.sharded.fsdp_tracer import FSDPTracer

    load()

    class StandInFSDPTracer(FSDPTracer):
        def _make_clock(self, _device):
            return make_clock(pinned=True)

    return StandInFSDPTracer
