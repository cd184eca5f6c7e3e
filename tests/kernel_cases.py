"""Kernel-vs-twin cases shared by the Triton-interpreter test (CPU) and the GPU tests."""
from types import SimpleNamespace

import torch


def compress_decode_case(device, ratio: int, overlap: bool, hd: int, rd: int, pool_dtype=torch.float32,
                         seed: int = 0, in_dtype=torch.float32) -> dict:
    """kernels.compress.compress_decode against rollout_server.compress_step_ref on one batch of sequences at
    window-completing and mid-window positions (with and without a previous window). -> max differences."""
    from kernels.compress import compress_decode
    from model.model import Compressor
    from rollout_server import compress_step_ref
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(SimpleNamespace(hidden_size=16, rms_norm_eps=1e-6), ratio, hd, overlap)
    comp.norm.weight.data = torch.rand(hd, generator=g) + 0.5
    comp.ape.data = torch.randn(comp.ape.shape, generator=g)
    comp = comp.to(device)
    width = 2 * hd if overlap else hd
    S, BE, n_blocks = 8, 2, 32
    r = ratio
    # done with no previous window, done with one, mid-window, done later, a scratch-slot row at position 0
    pos = torch.tensor([r - 1, 2 * r - 1, 2 * r + 1, 4 * r - 1, 0, 3 * r - 1])
    slots = torch.tensor([0, 3, 1, 5, S - 1, 2])
    B = len(pos)
    # distinct blocks for every sequence, as the engine's allocator gives them (two sequences writing one entry
    # would leave whichever wrote last)
    table = (torch.randperm(n_blocks - 1, generator=g)[:4 * B] + 1).view(B, 4)
    kv, gate = torch.randn(B, width, generator=g).to(in_dtype), torch.randn(B, width, generator=g).to(in_dtype)
    state = [torch.randn(S, r, width, generator=g), torch.randn(S, r, width, generator=g)]
    state += [torch.randn(S, r, hd, generator=g), torch.randn(S, r, hd, generator=g)] if overlap else [None, None]
    pool = torch.randn(n_blocks, BE, hd, generator=g).to(pool_dtype)
    ang = torch.rand(B, rd // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    dev = [t.to(device) if t is not None else None for t in (kv, gate, pos, slots, table, cos, sin)]
    kv, gate, pos, slots, table, cos, sin = dev
    runs = []
    for fused in (True, False):
        st = [t.clone().to(device) if t is not None else None for t in state + [pool]]
        args = (kv, gate, pos, slots, table, *st)
        with torch.no_grad():
            count = (compress_decode(*args, comp.ape, comp.norm.weight, comp.norm.eps, cos, sin) if fused else
                     compress_step_ref(comp, *args, cos, sin))
        runs.append((count, st))
    (c1, s1), (c2, s2) = runs
    out = {"count": int((c1 != c2).sum()),
           # block 0 is scratch: the twin writes there for sequences that complete no window
           "pool": (s1[4][1:].float() - s2[4][1:].float()).abs().max().item(),
           "pool_ref_scale": s2[4][1:].float().abs().max().item()}
    for name, a, b in zip(("buf_kv", "buf_gate", "prev_kv", "prev_gate"), s1[:4], s2[:4]):
        if a is not None:
            out[name] = (a - b).abs().max().item()
    return out


SAMPLE_FILTERS = {"plain": [{}],
                  # every filtered row with a top-k: filter_threshold's torch.topk of the largest k (some rows plain)
                  "top_k": [{"top_k": 5}, {}, {"top_k": 40, "top_p": 0.7}, {"top_k": 1}],
                  # a row with top-p alone: the sort of the vocabulary
                  "top_p": [{"top_p": 0.9}, {"top_k": 7}, {}, {"top_p": 0.3, "top_k": 50}, {"top_p": 1e-6}]}


def sample_case(device, B: int, V: int, seed: int = 0, dtype=torch.float32,
                filters: str = "plain") -> tuple[int, float]:
    """rollout_server.sample's one-pass kernel against its torch path, greedy rows and temperatures mixed, logits
    in dtype (the kernel reads bf16 as it is, the torch path in fp32); filters: SAMPLE_FILTERS' top-k / top-p rows
    (the kernel given filter_threshold's thresholds). -> (rows whose token differs, max log-prob difference)."""
    from rollout_server import SamplingParams, sample
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(device, dtype)
    logits[0, V // 3] = 100.0  # row 0 is greedy: a clear winner
    extra = SAMPLE_FILTERS[filters]
    params = [SamplingParams(temperature=t, **extra[i % len(extra)])
              for i, t in enumerate(([0.0, 1.0, 0.7, 1.3] * B)[:B])]
    seeds = torch.randint(0, 2 ** 62, (B,), generator=g).tolist()
    steps = list(range(3, 3 + B))
    t1, l1 = sample(logits, params, seeds, steps)
    t2, l2 = sample(logits, params, seeds, steps, fused=False)
    return int((t1 != t2).sum()), (l1 - l2).abs().max().item()


def threshold_case(device, B: int, V: int, dtype=torch.float32, seed: int = 0, **kernel) -> int:
    """rollout_server.filter_threshold's search (kernels.sample.threshold, given `kernel`'s options where any)
    against its torch twin (the sort): logits in dtype, peaked and flat rows, temperatures (greedy rows too),
    top-k / top-p / both / neither, a top-k past V, ties at the edge. -> rows whose thresholds differ."""
    from kernels.sample import threshold
    from rollout_server import _scaled, filter_threshold
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(B)
    flat = torch.tensor([0.1, 1.0, 4.0])[i % 3]  # flat to peaked rows, each with every mode below over 12 rows
    logits = (torch.randn(B, V, generator=g) * flat[:, None] * (0.5 + torch.rand(B, 1, generator=g))).to(dtype)
    logits[1::5, V // 2:] = logits[1::5, :V - V // 2]  # every value twice: ties at any edge
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 2.0])[i % 5]
    mode = i % 4  # top-p alone, top-k alone, both, neither
    top_k = torch.where((mode == 1) | (mode == 2), torch.randint(1, 60, (B,), generator=g), 0)
    top_p = torch.where(mode % 2 == 0, 0.05 + 0.94 * torch.rand(B, generator=g), torch.ones(B))
    if B > 5:
        top_k[5] = V + 5  # keeps every token
    logits, temps, top_k, top_p = (t.to(device) for t in (logits, temps, top_k, top_p))
    a = threshold(logits, temps, top_k, top_p, **kernel) if kernel else filter_threshold(logits, temps, top_k, top_p)
    b = filter_threshold(logits, temps, top_k, top_p, fused=False)
    # the two sum the probabilities in different orders: a row may part where the mass before a token is within
    # rounding of top_p (flat rows of 129,280 tokens: ~1e-5 each); such rows are not counted
    scaled = _scaled(logits, temps)
    srt = scaled.sort(-1, descending=True).values
    p = (srt - scaled.logsumexp(-1, keepdim=True)).exp()
    before = p.double().cumsum(-1) - p.double()
    bad = 0
    for r in (a != b).nonzero()[:, 0].tolist():
        n = sorted(int((scaled[r] >= t).sum()) for t in (a[r], b[r]))
        edge = n[0] > 0 and (before[r, n[0] - 1:n[1]] - float(top_p[r])).abs().max() < 1e-5 * max(1, n[1] - n[0])
        bad += not (edge and top_p[r] < 1)
    return bad


def moe_align_case(device, T: int, k: int, n_experts: int, absent: float = 0.0, seed: int = 0,
                   n_shared: int = 0) -> bool:
    """kernels.moe.moe_align's kernel against its torch twin (fused=False), with a fraction `absent` of
    slots routed to another rank ("not here" = n_experts) and n_shared shared experts (the last ones, every
    token's). -> whether both outputs are identical."""
    from kernels import moe
    g = torch.Generator().manual_seed(seed)
    routed = n_experts - n_shared
    ids = torch.stack([torch.randperm(routed, generator=g)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    ids = torch.where(torch.rand(ids.shape, generator=g) < absent, torch.full_like(ids, n_experts), ids).to(device)
    slots, bexp = moe.moe_align(ids, n_experts, n_shared=n_shared)
    s2, b2 = moe.moe_align(ids, n_experts, fused=False, n_shared=n_shared)
    return torch.equal(slots, s2) and torch.equal(bexp, b2)


def route_case(device, M: int, D: int, E: int, k: int, score_func: str, hashed: bool, norm: bool = True,
               seed: int = 0) -> tuple[int, float]:
    """kernels.fused.route against model.Gate's torch path on bf16 inputs, each also writing its ids as uint8 routing
    rows into a layer's column of an (M, 3, k) buffer. -> (tokens whose expert set differs or whose rows differ from
    its ids, or whose other columns changed; max difference of the weights, each matched to its expert id)."""
    from kernels import fused
    from model.model import Gate
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_experts_per_tok=k, n_routed_experts=E, scoring_func=score_func, hidden_size=D,
                          routed_scaling_factor=1.5, norm_topk_prob=norm, vocab_size=50,
                          is_hash_layer=lambda i: hashed)
    gate = Gate(cfg, 0)
    gate.weight.data = torch.randn(E, D, generator=g) * D ** -0.5
    if hashed:
        gate.tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)])
    else:
        gate.bias = torch.randn(E, generator=g) * 0.1
    gate = gate.to(device=device, dtype=torch.bfloat16)
    gate.bias = None if hashed else gate.bias.float()
    x = torch.randn(M, D, generator=g).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 50, (M,), generator=g).to(device)
    r1, r2 = (torch.full((M, 3, k), 255, dtype=torch.uint8, device=device) for _ in range(2))
    w1, i1 = fused.route(x, gate.weight, gate.bias, k, score_func, norm, 1.5, *((gate.tid2eid, ids) if hashed else ()),
                         rows=r1[:, 1])
    w2, i2 = gate(x, ids, rows=r2[:, 1])
    o1, o2 = i1.sort(-1), i2.sort(-1)
    bad = (o1.values != o2.values).any(-1)
    for r, i in ((r1, i1), (r2, i2)):
        bad |= (r[:, 1] != i.to(torch.uint8)).any(-1) | (r[:, 0::2] != 255).flatten(1).any(-1)
    bad = int(bad.sum())
    dw = (w1.gather(1, o1.indices) - w2.gather(1, o2.indices)).abs().max().item() if M else 0.0
    return bad, dw


