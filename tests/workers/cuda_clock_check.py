"""The CUDA clock against the host clock on a real GPU, for tests/tracer/capture/test_cuda.py.

    cuda_clock_check.py SECONDS

Every 20 ms: host read ``t0``, a stamp (an event on an idle stream, so it completes at
once), spin until it is done, host read ``t1``: the stamp's true host time is inside
[t0, t1]. Stamps are resolved in batches a second later (as the tracer resolves steps).
A second clock that never re-anchors stamps the same moments. Prints one JSON line: how
far outside its bracket each clock put a stamp (µs, worst over the run and over its last
5 s), the drift rate the re-anchored clock found, and its blocked count.
"""

import json
import sys
import time

import torch

from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.capture.cuda_clock import CudaEventClock


def outside(t: float, lo: float, hi: float) -> float:
    return max(0.0, lo - t, t - hi)


def main() -> None:
    seconds = float(sys.argv[1])
    device = torch.device("cuda", 0)
    torch.cuda.init()
    host = CpuClock()
    side = torch.cuda.Stream(device=device)  # idle: its events complete at once
    clocks = {"reanchored": CudaEventClock(host, device, current_stream=lambda: side),
              "one_anchor": CudaEventClock(host, device, current_stream=lambda: side)}
    clocks["one_anchor"].REANCHOR_S = float("inf")
    pending: list = []
    worst = {k: 0.0 for k in clocks}
    late = {k: 0.0 for k in clocks}
    start = time.monotonic()
    last_resolve = start
    while time.monotonic() - start < seconds:
        t0 = host.host_us()
        stamps = {k: c.stamp() for k, c in clocks.items()}
        while not all(s[0].query() for s in stamps.values()):
            pass
        t1 = host.host_us()
        pending.append((t0, t1, stamps))
        time.sleep(0.02)
        if time.monotonic() - last_resolve >= 1.0 or time.monotonic() - start >= seconds:
            last_resolve = time.monotonic()
            for k, c in clocks.items():
                times = c.resolve([p[2][k] for p in pending])
                for (lo, hi, _), t in zip(pending, times):
                    off = outside(t, lo, hi)
                    worst[k] = max(worst[k], off)
                    if last_resolve - start >= seconds - 5:
                        late[k] = max(late[k], off)
            pending = []
    re = clocks["reanchored"]
    print(json.dumps({"seconds": seconds, "reanchored_worst_outside_us": worst["reanchored"],
                      "reanchored_last5s_outside_us": late["reanchored"],
                      "one_anchor_worst_outside_us": worst["one_anchor"],
                      "one_anchor_last5s_outside_us": late["one_anchor"],
                      "anchors": re._count, "drift_ppm": (re._anchors[-1][2] - 1.0) * 1e6,
                      "blocked": re.blocked}))


if __name__ == "__main__":
    main()
