"""The `ddpscope` command: parse, build a config, hand it to the capture side (`tracer.launch`)
or the reading side (`viz`), report. The one package that imports both: capture and viz
never import each other upward, and neither imports this."""
