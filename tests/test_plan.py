"""The memory planner against measured allocations on small configs, and its verdict on the shipped configs."""
import subprocess
import sys

import pytest
import torch

from model import ModelConfig, build_model
from model.config import load_yaml
from model.plan import activations, param_split, plan
from rollout_server import Engine
from tests.conftest import saved_activation_bytes
from train_grpo import RunConfig

VARIANT = ["model.hidden_size=128", "model.head_dim=64", "model.moe_intermediate_size=96", "model.hc_mult=4",
           "model.num_attention_heads=8", "model.vocab_size=4096"]  # a vocabulary whose saved logits count


@pytest.mark.parametrize("ov", [[], VARIANT], ids=["tiny", "wider"])
def test_parameters_exact_and_activations_bounded(ov):
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"] + ov)["model"])
    m = build_model(cfg, seed=0).train()
    ps = param_split(cfg)
    assert ps["total"] == sum(p.numel() for p in m.parameters())
    assert ps["experts"] == sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    for ckpt in (False, True):
        m.activation_checkpointing = ckpt
        B, T = 4, 128
        # the torch twins' saved tensors (kernels=False: this is the CPU path; the GPU kernels' in test_gpu.py)
        ratio = activations(cfg, B * T, 4, ckpt, kernels=False, seq=T)["kept"] / saved_activation_bytes(m, B, T)
        # never below what autograd keeps; at most 1.5x (the planner is conservative where it approximates)
        assert 1.0 <= ratio <= (1.1 if ckpt else 1.5), (ckpt, ratio)


def test_rollout_weights_and_pools_equal_the_engine_allocation():
    ov = ["model.vocab_size=256", "model.hidden_size=256", "model.head_dim=128", "model.qk_rope_head_dim=32",
          "model.q_lora_rank=128", "model.o_lora_rank=128", "model.moe_intermediate_size=128",
          "model.index_head_dim=128", "deploy.world_size=3", "rollout.max_seqs=4", "rollout.max_model_len=512",
          "rollout.dtype=bf16"]
    run = RunConfig.load("configs/tiny.yaml", ov)
    p = plan(run)["rollout"]
    eng = Engine(build_model(run.model, seed=0), fp8=True, dtype=torch.bfloat16, device="cpu", max_seqs=4,
                 max_model_len=512)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # storages: views share theirs
            for n, t in list(eng.model.named_parameters()) + list(eng.model.named_buffers()) if "inv_freq" not in n}
    weights = sum(held.values())
    c = eng.cache
    pools = sum(t.numel() * t.element_size() for d in (c.win, c.entries, c.ikeys, c.buf_kv, c.buf_gate, c.prev_kv,
                                                        c.prev_gate, c.ibuf_kv, c.ibuf_gate, c.iprev_kv, c.iprev_gate)
                for t in d.values())
    assert weights == p["dense FP8 linears"] + p["other weights (BF16/fp32)"] + p["routed experts"]
    assert pools == p["cache pools"]


@pytest.mark.parametrize("path", ["configs/mini.yaml", "configs/dsv4.yaml"])
def test_planned_pools_are_the_cache_shapes_at_full_size(path):
    """The planner's cache bytes for the shipped configs' own shapes (models built on meta) are what PagedCache
    allocates at full capacity: the engine's pool sizing counts the same shapes."""
    from model.plan import cache_bytes
    from rollout_server import PagedCache
    run = RunConfig.load(path, [])
    model, ro = build_model(run.model, "meta", seed=None), run.rollout
    assert (run.model.csa_ratio, run.model.hca_ratio) == (4, 128)
    # a block table's width: ceil(entries / 64) for the max_len // ratio entries a pool keeps, at least 1
    assert [run.model.seq_blocks(n, 64) for n in (16384, 260, 259, 3)] == [
        {"csa": 64, "hca": 2}, {"csa": 2, "hca": 1}, {"csa": 1, "hca": 1}, {"csa": 1, "hca": 1}]
    full = {k: ro.max_seqs * n + 1 for k, n in run.model.seq_blocks(ro.max_model_len, 64).items()}
    assert PagedCache.nbytes(model, ro.max_seqs, full, 64, torch.bfloat16) == cache_bytes(run.model, ro.max_seqs,
                                                                                           ro.max_model_len, 2)
    fixed = dict.fromkeys(full, 37)  # rollout.num_blocks: the pools' size, whatever the sequences
    assert PagedCache.nbytes(model, ro.max_seqs, fixed, 64, torch.bfloat16) == cache_bytes(
        run.model, ro.max_seqs, ro.max_model_len, 2, num_blocks=37)


