"""The wheel leaves out kernels/__init__.py. `kernels` is also the import name of the Hugging Face Hub's `kernels`
distribution (a dependency of transformers); a plain `pip install .` would write our `__init__.py` over its own in
site-packages and break transformers there. Without ours, its `__init__` stays, and our modules, in the same
folder, import as `kernels.<name>` all the same (where the Hub package is absent, `kernels` is a namespace
package). The checkout and editable installs keep kernels/__init__.py (see it for the other direction)."""
from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] != ("kernels", "__init__")]


if __name__ == "__main__":  # as pip's build backend runs it; tests/test_packaging.py imports BuildPy
    setup(cmdclass={"build_py": BuildPy})
