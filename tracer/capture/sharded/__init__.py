"""FSDP2 capture: per-unit compute, all-gathers, reduce-scatters and memory (sharded training's room beside DDP's)."""
