"""Run state: what a run keeps and where (the run-state layer; ARCHITECTURE.md).

- ``train_state``: ``TrainState``, what a checkpoint holds (model, optimizer, schedule, step, data progress, RNG);
- ``checkpoint``: distributed checkpoints of that state (save, keep, resume) and the resume refusals;
- ``rundir``: one owner and one history per run directory (lock, resume rules, W&B run id);
- ``sinks``: where metrics go (console, metrics.jsonl, W&B), built by one factory.
"""
