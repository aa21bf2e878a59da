"""The bundled demo job that ``ddpscope run`` launches (models + training script)."""