def index_topk_case(device, B: int, S: int, k: int, seed: int = 0, ties: bool = False) -> bool:
    """kernels.attention.index_topk against its torch twin on rows with counts from 0 to S (distinct scores; ties:
    scores on a grid of halves, most of them tied, 0.0 and -0.0 among them, where both must also give a stable
    descending sort's order: equal scores in entry order). -> whether the selections are identical (entries, their
    order, the -1 padding)."""
    from kernels.attention import index_topk, index_topk_ref
    g = torch.Generator().manual_seed(seed)
    count = torch.randint(0, S + 1, (B,), generator=g)
    count[0], count[-1] = S, 0
    if B > 2:  # a row short of 3/4 of S (index_topk's chunked select past 1,024 entries) whatever the draws
        count[1] = S // 3 + 1
    sc = torch.randn(B, S, generator=g)
    if ties:
        sc = (sc * 2).round() / 2  # small negatives round to -0.0
        sc[:, ::7] = 0.0
        assert bool((sc == 0).logical_and(sc.signbit()).any()) and bool((sc == 0).logical_and(~sc.signbit()).any())
    sc = sc.masked_fill(torch.arange(S)[None] >= count[:, None], float("-inf"))
    got = index_topk(sc.to(device), k, count.to(device))
    ok = torch.equal(got, index_topk_ref(sc.to(device), k, count.to(device)))
    if ties:
        want = (sc + 0.0).sort(dim=-1, descending=True, stable=True).indices[:, :k]
        ok = ok and torch.equal(got.cpu(), torch.where(want < count[:, None], want, -1))
    return ok


