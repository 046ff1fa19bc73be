"""Only what pyproject.toml cannot say: the config tree at the repository root, ``conf/``, installs as the package
``qwen3_research.conf`` (a wheel, ``pip install .`` and an editable install all carry it; its YAML is package-data
in pyproject.toml). ``[tool.setuptools.package-dir]`` could map the folder, but ``packages.find`` only finds folders
under their own name, and a fixed ``packages`` list would have to name every new sub-package by hand."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["qwen3_research", "qwen3_research.*"], exclude=["*.__pycache__"]),
              "qwen3_research.conf"],
    package_dir={"qwen3_research.conf": "conf"},
)
