"""torchtitan's own trainer (``python -m torchtitan.train``), as a user launches it, on CPU:
``torchtitan_train.py ROOT [torchtitan's arguments] --report FOLDER``. ROOT holds
torchtitan's test assets (``tests/assets/tokenizer``, ``tests/assets/c4_test``: its debug
model's paths are relative); ``--report`` (the other test workers' flag, taken out before
torchtitan parses the rest) gets ``check-rank<r>.json``: the sha256 of the trained
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

at = sys.argv.index("--report")
root, report = Path(sys.argv[1]), Path(sys.argv[at + 1])
sys.argv = [sys.argv[0], *sys.argv[2:at], *sys.argv[at + 2:]]
os.chdir(root)
own_train = Trainer.train


def trained(self):
    own_train(self)
    digest = hashlib.sha256()
    for name, p in sorted(self.model_parts[0].named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # gathers: every rank calls it
        digest.update(name.encode())
        digest.update(full.detach().float().contiguous().numpy().tobytes())
    report.mkdir(parents=True, exist_ok=True)
    (report / f"check-rank{dist.get_rank()}.json").write_text(
        json.dumps({"params_sha256": digest.hexdigest(), "torch": torch.__version__}))


Trainer.train = trained
train.main()
