"""Every Triton kernel a run launches, compiled for the GPUs we target (no GPU needed to compile).

Under TRITON_INTERPRET=1 the kernels run on the CPU, so a GPU-only failure (a construct the GPU compilers refuse,
an FP8 type one target lacks) shows up only on that GPU. `record(path)` notes each launch's specialization (the
kernel, its arguments' types, its constexprs and launch options) as the interpreter, or a GPU, runs it, and
writes them to path at exit; `compile_all(records, target)` compiles each for a GPU target with Triton's own
compilers, which run on the CPU: NVIDIA sm90 (H100 / H200) and AMD gfx942 (MI300X: FP8 pointers as
float8_e4m3fnuz, its FP8 type). A GPU run's records carry its own sizes (mini's tiles, say), for --resources.

The interpreter takes a few constexprs from the device (the CPU's values are not the GPUs'); on the targets they
are what a GPU launch passes: DEVICE_FLAGS below.

    python -m tests.launches RECORDS.json [sm90,gfx942] [--all] [--resources]   # compile a recorded run's launches

By default two launches of each kernel, argument types and non-integer constexprs (the flags that pick code paths)
are compiled, the first and the last recorded; --all compiles every recorded specialization (sizes too).
--resources: each target's registers a thread, and the kernels that spill to scratch memory.
"""
from __future__ import annotations

import atexit
import importlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

# constexprs a launch takes from its device: their values on GPUs (DYNAMIC: sizes as runtime values, so the caps
# the interpreter needs are 0; LIBDEVICE: libdevice's log; PDL: NVIDIA sm90's dependent launch, never ROCm's)
DEVICE_FLAGS = {"DYNAMIC": True, "LIBDEVICE": True, "SCAP": 0, "NCAP": 0, "S_C": 0, "NB_C": 0}
TARGETS = {"sm90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
# kernels.fp8_gemm.F32_DOT, the fp32 products' tensor-core passes, on each target (the CPU's is CUDA's)
F32_DOT = {"sm90": "tf32x3", "gfx942": "bf16x6"}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")


def _constexprs(fn) -> set[str]:
    """The parameters of a @triton.jit function annotated tl.constexpr (string annotations too)."""
    return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}


def spec(kernel, args, kwargs) -> dict:
    """One launch's specialization: {"kernel": "module:name", "signature": {arg: type or "constexpr"},
    "constexprs": {arg: value}, "attrs": {arg: key}, "options": {...}}; tensors by their element type, None and
    constexprs by value. As a GPU launch specializes its arguments (Triton's JIT): an integer 1 becomes a constexpr,
    and attrs notes "D" for a tensor whose address or an integer that is a multiple of 16 (the compilers then take
    16-byte vector loads and aligned strides) and "S" for a tensor whose storage fits 2 GB (AMD's buffer loads)."""
    import torch
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    for n, p in params.items():
        if n not in bound and p.default is not inspect.Parameter.empty:
            bound[n] = p.default
    const = _constexprs(fn)
    sig, consts, attrs, odd = {}, {}, {}, []
    for n in params:
        v = bound[n]
        ty, key = (None, None) if n in const or v is None else native_specialize_impl(BaseBackend, v, False, True,
                                                                                         True)
        if ty is None or ty == "constexpr":
            sig[n] = "constexpr"
            plain = isinstance(v, (bool, int, float, str, type(None)))
            consts[n] = v if plain else repr(v)
            odd += [] if plain else [n]
        else:
            sig[n] = ty
            key = (key or "") + ("S" if isinstance(v, torch.Tensor) and v.untyped_storage().size() < 2 ** 31 else "")
            if key:
                attrs[n] = key
    out = {"kernel": f"{fn.__module__}:{fn.__name__}", "signature": sig, "constexprs": consts, "attrs": attrs,
           "options": {k: kwargs[k] for k in OPTIONS if k in kwargs}}
    if odd:  # (compile_all reports such a launch as a failure, so the recorder gets extended, not skipped)
        out["unrecorded"] = odd
    return out


