"""DDP's room: `DDPTracer`, the hooks it attaches (communication, step, ZeRO-1's
parameter sync), the recorder and its step records, the trace events it writes, and the
compiled capture of the all-reduces."""
