"""Our top-level `kernels` package beside the Hugging Face Hub's (a dependency of transformers): each direction of
the name clash, from the checkout (kernels/__init__.py) and from an installed wheel (setup.py)."""
import importlib.metadata
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_imports_where_our_kernels_package_shadows_the_hubs():
    """transformers imports the Hub's `kernels` package as its layers load; run from the repository's root, `import
    kernels` finds ours. kernels/__init__.py then takes the Hub package's names from its files: both import, ours
    stays `kernels`, and a name neither has is still an AttributeError."""
    import kernels
    with pytest.raises(AttributeError, match="no_such_name"):
        kernels.no_such_name
    pytest.importorskip("transformers")
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the Hub's kernels distribution is not installed: nothing for ours to shadow")
    code = ("from transformers import DeepseekV4ForCausalLM\n"
            "import kernels, kernels.moe\n"
            "print(kernels.__file__, kernels.moe.__file__, kernels.CUDAProperties.__name__)")
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    init, moe, name = r.stdout.split()
    assert Path(init) == ROOT / "kernels" / "__init__.py" and Path(moe) == ROOT / "kernels" / "moe.py"
    assert name == "CUDAProperties"


def test_wheel_leaves_the_hubs_kernels_init_alone(tmp_path, monkeypatch):
    """setup.py's build_py, as a wheel build runs it: every module of model/ and kernels/ and the two scripts, but
    not kernels/__init__.py, which a plain install would write over the Hub package's own."""
    pytest.importorskip("setuptools")
    from setuptools.dist import Distribution
    monkeypatch.chdir(ROOT)
    build_py = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")["BuildPy"]
    dist = Distribution({"name": "dsv4-grpo", "packages": ["model", "kernels"],
                         "py_modules": ["train_grpo", "rollout_server"]})
    dist.script_name = "setup.py"
    cmd = build_py(dist)
    cmd.build_lib = str(tmp_path)
    cmd.finalize_options()
    cmd.run()
    built = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py")}
    want = {p.relative_to(ROOT).as_posix() for d in ("model", "kernels") for p in (ROOT / d).glob("*.py")}
    want |= {"train_grpo.py", "rollout_server.py"}
    assert built == want - {"kernels/__init__.py"}
    assert "kernels/moe.py" in built and "model/__init__.py" in built