def prefill_index_case(device, B: int, T: int, S: int, h: int, d: int, k: int, seed: int = 0) -> bool:
    """kernels.attention.prefill_index against prefill_index_ref: B sequences' T query rows, packed in a buffer of
    more rows in a shuffled order (the kernel reads them through rows), the head weights a strided column slice
    scaled in the call, causal counts (t + 1) // 4 capped at S; the last sequence's query rows all zero (every
    score 0.0: ties, which both must break to the lower entry). -> whether the picks agree: the same -1 places
    and, where the kernel's sums differ from torch's in the last bits, picks of the same reference scores."""
    from kernels.attention import prefill_index, prefill_index_ref
    g = torch.Generator().manual_seed(seed)
    N = B * T + 5
    qi = torch.randn(N, h, d, generator=g)
    rows = torch.randperm(N, generator=g)[:B * T].view(B, T)
    qi[rows[-1]] = 0.0
    wide = torch.randn(N, 3 * h, generator=g)
    keys = torch.randn(B, S, d, generator=g)
    count = ((torch.arange(T) + 1) // 4).clamp(max=S)
    args = [t.to(device) for t in (qi, wide[:, h:2 * h], rows, keys, count)]
    got = prefill_index(*args, k, h ** -0.5).cpu()
    want = prefill_index_ref(*args, k, h ** -0.5).cpu()
    if got.shape != want.shape or not torch.equal(got < 0, want < 0):
        return False
    sc = torch.einsum("bthd,bsd->bths", qi[rows], keys).relu() * d ** -0.5
    sc = torch.einsum("bths,bth->bts", sc, wide[:, h:2 * h][rows] * h ** -0.5)
    a, b = (sc.gather(-1, x.clamp(min=0)).masked_fill(x < 0, 0.0) for x in (got, want))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6)) and torch.equal(got[-1], want[-1])


