"""Actor parallelism: FSDP2 over the actor ranks and expert parallelism (EP) for the routed experts.

Actor ranks 0..N-1, EP degree e dividing N:
    EP group of rank r        the e consecutive ranks [r - r % e, r - r % e + e): tokens are exchanged here,
                              rank r holds the routed experts [(r % e) * E/e, (r % e + 1) * E/e) of every layer
    expert-DP group of rank r the ranks with the same r % e: they hold the same experts
Dense parameters are FSDP-sharded over all N actor ranks, each rank's experts over its expert-DP group, with
MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=fp32) and fp32 master weights. Gradients are
summed, not averaged (losses are normalized by global counts). The optimizer is AdamW over the local shards,
its state optionally kept in host memory and streamed through the GPU per parameter.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from .config import ModelConfig
from .model import Experts, Transformer, combine, dispatch, expert_counts, inverse, permute


def close_process_groups():
    """The process groups destroyed, and their last references collected while the interpreter still runs (an atexit
    handler: the groups of a torchrun script, held by its engine or mesh in reference cycles). Collected, a gloo
    group joins its worker threads, the GIL released: a worker that still holds a finished collective's work
    releases its tensors then. Left to the interpreter's finalization, such a worker asks for the GIL there, is
    ended, and the rank aborts ("terminate called without an active exception", exit code -6) after its work is
    done: a few torchrun runs of the rollout CLI in a hundred, on two busy cores."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@dataclass
class ActorMesh:
    n: int
    rank: int
    ep: int
    actor_group: object
    ep_group: object
    edp_group: object
    device_type: str

    @property
    def ep_rank(self):
        return self.rank % self.ep

    def meshes(self):
        from torch.distributed.device_mesh import DeviceMesh
        dense = DeviceMesh.from_group(self.actor_group, self.device_type)
        expert = DeviceMesh.from_group(self.edp_group, self.device_type)
        return dense, expert


