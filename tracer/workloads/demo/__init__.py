"""The bundled demo job that ``python -m tracer run`` launches (models + training script)."""