def grad_case(fast, twin, inputs, seed: int = 0) -> float:
    """A differentiable kernel against its torch twin: outputs and the gradients of every input under the same
    random upstream gradient. -> the largest difference relative to the twin's largest magnitude, over all of
    them (so one number bounds forward and backward)."""
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    res = []
    for f in (fast, twin):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        y = f(*xs)
        gy = torch.randn(y.shape, generator=g).to(y)
        g.manual_seed(seed)
        res.append([y.detach()] + list(torch.autograd.grad(y, xs, gy)))
    for a, b in zip(*res):
        assert a.shape == b.shape, (a.shape, b.shape)
        if b.numel() == 0:
            continue
        worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item())
    return worst


def hc_cases(device, n: int, D: int, N: int, iters: int, dtype=torch.float32, seed: int = 0) -> dict:
    """kernels.mhc's hc_pre and hc_post against model._hc_pre / _hc_post (the torch twins computed in fp32 from the
    same inputs): grad_case's worst relative difference for each."""
    from kernels import mhc
    from model.model import _hc_post, _hc_pre
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, n, D, generator=g).to(device, dtype)
    fn = (torch.randn((2 + n) * n, n * D, generator=g) * D ** -0.5).to(device)
    base, sc = torch.randn((2 + n) * n, generator=g).to(device), (torch.rand(3, generator=g) + 0.5).to(device)

    def flat(outs):  # one tensor of every output, so grad_case gives all three their own upstream gradient
        return torch.cat([t.reshape(N, -1).float() for t in outs], 1)
    res = {"pre": grad_case(lambda *a: flat(mhc.hc_pre(*a, iters, 1e-6, 1e-6)),
                            lambda x, *a: flat(_hc_pre(x.float(), *a, iters, 1e-6, 1e-6)), [x, fn, base, sc], seed)}
    out = torch.randn(N, D, generator=g).to(device, dtype)
    _, post, comb = _hc_pre(x.float(), fn, base, sc, iters, 1e-6, 1e-6)
    res["post"] = grad_case(mhc.hc_post, lambda o, x, p, c: _hc_post(o.float(), x.float(), p, c),
                            [out, x, post, comb], seed)
    return res


