"""What-if: predict a DDP run at another ``bucket_cap_mb`` from one trace of it.

- ``layout``: the buckets DDP would build (its own assignment function);
- ``cost``: all-reduce time against message size, fitted to the run (and a calibration);
- ``model``: what the simulator takes from a trace (ready times with slowdown removed,
  fixed per-step costs, the compute slowdown under communication);
- ``simulate``: one step replayed with another layout -> the trace's own tables;
- ``sweep``: many caps, the fastest; ``projection``: another world size / link;
- ``advisor``: uniform caps, growing and per-bucket ``bucket_cap_mb_list``s searched, the
  recommendation judged against the run's own noise; ``ab``: a run against its rerun;
  ``report``: ``ddpscope whatif``'s printed report.
"""
