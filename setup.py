"""Copies the top-level data folders into the wheel (moelab/_resources/...).

Everything else is in pyproject.toml. A source checkout or editable install reads the
folders in place (see moelab/_resources.py).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
RESOURCE_DIRS = ("evals", "predictors", "kernels")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.so", "build")


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for name in RESOURCE_DIRS:
            src = ROOT / name
            if src.is_dir():
                dst = Path(self.build_lib) / "moelab" / "_resources" / name
                if dst.exists():
                    shutil.rmtree(dst)
                shutil.copytree(src, dst, ignore=IGNORE)


setup(cmdclass={"build_py": BuildPyWithResources})
