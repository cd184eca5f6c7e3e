"""Scratch (not committed): the engine's weight count against what it holds on the GPU, for mini.yaml."""
import time
import torch
import rollout_server
from model import build_model
from model.config import ModelConfig, load_yaml

counted = []
check = rollout_server.check_weights_fit
rollout_server.check_weights_fit = lambda model, device: counted.append(rollout_server.held_bytes(model)) or check(model, device)
for over in ([], ["model.num_hidden_layers=4", "model.compress_ratios=[0,4,128,4]"]):
    cfg = ModelConfig.from_dict(load_yaml("configs/mini.yaml", over)["model"])
    m = build_model(cfg, "meta", torch.float32, seed=None)
    for fp8 in (True, False):
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        eng = rollout_server.prepare_inference_model(m, fp8, torch.bfloat16, torch.device("cuda"))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        need, ex = counted[-1]
        print(f"mini layers={cfg.num_hidden_layers} fp8={fp8}: counted {need / 2**30:.4f} GiB (experts {ex / 2**30:.4f}), "
              f"held on the GPU {held / 2**30:.4f} GiB, ratio {held / need:.5f}, {time.perf_counter() - t0:.1f} s", flush=True)
        del eng
torch.cuda.empty_cache()
free = torch.cuda.mem_get_info()[0]
filler = torch.empty(free - 2 * 2**30, dtype=torch.uint8, device="cuda")
cfg = ModelConfig.from_dict(load_yaml("configs/mini.yaml")["model"])
t0 = time.perf_counter()
try:
    rollout_server.Engine(build_model(cfg, "meta", torch.float32, seed=None), device="cuda")
except ValueError as e:
    print(f"{time.perf_counter() - t0:.2f} s: {e}")
del filler