def block_attention_case(device, B: int, nb: int, bq: int, W: int, H: int, d: int, S: int, cb: int,
                         dtype=torch.float32, seed: int = 0) -> float:
    """model._attend_blocks_fused (the Triton block softmax between cuBLAS GEMMs) against model._attend_blocks
    computed in fp32 from the same inputs, for q, the window keys, the compressed entries and the sinks: grad_case's
    worst relative difference. cb = 1 shares the compressed-entry mask across the batch (HCA), B gives one per row."""
    from model.model import _attend_blocks, _attend_blocks_fused
    g = torch.Generator().manual_seed(seed)
    K = bq + W
    t, c = torch.arange(bq)[:, None], torch.arange(K)
    starts = -W + bq * torch.arange(nb)
    allowed = (((c > t) & (c <= t + W)) & (starts[:, None, None] + c >= 0)).to(device)
    ins = [torch.randn(B, nb * bq, H, d, generator=g), torch.randn(B, nb, K, d, generator=g), torch.randn(H, generator=g)]
    ins = [x.to(device, dtype) for x in ins[:2]] + [ins[2].to(device)]
    ca = None
    if S:
        ins.append(torch.randn(B, S, d, generator=g).to(device, dtype))
        ca = (torch.rand(cb, nb * bq, S, generator=g) > 0.4).to(device)
    scale = d ** -0.5

    def fast(q, k, sink, *comp):
        return _attend_blocks_fused(q, k, allowed, comp[0] if comp else None, ca, sink, scale)

    def twin(q, k, sink, *comp):
        return _attend_blocks(q.float(), k.float(), allowed, comp[0].float() if comp else None, ca, sink, scale)
    return grad_case(fast, twin, ins, seed)


def logprob_case(device, n: int, D: int, V: int, temperature: float, chunk: int, dtype=torch.float32,
                 seed: int = 0) -> float:
    """kernels.logprob.head_logprob (the head's GEMMs and the log-prob/entropy kernel, `chunk` rows at a time;
    backward through the log-probs to the hidden states and the head's weight) against its torch twin,
    model._chunk_logprobs on the fp32 logits of the same inputs. -> the worst relative difference of log-probs,
    entropy and gradients."""
    from kernels.logprob import head_logprob
    from model.model import _chunk_logprobs
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g).to(device, dtype)
    w = (torch.randn(V, D, generator=g) * 3 * D ** -0.5).to(device, dtype)
    tgt = torch.randint(0, V, (n,), generator=g).to(device)
    ents = []

    def fast(h, w):
        lp, e = head_logprob(h, w, tgt, temperature, chunk)
        ents.append(e.sum())
        return lp

    def twin(h, w):
        lp, e = _chunk_logprobs(h.float() @ w.float().t(), tgt, temperature)
        ents.append(e)
        return lp
    err = grad_case(fast, twin, [h, w], seed)
    return max(err, (abs(ents[0] - ents[1]) / abs(ents[1]).clamp_min(1e-30)).item())


def combine_case(device, N: int, k: int, D: int, dtype=torch.float32, seed: int = 0) -> float:
    """kernels.moe.combine_rows against model._combine (gather, product, k-sum in torch, computed in fp32), for
    the experts' outputs and the router weights: grad_case's worst relative difference."""
    from kernels.moe import combine_rows
    from model.model import _combine, inverse
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(N * k, generator=g).to(device)
    ins = [torch.randn(N * k, D, generator=g).to(device, dtype), torch.rand(N, k, generator=g).to(device)]
    return grad_case(lambda ys, w: combine_rows(ys, inverse(order), w),
                     lambda ys, w: _combine(ys.float(), order, w), ins, seed)


def to_host_case(device) -> bool:
    """kernels.sample.to_host three times over (int64, fp32, uint8 and an empty source): each call's copies land in
    row calls % 2 of the host bytes (pinned where the device is a GPU), the other row keeps the call before's, the
    count reaches 3 and the ticket is back to 0. -> whether all of that held."""
    from kernels.sample import host_rows, to_host
    pin = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(0)
    ctr = torch.zeros(2, dtype=torch.int32, device=device)
    like = [torch.zeros(5, dtype=torch.int64), torch.zeros(5), torch.zeros(5, 1500, 2, dtype=torch.uint8),
            torch.zeros(0)]
    hosts = [torch.zeros(2, t.nbytes, dtype=torch.uint8, pin_memory=pin) for t in like]
    sent, ok = [], True
    for call in range(3):
        srcs = [torch.randint(-2 ** 40, 2 ** 40, (5,), generator=g), torch.randn(5, generator=g),
                torch.randint(0, 256, (5, 1500, 2), generator=g).to(torch.uint8), torch.zeros(0)]
        to_host(ctr, [s.to(device) for s in srcs], hosts)
        if pin:
            torch.cuda.synchronize()
        sent.append(srcs)
        for back, row in ((0, call % 2), (1, (call - 1) % 2)):
            if call - back >= 0:
                ok &= all(torch.equal(host_rows(h, row, t), s) for h, t, s in zip(hosts, like, sent[call - back]))
    return ok and ctr.tolist() == [3, 0]


