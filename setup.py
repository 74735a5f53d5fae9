"""Package discovery for the fixed layout (DESIGN.md §2): the repository's top-level stages/,
kernels/, recipes/ and evals/ folders install under growtrain. Every package below each folder is found
by setuptools' own discovery, so a new subpackage cannot be left out of the wheel (one was:
growtrain.stages.operators, whose absence broke every command of an installed wheel)."""

from setuptools import find_packages, setup

ROOTS = {"growtrain": "growtrain", "growtrain.stages": "stages", "growtrain.kernels": "kernels", "growtrain.recipes": "recipes", "growtrain.evals": "evals"}

packages = []
for name, folder in ROOTS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
