"""ddpscope's analysis side: trace model, metrics and Plotly figures (pure functions)."""
