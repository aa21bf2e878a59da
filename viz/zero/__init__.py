"""ZeRO's memory model (the paper's Figure 1), `ddpscope zero` runs beside it, and their
figures."""
