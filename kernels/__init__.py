"""Triton kernels of the model and the rollout engine, each with its torch reference (the CPU path).

`kernels` is also the import name of the Hugging Face Hub's `kernels` distribution, which transformers (5.25 here;
it depends on it) imports as its layers load (`from kernels import CUDAProperties, ...`). Where this directory comes
first on sys.path (a script or pytest run from the repository's root) that import finds this package instead, and
`from transformers import DeepseekV4ForCausalLM` would fail. So a name this package lacks is looked up in the Hub
package, where that distribution is installed: its files join this package's path (after ours) and its `__init__`
runs here once, as it would have run as `kernels`. Without it, a missing name is an AttributeError.
"""
import importlib.metadata
import os

_hub_loaded = False


def _hub_init() -> str | None:
    """The installed Hub `kernels` distribution's `__init__.py`, or None: not installed, or the file is this one or
    a copy of it (a plain install of this project made before setup.py left it out of the wheel)."""
    try:
        init = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if not os.path.isfile(init):
        return None
    with open(init, "rb") as f, open(__file__, "rb") as g:
        return None if f.read() == g.read() else init


def __getattr__(name: str):
    global _hub_loaded
    if not name.startswith("__") and not _hub_loaded:
        _hub_loaded = True  # once, whatever it finds (its own imports below must not come back here)
        init = _hub_init()
        if init is not None:
            __path__.append(os.path.dirname(init))
            with open(init) as f:
                exec(compile(f.read(), init, "exec"), globals())
            if name in globals():
                return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