def test_dsv4_fits_two_plus_one_mi308x_nodes():
    r = subprocess.run([sys.executable, "-m", "model.plan", "--config", "configs/dsv4.yaml"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "fits" and "284.33B parameters" in lines[0]
    r = subprocess.run([sys.executable, "-m", "model.plan", "--config", "configs/dsv4.yaml",
                        "rollout.max_model_len=16384", "rollout.max_tokens=8192"], capture_output=True, text=True)
    assert r.stdout.strip().splitlines()[-1] == "does not fit (actor over)"


def test_mini_fits_its_two_gpus():
    """mini.yaml's own deploy section (1 actor + 1 rollout H200) holds its worst case, full-length sequences of
    rollout.max_model_len; at 4,096 tokens its 8-sequence micro-batches would not."""
    p = plan(RunConfig.load("configs/mini.yaml", []))
    assert p["fits"], p
    p = plan(RunConfig.load("configs/mini.yaml", ["rollout.max_model_len=4096"]))
    assert not p["fits_actor"] and p["fits_rollout"], p


def test_gpu_runs_print_the_plan_against_their_gpus():
    """train_grpo prints, on rank 0 of a GPU run, the plan of its world against the smallest GPU of each role and
    the smallest actor host: one line when it fits, a warning naming the roles over it and their largest terms when
    not."""
    from train_grpo import memory_plan_line
    run = RunConfig.load("configs/mini.yaml", ["deploy.world_size=0"])
    assert memory_plan_line(run, 2, 141e9, 141e9) == \
        "memory plan: actor rank 112.7 GB of its GPU's 133.9 usable; rollout rank 7.1 GB of its GPU's 133.9 usable"
    line = memory_plan_line(run, 2, 80e9, 141e9)  # the world it ran in, not deploy.world_size (here 0)
    assert line.startswith("warning: memory plan: actor rank 112.7 GB of its GPU's 76.0 usable") and \
        "over the plan for the actor rank (largest: activations 49.9 GB, optimizer (AdamW moments) 26.0 GB" in line \
        and "rollout rank (" not in line and "deploy.world_size=2 deploy.gpu_memory_gb=80 " in line, line
    # the rollout rank: over with its weights and buffers, a warning; over with its pools alone, the engine sizes
    # them to what is free (no warning); more actor ranks shrink the actor's share
    line = memory_plan_line(run, 5, 141e9, 4e9)
    assert "actor rank 73.7 GB" in line and "over the plan for the rollout rank (largest: routed experts 2.4 GB, " \
        "cache pools 2.2 GB" in line and "actor rank (" not in line and "gpu_memory_gb=4 " in line, line
    assert memory_plan_line(run, 5, 141e9, 6e9) == "memory plan: actor rank 73.7 GB of its GPU's 133.9 usable; " \
        "rollout rank 7.1 GB of its GPU's 5.7 usable (the engine's cache pools get what is left, less than their " \
        "planned full size)"
    # pools fixed by rollout.num_blocks are made at that size: over with them is a warning
    fixed = RunConfig.load("configs/mini.yaml", ["deploy.world_size=0", "rollout.num_blocks=20000"])
    line = memory_plan_line(fixed, 5, 141e9, 6e9)
    assert line.startswith("warning: memory plan:") and "over the plan for the rollout rank (largest: cache pools" \
        in line and "less than their planned full size" not in line, line
    # the host term (AdamW moments offloaded, dsv4.yaml) for the most actor ranks a host holds
    run = RunConfig.load("configs/dsv4.yaml", [])
    assert memory_plan_line(run, 24, 192e9, 192e9, 2048e9, 8).endswith("actor host 1137.3 GB of its 1843.2 usable")
    line = memory_plan_line(run, 24, 141e9, 192e9, 1024e9, 8)
    assert "over the plan for the actor rank (largest: params (fp32 master) 71.1 GB" in line and "and the actor " \
        "host (largest: actor node: AdamW moments 1137.3 GB)" in line and "deploy.world_size=24 deploy.gpu_memory_gb" \
        "=141 deploy.gpus_per_node=8 deploy.host_memory_gb=1024 lists" in line, line
    assert memory_plan_line(run, 24, 192e9, 192e9, 1024e9, 4).endswith("actor host 568.7 GB of its 921.6 usable")
    assert "actor host" not in memory_plan_line(run, 24, 192e9, 192e9)  # the host's memory unknown