def make_actor_groups(n_actor: int, ep: int, device_type: str) -> ActorMesh | None:
    """Collective: every rank of the world calls it (process groups are created by all ranks together).
    Returns the calling rank's view, or None on a non-actor rank."""
    if n_actor % ep:
        raise ValueError(f"train.ep={ep} must divide the number of actor ranks ({n_actor})")
    rank = dist.get_rank()
    actor = dist.new_group(list(range(n_actor)))
    ep_groups = [dist.new_group(list(range(i, i + ep))) for i in range(0, n_actor, ep)]
    edp_groups = [dist.new_group(list(range(j, n_actor, ep))) for j in range(ep)]
    if rank >= n_actor:
        return None
    return ActorMesh(n_actor, rank, ep, actor, ep_groups[rank // ep], edp_groups[rank % ep], device_type)


# ---------------------------------------------------------------------------------------------------------
# expert parallelism


class EPExperts(Experts):
    """This rank's slice of the routed experts; forward exchanges token slots with the EP group (all-to-all),
    runs the local experts on what it received, and sends the results back. Autograd flows through both
    exchanges, and the router weights multiply on the token's own rank."""

    def __init__(self, cfg: ModelConfig, mesh: ActorMesh):
        E = cfg.n_routed_experts
        if E % mesh.ep:
            raise ValueError(f"train.ep={mesh.ep} must divide n_routed_experts ({E})")
        super().__init__(cfg, n_local=E // mesh.ep, expert_offset=mesh.ep_rank * (E // mesh.ep))
        self.group, self.ep = mesh.ep_group, mesh.ep

    def forward(self, x, idx, w):
        """x (N, D), idx (N, k) global expert ids, w (N, k) -> (N, D)."""
        if self.ep == 1:
            return super().forward(x, idx, w)
        N, k = idx.shape
        D = x.shape[1]
        flat = idx.reshape(-1)
        dest = flat // self.n_local
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        sc, rc = send.tolist(), recv.tolist()
        inv = inverse(order)
        x_recv = dist_nn.all_to_all_single(x.new_empty(sum(rc), D), dispatch(x, order, k, inv), rc, sc,
                                           group=self.group)
        e_send = (flat - dest * self.n_local)[order]
        e_recv = e_send.new_empty(sum(rc))
        dist.all_to_all_single(e_recv, e_send, rc, sc, group=self.group)
        o2 = torch.argsort(e_recv, stable=True)
        io2 = inverse(o2)
        y_sorted = self.forward_sorted(permute(x_recv, o2, io2), expert_counts(e_recv, self.n_local))
        y_recv = permute(y_sorted, io2, o2)
        y_back = dist_nn.all_to_all_single(x.new_empty(sum(sc), D), y_recv, sc, rc, group=self.group)
        return combine(y_back, order, w, inv)


def use_expert_parallel(model: Transformer, mesh: ActorMesh):
    """Swap every layer's experts for this rank's EP slice (on whatever device the model is, meta included)."""
    for layer in model.layers:
        dev = layer.ffn.experts.w1.device
        with torch.device(dev):
            layer.ffn.experts = EPExperts(model.cfg, mesh)
    return model


# ---------------------------------------------------------------------------------------------------------
# FSDP2


def shard_actor(model: Transformer, mesh: ActorMesh, param_dtype: torch.dtype, reshard_after_forward: bool = True):
    """fully_shard the experts over the expert-DP group, every block and the root over the actor ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dense, expert = mesh.meshes()
    # the model keeps its own dtypes (fp32 RoPE tables, mHC, router): FSDP must not cast block inputs to bf16
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    parts = [(layer.ffn.experts, expert) for layer in model.layers] + [(layer, dense) for layer in model.layers]
    for m, on in parts + [(model, dense)]:  # inner modules first
        fully_shard(m, mesh=on, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        # sum gradients (losses carry global normalizers). Over one rank the sum is the gradient itself: FSDP would
        # still divide it by the factor, a pass over every gradient for nothing
        if on.size() > 1:
            (getattr(m, "set_gradient_divide_factor", None) or m.set_reduce_scatter_divide_factor)(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # plain SUM: gloo has no PREMUL_SUM
                m.set_force_sum_reduction_for_comms(True)
    return model


def reshard(model: torch.nn.Module):
    """Free every gathered working copy (FSDP2 keeps them after a no-grad forward with reshard_after_forward=False,
    and the next forward would reuse them: call this before the sharded weights change)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def sharded_actor(cfg, mesh: ActorMesh, param_dtype: torch.dtype, device,
                  reshard_after_forward: bool = True) -> Transformer:
    """An empty actor built on `meta`, expert-parallel and FSDP-sharded over `mesh`, materialized on `device` with
    its buffers set (the weights still to be filled: copy_full_state, load_state or a copy)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    use_expert_parallel(model, mesh)
    shard_actor(model, mesh, param_dtype, reshard_after_forward)
    model.to_empty(device=device)
    model.reset_buffers()
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def chunk_rows(rows: int, n: int) -> int:
    """Rows of each of n shards of `rows` (FSDP2 shards dim 0 like torch.chunk: the last shards short or empty)."""
    return -(-rows // n)


def shard_rows(t: torch.Tensor) -> tuple[int, int]:
    """(first global row along dim 0, rows) of this rank's local shard of t (FSDP2 shards dim 0 like chunk)."""
    if not hasattr(t, "device_mesh"):
        return 0, t.shape[0]
    mesh = t.device_mesh
    n, r = mesh.size(), mesh.get_local_rank()
    size = chunk_rows(t.shape[0], n)
    start = min(r * size, t.shape[0])
    return start, local(t).shape[0]


def layout_rows(rows: int, rank: int, n: int, ep: int, expert: bool) -> tuple[int, int]:
    """[start, end) of dim 0 of a tensor's full form (a layer's experts: all of them stacked) that actor rank `rank`
    of n holds under expert parallelism ep, the layout sharded_actor gives: chunk_rows over the n ranks for a dense
    tensor; for experts, the rank's EP slice (rank % ep) chunked over its n / ep expert-DP ranks (rank // ep)."""
    off = 0
    if expert:
        rows //= ep
        off, rank, n = (rank % ep) * rows, rank // ep, n // ep
    size = chunk_rows(rows, n)
    start = min(rank * size, rows)
    return off + start, off + min(start + size, rows)


def layout_error(n: int, ep: int, n_experts: int) -> str | None:
    """Why (n actor ranks, ep) is no layout of n_experts routed experts, or None."""
    if n < 1 or ep < 1 or n % ep or n_experts % ep:
        return f"written by {n} actor ranks with ep={ep}, not a layout of {n_experts} experts"
    return None


def row_pieces(rows: int, lo: int, hi: int, n: int, ep: int, expert: bool) -> list[tuple[int, int, slice]]:
    """Where rows [lo, hi) of a tensor's full form (of `rows` rows) lie among the shards n actor ranks hold under
    expert parallelism ep: (rank, the rows its shard has, the slice of them wanted), in row order."""
    spans = sorted(enumerate(layout_rows(rows, w, n, ep, expert) for w in range(n)), key=lambda e: e[1])
    return [(w, b - a, slice(max(a, lo) - a, min(b, hi) - a)) for w, (a, b) in spans if max(a, lo) < min(b, hi)]


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor sharded along dim 0 (FSDP2's layout, chunk_rows), gathered with one
    all-gather on its mesh's group into padded chunks. The same values as t.full_tensor(), through the
    plain collective rather than the functional ones (an intermittent native crash in their wait was seen in
    weight syncs over gloo)."""
    from torch.distributed.tensor import Shard
    if tuple(t.placements) != (Shard(0),):
        return t.full_tensor()
    mesh, part = t.device_mesh, t.to_local()
    n, rows = mesh.size(), t.shape[0]
    size = chunk_rows(rows, n)
    if part.shape[0] == size:
        send = part.contiguous()
    else:
        send = part.new_zeros((size, *part.shape[1:]))
        send[:part.shape[0]] = part
    out = part.new_empty((n * size, *part.shape[1:]))
    # (all_gather_single: all_gather_into_tensor's name from torch 2.13 on, where the old one warns it is deprecated)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, send, group=mesh.get_group())
    return out[:rows]


@torch.no_grad()
def full_state(model: Transformer, mesh: ActorMesh | None):
    """(name, full tensor) for every tensor of the model, in state_dict order, all experts of a layer stacked.
    Collective over the actor ranks: every actor rank iterates it in lockstep.

    The tensors are looked up once per model and kept (state_dict() detaches and dispatches every DTensor, a
    few milliseconds per sync): this relies on the actor updating its tensors in place (AdamW, checkpoint
    loads), never replacing them."""
    entries = model.__dict__.get("_full_state_entries")
    if entries is None:
        experts = {n for n, m in model.named_modules() if isinstance(m, Experts)}
        entries = []
        for name, t in model.state_dict(keep_vars=True).items():
            t = t.detach()
            sharded = hasattr(t, "full_tensor")  # a DTensor; on a one-rank mesh its local tensor is all of it
            if sharded and t.device_mesh.size() == 1:
                t, sharded = t.to_local(), False
            entries.append((name, t, sharded, name.rpartition(".")[0] in experts))
        model.__dict__["_full_state_entries"] = entries
    for name, t, sharded, expert in entries:
        full = gather_rows(t) if sharded else t
        if mesh is not None and mesh.ep > 1 and expert:
            parts = [torch.empty_like(full) for _ in range(mesh.ep)]
            dist.all_gather(parts, full.contiguous(), group=mesh.ep_group)
            full = torch.cat(parts)
        yield name, full


def clip_coef(norm: float, max_norm: float) -> float:
    """The factor clipping multiplies gradients by: max_norm / norm above max_norm, else 1."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, group, scale: bool = True) -> float:
    """Global gradient norm over every rank's local shards (each element lives on exactly one rank);
    scales the gradients down to max_norm (scale=False leaves that to AdamW.step(clip=clip_coef(norm, max_norm)),
    which folds it into its fused kernel). Returns the norm before clipping."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    if grads:  # per-tensor norms in one foreach launch, combined in fp64
        sq = sq + torch.stack(torch._foreach_norm(grads)).double().square().sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    coef = clip_coef(norm, max_norm)
    if scale and coef != 1.0:
        torch._foreach_mul_(grads, coef)
    return norm


class AdamW:
    """AdamW (decoupled weight decay, torch.optim.AdamW's formula) over local shards; offload=True keeps the
    moments in (pinned) host memory and streams each parameter's through the device for its update.
    fused=True updates the fp32 weights with torch's fused multi-tensor AdamW kernel; False is the per-tensor loop
    (its twin: the same formula, equal within fp32 rounding)."""

    def __init__(self, named_params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 offload: bool = False, fused: bool = True):
        self.params = [(n, p, p.ndim >= 2) for n, p in named_params if p.requires_grad]
        self.lr, self.betas, self.eps, self.wd, self.offload = lr, betas, eps, weight_decay, offload
        self.fused = fused and not offload
        self._scalars = {}  # the fused kernel's step count and 1 / clip, as device tensors
        self.t = 0
        self.state = {}
        for n, p, _ in self.params:
            lp = local(p)
            if offload:
                mk = lambda: torch.zeros(lp.shape, dtype=torch.float32, pin_memory=lp.is_cuda)  # noqa: E731
            else:
                mk = lambda: torch.zeros(lp.shape, dtype=torch.float32, device=lp.device)  # noqa: E731
            self.state[n] = (mk(), mk())

    def zero_grad(self):
        for _, p, _ in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float | None = None, clip: float = 1.0):
        """One update; clip multiplies the gradients first (clip_coef), inside the fused kernel."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        bc1, bc2 = 1 - b1 ** self.t, math.sqrt(1 - b2 ** self.t)
        live = [(n, p, decay) for n, p, decay in self.params if p.grad is not None]
        if self.fused:  # fp32 weights: the same update as the loop below, one fused multi-tensor kernel per group
            fast = [(n, p, decay) for n, p, decay in live if local(p).dtype == torch.float32]
            live = [e for e in live if local(e[1]).dtype != torch.float32]
            for decay in (True, False):
                group = [(n, p) for n, p, d in fast if d == decay]
                if not group:
                    continue
                dev = local(group[0][1]).device
                scale = self._scalar("scale", 1.0 / clip, dev) if clip != 1.0 else None  # the kernel divides by it
                torch._fused_adamw_([local(p) for _, p in group], [local(p.grad).float() for _, p in group],
                                    [self.state[n][0] for n, _ in group], [self.state[n][1] for n, _ in group], [],
                                    [self._scalar("step", self.t, dev)] * len(group), lr=lr, beta1=b1, beta2=b2,
                                    weight_decay=self.wd if decay else 0.0, eps=self.eps, amsgrad=False,
                                    maximize=False, grad_scale=scale)
        for n, p, decay in live:
            w, g = local(p), local(p.grad).float()
            if clip != 1.0:
                g = g * clip
            m, v = self.state[n]
            if self.offload:
                m, v = m.to(w.device, non_blocking=True), v.to(w.device, non_blocking=True)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if decay and self.wd:
                w.mul_(1 - lr * self.wd)
            w.addcdiv_(m.to(w.dtype), (v.sqrt() / bc2).add_(self.eps).to(w.dtype), value=-lr / bc1)
            if self.offload:
                self.state[n][0].copy_(m, non_blocking=True)
                self.state[n][1].copy_(v, non_blocking=True)
        if self.offload and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _scalar(self, key: str, value: float, dev) -> torch.Tensor:
        t = self._scalars.get(key)
        if t is None or t.device != dev:
            t = self._scalars[key] = torch.zeros((), dtype=torch.float32, device=dev)
        return t.fill_(value)

    def state_tensors(self) -> dict:
        out = {}
        for n, (m, v) in self.state.items():
            out[f"{n}.exp_avg"], out[f"{n}.exp_avg_sq"] = m.cpu(), v.cpu()
        return out

    def load_state_tensors(self, tensors: dict, t: int):
        for n, (m, v) in self.state.items():
            m.copy_(tensors[f"{n}.exp_avg"])
            v.copy_(tensors[f"{n}.exp_avg_sq"])
        self.t = t


@torch.no_grad()
def copy_full_state(model: Transformer, named_full):
    """Copy full tensors (state_dict names, all experts stacked) into a possibly sharded model: each rank keeps
    its EP slice of the experts and its FSDP rows."""
    targets = model.state_dict(keep_vars=True)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    for name, full in named_full:
        dst = targets[name]
        mod = experts.get(name.rpartition(".")[0])
        if mod is not None:
            full = full[mod.expert_offset:mod.expert_offset + mod.n_local]
        start, n = shard_rows(dst)
        local(dst).copy_(full[start:start + n])
