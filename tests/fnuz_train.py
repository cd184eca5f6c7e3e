"""train_grpo.py with float8_e4m3fnuz as every rank's FP8, what kernels.quant.fp8_dtype picks on AMD gfx942
(MI300): the CPU tests' way through the target hardware's FP8 on both sides of a weight sync. Each rank prints
one line when the actor or the rollout first asks for the FP8 dtype.

    torchrun --standalone --nproc-per-node 3 tests/fnuz_train.py --config configs/tiny.yaml ...
"""
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kernels.quant  # noqa: E402  (patched before train_grpo and rollout_server import fp8_dtype from it)

_asked = []


def fp8_dtype(device=None) -> torch.dtype:
    if not _asked:
        _asked.append(True)
        print(f"fnuz_train: fp8_dtype({device}) -> float8_e4m3fnuz", file=sys.stderr, flush=True)
    return torch.float8_e4m3fnuz


kernels.quant.fp8_dtype = fp8_dtype
sys.argv[0] = str(ROOT / "train_grpo.py")
runpy.run_path(sys.argv[0], run_name="__main__")