# (rows, D, RoPE half, offsets, windows, block-table widths): masked and multi-chunk rows, no / one / two tables
STEP_INPUTS_CASES = ((5, 40, 5, (1, 4, 7), (8, 5), (3, 300)), (1, 2100, 32, (1,), (128,), (17,)),
                     (4, 64, 32, (1, 4, 128), (), ()), (0, 16, 4, (1, 2), (3,), (5, 6)),
                     (33, 128, 8, (), (7,), (2, 700)))


def step_inputs_case(device, n: int, D: int, half: int, offsets, windows, cols) -> bool:
    """kernels.step.step_inputs against its torch twin: rows that take their id from the previous step's tokens
    and rows that take it from the input, positions near 0 (where pos + 1 - r clamps), block tables of widths cols
    (0-2 of them). -> whether every output has the same values, dtype and shape."""
    from kernels.step import step_inputs, step_inputs_ref
    g = torch.Generator().manual_seed(n * 31 + D)
    V, P, S, hc = 50, 40, 9, 3
    inp = torch.zeros(7, n, dtype=torch.int64)
    inp[0] = torch.randint(0, V, (n,), generator=g)
    inp[1] = torch.randint(0, P, (n,), generator=g)
    inp[1, : n // 2] = torch.arange(n // 2) % 3  # (small positions: the offsets' clamp)
    inp[2] = torch.randint(0, S, (n,), generator=g)
    inp[6] = torch.where(torch.rand(n, generator=g) < 0.5, -1, torch.randint(0, 8, (n,), generator=g))
    tok = torch.randint(0, V, (8,), generator=g)
    emb = torch.randn(V, D, generator=g).to(torch.bfloat16)
    main, comp = torch.randn(2, P, half, generator=g), torch.randn(2, P, half, generator=g)
    tables = [torch.randint(-1, 1000, (S, c), generator=g) for c in cols]
    args = [t.to(device) for t in (inp, tok, emb)] + [hc] + [main.to(device), comp.to(device), offsets, windows,
                                                            [t.to(device) for t in tables]]
    got, want = step_inputs(*args), step_inputs_ref(*args)
    flat = [*got[:4], *got[4]], [*want[:4], *want[4]]
    return len(got[4]) == len(cols) and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
                                            for a, b in zip(*flat))


def prefill_attention_case(device, H: int = 4, d: int = 32, seed: int = 0):
    """Two sequences' query rows in linear buffers, as the engine's prefill lays them out: a new prompt (positions
    0-19, its keys from row 0) and a later chunk of another (positions 30-41, after its 7 cached window keys: keys
    of positions 23-41 from row 20), with 5 and 10 entries; sel: picks among each row's entries (-1 padded).
    For a window of 8. -> q, keys, base, pos, sink, entries, first, sel, count."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(20), torch.arange(30, 42)])
    base = torch.tensor([0] * 20 + [20 - 23] * 12)
    first = torch.tensor([0] * 20 + [5] * 12)
    q, keys = torch.randn(32, H, d, generator=g), torch.randn(39, d, generator=g)
    entries = torch.randn(15, d, generator=g)
    count = torch.minimum((pos + 1) // 4, torch.tensor([5] * 20 + [10] * 12))
    sel = torch.full((32, 6), -1)
    for n in range(32):
        pick = torch.randperm(int(count[n]), generator=g)[:4]
        sel[n, :len(pick)] = pick
    ts = (q, keys, base, pos, torch.randn(H, generator=g), entries, first, sel, count)
    return tuple(t.to(device) for t in ts)
