"""Peak live tensor bytes of one training step, by PyTorch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``).

Shared by the planner (``qwen3_research.plan``: one step traced on fake tensors) and a run
(``training.track_memory=true``: its second step, on real tensors, ``peak_live_bytes_per_rank`` in
summary.json), so the prediction and the measurement it is checked against count the same way.
"""

from __future__ import annotations

_CATEGORIES = (("Parameter", "params"), ("Gradient", "grads"), ("Optstate", "optimizer"),
               ("Activation", "activations"), ("Temp", "backward temps"), ("Buffer", "buffers"), ("Other", "other"))


def _snapshot_bytes(tracker) -> tuple[dict, int]:
    snap = tracker.get_tracker_snapshot("peak")
    cats = {name: 0 for _, name in _CATEGORIES}
    total = 0
    for dev_snap in snap.values():
        for key, name in _CATEGORIES:
            cats[name] += int(dev_snap.get(key, 0) or dev_snap.get(_enum_key(key), 0))
        total += int(dev_snap.get("Total", 0))
    return cats, total


def _enum_key(value: str):
    from torch.distributed._tools.mem_tracker import _MemRefType

    for member in _MemRefType:
        if member.value == value:
            return member
    return value


def peak_tracker():
    """PyTorch's MemTracker, keeping only the whole-rank peak.

    MemTracker updates a per-module peak after every operator by walking every module it has seen
    (a weak dictionary of ~10 per decoder layer) -- O(operators x modules), 73 % of an 11-minute
    4B trace. The whole-rank peak and its per-category snapshot are updated exactly as upstream
    does (``_update_peak_stats``, second loop); per-module peaks, which nothing here reads, are not.
    """
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class PeakTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True) -> tuple[int, int]:
            # Upstream hooks every parameter for its gradient, and register_hook refuses one that takes none (a
            # LoRA run's frozen base): the same hooks, on the parameters that get a gradient
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                def on_grad(grad) -> None:
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(on_grad), p.register_post_accumulate_grad_hook(lambda q: on_grad(q.grad)))
            return out

        def _pre_fw_hook(self, module, inputs) -> None:
            # A second forward of the root module in one tracked step (training.grad_accum > 1, a pipeline stage's
            # micro-batches) is refused upstream ("multiple iterative calls"; fix: reset_mod_stats). Only this root's
            # own stats are dropped, which nothing here reads: clearing every module's (reset_mod_stats) broke the
            # backward of another root still pending (a looped pipeline schedule: rank 0 runs stage 2's second
            # forward before stage 0's backwards, whose modules' hooks then find no stats). The whole-rank peak
            # below spans every micro-batch.
            if not self._mod_tracker.is_bw and module in self.memory_tracking and \
                    set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                # Each category's own largest value over the step too: FSDP's gathered parameters peak at a
                # point where the whole rank may not (the plan and the run compare them: tests/test_precision.py).
                top = self.__dict__.setdefault("category_max", {})
                for key, value in dev_snap.items():
                    if key != _TOTAL_KEY and value > top.get(key, 0):
                        top[key] = value
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)  # ints: a shallow copy is upstream's deepcopy

    return PeakTracker()


def tracked(step_fn, model, optimizer) -> tuple:
    """``step_fn()`` under the peak tracker, with ``model`` and ``optimizer`` as known owners of their tensors:
    (its result, bytes per category at the peak, peak bytes, each category's largest bytes over the step)."""
    tracker = peak_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        result = step_fn()
    top = getattr(tracker, "category_max", {})
    most = {name: int(top.get(key, 0) or top.get(_enum_key(key), 0)) for key, name in _CATEGORIES}
    return (result, *_snapshot_bytes(tracker), most)


def track_step(step_fn, model, optimizer, world_size: int = 1, categories: list | None = None):
    """Run ``step_fn`` (one training step) under the peak tracker; return (its result, peak bytes per rank).

    Collective when the run has several ranks (every rank calls it at the same step). ``categories``: a list that
    receives, per rank, ``{"at_peak": bytes by category at that rank's peak (the rows qwen3_research.plan prints),
    "max": each category's largest bytes over the step}``.
    """
    result, cats, peak, most = tracked(step_fn, model, optimizer)
    rows = gather_objects((peak, {"at_peak": cats, "max": most}), world_size)
    if categories is not None:
        categories[:] = [c for _, c in rows]
    return result, [p for p, _ in rows]


def gather_objects(obj, world_size: int) -> list:
    """Every rank's ``obj`` (picklable), in rank order: ``all_gather_object`` over the default process group
    (collective: every rank calls it), ``[obj]`` in a one-process run."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    rows = [None] * world_size
    dist.all_gather_object(rows, obj)
    return rows
