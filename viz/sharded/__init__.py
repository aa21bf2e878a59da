"""Sharded (FSDP2) runs: their own tables, metrics per unit and step, memory, predictions
under other settings, and figures."""
