"""Launching: how a run's processes start (the launch layer; ARCHITECTURE.md).

- ``elastic``: one process in place, or a worker group through PyTorch's elastic launcher (also each rank
  under torchrun, and each node of a Slurm job);
- ``slurm``: the checks before ``hydra/launcher=slurm`` (Hydra's submitit plugin) submits anything;
- ``sweep``: a multirun's plan of its points, resume, and end-of-sweep report (Hydra callback).
- ``repeats``: a sweep's points that are one run (the pipeline keys at pp=1), run once.

Adding a launcher: a ``conf/hydra/launcher/<name>.yaml`` (a Hydra launcher plugin's config), and, if it can
refuse a request before submitting, a preflight module here called from ``qwen3_research.__main__``.
"""