def record(path: str):
    """Note every launch's specialization from here on (each once), interpreted or compiled (a GPU run: its real
    sizes, for --resources on both targets); written to path at exit."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    seen = {}

    def noting(run):
        def launch(self, *args, grid, warmup, **kwargs):
            if not warmup:
                s = spec(self, args, kwargs)
                seen.setdefault(json.dumps(s, sort_keys=True), s)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        return launch
    InterpretedFunction.run = noting(InterpretedFunction.run)
    JITFunction.run = noting(JITFunction.run)

    def dump():
        with open(path, "w") as f:
            json.dump(list(seen.values()), f)
    atexit.register(dump)


def for_target(s: dict, target: str) -> dict:
    """A recorded specialization as a launch on `target` gives it (DEVICE_FLAGS; PDL on sm90 only; FP8 pointers
    in the target's FP8 type)."""
    sig, consts, opts = dict(s["signature"]), dict(s["constexprs"]), dict(s["options"])
    for n, v in DEVICE_FLAGS.items():
        if n in consts:
            consts[n] = v
    if "PDL" in consts:
        consts["PDL"] = opts["launch_pdl"] = target == "sm90"
    for n, v in consts.items():
        if v in F32_DOT.values():
            consts[n] = F32_DOT[target]
    if target == "gfx942":
        sig = {n: t.replace("fp8e4nv", "fp8e4b8") for n, t in sig.items()}
        opts.pop("maxnreg", None)
    return {**s, "signature": sig, "constexprs": consts, "options": opts}


def representatives(records: list[dict]) -> list[dict]:
    """The first and the last record of each kernel, argument types and non-integer constexprs (flags and modes):
    two of its sizes, so an integer that picks a path (a first pass, say) is seen both ways where the run did."""
    groups = {}
    for s in records:
        flags = {n: v for n, v in s["constexprs"].items() if isinstance(v, bool) or not isinstance(v, int)}
        groups.setdefault(json.dumps([s["kernel"], s["signature"], flags, s["options"]], sort_keys=True), []).append(s)
    return [x for g in groups.values() for x in (g[:1] if len(g) == 1 else [g[0], g[-1]])]


def _resources(kernel, target: str) -> dict:
    """A compiled kernel's registers a thread and the scratch (local) memory it spills to: sm90 from cuobjdump's
    resource usage of its cubin (Triton's own binary), gfx942 from the amdgcn's metadata (VGPRs)."""
    import re
    if target == "gfx942":
        a = kernel.asm["amdgcn"]
        get = (lambda pat: int((re.findall(pat, a) or [-1])[0]))
        return {"registers": get(r"\.vgpr_count:\s+(\d+)"), "spilled": get(r"\.vgpr_spill_count:\s+(\d+)"),
                "scratch_bytes": get(r"ScratchSize:\s+(\d+)")}
    import subprocess
    import tempfile
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        use = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"),
                              "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    get = (lambda key: int((re.findall(rf"{key}:(\d+)", use) or [-1])[0]))
    return {"registers": get("REG"), "spilled": None, "scratch_bytes": get("STACK") + max(0, get("LOCAL"))}


def compiled(t: dict, target: str):
    """One specialization (for_target's) compiled for target by Triton's own compiler -> its CompiledKernel (.asm
    holds the target's code: "ptx" / "cubin" or "amdgcn"). Its attrs as the target's backend reads them (records
    made before attrs were noted have none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    mod, name = t["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    gpu = GPUTarget(*TARGETS[target])
    parse = make_backend(gpu).parse_attr
    attrs = {(i,): parse(t["attrs"][n]) for i, n in enumerate(t["signature"]) if n in t.get("attrs", {})}
    return triton.compile(ASTSource(fn=fn, signature=t["signature"], constexprs=t["constexprs"], attrs=attrs),
                          target=gpu, options=t["options"])


def _compile(t: dict, target: str, resources: bool = False):
    """Compile one specialization for target -> (None, or the compiler's error; with `resources`, _resources'
    figures)."""
    if t.get("unrecorded"):
        return (f"constexprs {t['unrecorded']} hold values of types tests.launches.spec does not record "
                f"({', '.join(str(t['constexprs'][n]) for n in t['unrecorded'])}): extend it"), None
    try:
        k = compiled(t, target)
    except Exception as e:  # noqa: BLE001 (the compilers' errors are of many kinds; each is reported)
        return f"{type(e).__name__}: {str(e)[-1500:]}", None
    return None, (_resources(k, target) if resources else None)


def compile_all(records: list[dict], target: str, jobs: int | None = None, resources: list | None = None
                ) -> list[tuple[str, str]]:
    """Compile each record for target ("sm90" or "gfx942"), each distinct one once, over `jobs` processes (default:
    the CPUs) -> [(kernel and constexprs, the error)] of those that fail. resources: a list to append (kernel and
    constexprs, _resources' figures) of each compiled one to."""
    todo = {}
    for s in records:
        t = for_target(s, target)
        todo.setdefault(json.dumps(t, sort_keys=True), t)
    todo = list(todo.values())
    env = os.environ.pop("TRITON_INTERPRET", None)  # (the workers compile; an interpreter's kernels cannot)
    try:
        with ProcessPoolExecutor(jobs or os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
            outs = list(pool.map(_compile, todo, [target] * len(todo), [resources is not None] * len(todo)))
    finally:
        if env is not None:
            os.environ["TRITON_INTERPRET"] = env
    what = [f"{t['kernel']} {t['constexprs']} {t['options']}" for t in todo]
    if resources is not None:
        resources += [(w, r) for w, (_, r) in zip(what, outs) if r is not None]
    return [(w, e) for w, (e, _) in zip(what, outs) if e is not None]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    flags = {a for a in argv if a.startswith("--")}
    argv = [a for a in argv if not a.startswith("--")]
    if not argv or len(argv) > 2 or flags - {"--all", "--resources"}:
        raise SystemExit("usage: python -m tests.launches RECORDS.json [sm90,gfx942] [--all] [--resources]")
    records = json.load(open(argv[0]))
    chosen = records if "--all" in flags else representatives(records)
    failed = 0
    for target in (argv[1] if len(argv) > 1 else ",".join(TARGETS)).split(","):
        if target not in TARGETS:
            raise SystemExit(f"tests.launches: no target {target!r} (the targets: {', '.join(TARGETS)})")
        res = [] if "--resources" in flags else None
        bad = compile_all(chosen, target, resources=res)
        print(f"{target}: {len(records)} launches recorded, {len(chosen)} compiled, {len(bad)} failed")
        for what, err in bad:
            print(f"  {what}\n    {err}")
        failed += len(bad)
        if res is not None:  # the kernels that spill to scratch memory (a register file too small for their tiles)
            spill = sorted((r for r in res if r[1]["scratch_bytes"] > 0), key=lambda r: -r[1]["scratch_bytes"])
            print(f"  registers a thread up to {max((r['registers'] for _, r in res), default=0)}; "
                  f"{len(spill)} of {len(res)} use scratch memory" + (":" if spill else ""))
            for what, r in spill:
                print(f"    {r['scratch_bytes']} bytes, {r['registers']} registers"
                      + (f", {r['spilled']} spilled" if r["spilled"] is not None else "") + f": {what}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
