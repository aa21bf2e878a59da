"""The backend tap's pieces that need no DeepSpeed (tracer/capture/deepspeed/comm.py):
message bytes, the collective's own signature read through a decorator that does not
``functools.wraps`` (as DeepSpeed's ``stage_on_cpu`` does), and a patched class that
hands on unchanged while no tap is attached. The real collectives are timed in
``test_tracer.py`` (real DeepSpeed jobs)."""

from __future__ import annotations

import torch

from ddpscope.tracer.capture.deepspeed import comm


def _no_wraps(func):  # DeepSpeed's stage_on_cpu: wrapper(self, *args, **kwargs), the function in its closure
    def wrapper(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    return wrapper


class Backend:
    @_no_wraps
    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return ("gathered", output_tensor.numel(), async_op)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return ("reduced", tensor.numel())


def test_message_bytes_of_tensors_and_lists():
    assert comm.nbytes(torch.zeros(10)) == 40
    assert comm.nbytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64)]) == 6 + 16
    assert comm.nbytes(None) == 0


def test_the_signature_is_the_collectives_own_through_a_decorator_without_wraps():
    sig = comm._signature(Backend.__dict__["all_gather_into_tensor"], "all_gather_into_tensor")
    assert list(sig.parameters) == ["self", "output_tensor", "input_tensor", "group", "async_op"]
    bound = sig.bind(Backend(), torch.zeros(8), torch.zeros(4), None, True).arguments
    assert comm.nbytes(bound[comm.OPS["all_gather_into_tensor"][1]]) == 32 and bound["async_op"] is True


def test_a_patched_backend_hands_on_unchanged_without_a_tap():
    class Mine(Backend):
        pass

    Mine.all_gather_into_tensor = Backend.__dict__["all_gather_into_tensor"]  # its own, to be patched
    comm.patch_backend(Mine)
    comm.patch_backend(Mine)  # once per process: a second patch is a no-op
    assert getattr(Mine.__dict__["all_gather_into_tensor"], "_ddpscope", False)
    assert getattr(Mine.__dict__["all_gather_into_tensor"], "__wrapped__", None) is not None
    b = Mine()
    assert b.all_gather_into_tensor(torch.zeros(8), torch.zeros(4), async_op=True) == ("gathered", 8, True)
    assert "all_reduce" not in Mine.__dict__  # only what the class itself defines
