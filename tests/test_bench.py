"""The benchmarks' own arithmetic (their GPU runs are in bench/; this is what they compute from the events)."""
import random

from bench.rollout import kernel_shares


def _busy(iv):
    total, cur = 0.0, None
    for s, e in sorted(iv):
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (0.0 if cur is None else cur[1] - cur[0])


def test_kernel_shares_count_overlap_once():
    # a (0-10) with b launched early under PDL (5-12), a side-stream kernel inside a (1-3), an idle gap, c (20-25)
    k = kernel_shares([("a", 0, 10), ("b", 5, 12), ("side", 1, 3), ("c", 20, 25)])
    assert k == {"side": [1, 2.0, 2.0], "a": [1, 10.0, 8.0], "b": [1, 7.0, 2.0], "c": [1, 5.0, 5.0]}
    rng = random.Random(0)
    for _ in range(200):  # the shares add up to the time some kernel ran, each within its own duration
        ev = [(f"k{rng.randrange(5)}", s, s + rng.uniform(0.1, 5)) for s in (rng.uniform(0, 50) for _ in range(30))]
        k = kernel_shares(ev)
        assert abs(sum(v[2] for v in k.values()) - _busy([(s, e) for _, s, e in ev])) < 1e-9
        assert all(0 <= v[2] <= v[1] + 1e-12 for v in k.values()) and sum(v[0] for v in k.values()) == 30
