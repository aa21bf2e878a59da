"""torchtitan's own trainer (``python -m torchtitan.train``), as a user launches it, on CPU:
``torchtitan_train.py ROOT REPORT [torchtitan's arguments]``. ROOT holds torchtitan's
test assets (``tests/assets/tokenizer``, ``tests/assets/c4_test``: its debug model's
paths are relative); REPORT gets the sha256 of the trained
parameters (whole, gathered). The CPU shims are the tests' (``torchtitan_shims.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchtitan_shims  # noqa: E402

torchtitan_shims.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan import train  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

root, report = Path(sys.argv[1]), Path(sys.argv[2])
sys.argv = [sys.argv[0], *sys.argv[3:]]
os.chdir(root)
own_train = Trainer.train


def trained(self):
    own_train(self)
    digest = hashlib.sha256()
    for name, p in sorted(self.model_parts[0].named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # gathers: every rank calls it
        digest.update(name.encode())
        digest.update(full.detach().float().contiguous().numpy().tobytes())
    if dist.get_rank() == 0:
        report.write_text(json.dumps({"params_sha256": digest.hexdigest(), "torch": torch.__version__}))


Trainer.train = trained
train.main()
