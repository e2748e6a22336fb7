"""The one thing pyproject.toml cannot say: the CUDA sources in the top-level kernels/csrc ship
inside the package as minisgl.device.kernels.csrc, where the JIT loader finds them."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["minisgl", "minisgl.*"]), "minisgl.device.kernels.csrc"],
    package_dir={"minisgl.device.kernels.csrc": "kernels/csrc"},
)
