"""Bad inputs and misuses a new user tried (issue 21, point 5): each ends in one line that names the key or
file at fault (`config error: …` exit 2 for input, `error: …` exit 1 for a runtime fault, 130 for Ctrl-C),
leaves nothing half-written, and never reports NaN or a truncated result as ok.

One small checkpointed run (2 steps from a `model.init_from` directory) is shared by the export, resume and
compare cases; most cases stop at validation and take a second or two through the warm CLI.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, assert_ok, cli_env, run_cli
from tests.test_hf import write_hf_checkpoint

# FAST without its step count; warmup 0, so a short run prints no warmup warning beside the line under test.
QUICK = [a for a in FAST if not a.startswith("training.steps")] + ["optimizer.warmup_steps=0"]
EXPORT = "qwen3_research.export"


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def one_line(proc, status: int, start: str) -> str:
    """stderr is exactly one line, starting with ``start``, and the exit status is ``status``."""
    got = lines(proc.stderr)
    assert proc.returncode == status and len(got) == 1 and got[0].startswith(start), (
        f"exit {proc.returncode} (want {status}), want one line starting {start!r}\nSTDOUT:\n{proc.stdout[-3000:]}"
        f"\nSTDERR:\n{proc.stderr[-3000:]}")
    print(f"exit {proc.returncode}: {got[0]}")
    return got[0]


def tree(path: Path) -> dict[str, tuple]:
    """Every file under ``path``: its size, mtime and (for files below 1 MiB) its bytes."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns, p.read_bytes() if st.st_size < 2**20 else None)
    return out


def linked_copy(src: Path, dst: Path) -> Path:
    """A copy of a run directory whose files are hard links (checkpoints are ~240 MB each)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("base") / "qwen3_tiny", moe=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_model):
    """A 2-step run from model.init_from with checkpoints of steps 1 and 2, and what it printed."""
    run = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli(QUICK + ["training.steps=2", "checkpoint.enable=true", "checkpoint.every=1",
                            f"model.init_from={base_model}"], run_dir=run)
    assert_ok(proc)
    return run, proc


# -- BAD cases: one test each -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_disk_full_during_export_leaves_nothing_behind(trained, tmp_path):
    """The export fills a small file system: one line, the partial export removed (the space is free again),
    an earlier export in out_dir (replaced with --force) byte-identical."""
    run, _ = trained
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)):
        pytest.skip("this machine does not allow mounting a small tmpfs")
    try:
        out = mnt / "hf"
        out.mkdir()
        (out / "README.md").write_text("an earlier export\n")
        before = tree(mnt)
        proc = run_cli([str(run / "checkpoints"), str(out), "--force"], module=EXPORT, timeout=300)
        line = one_line(proc, 1, f"error: HF export {out}: No space left on device")
        assert "the partial export was removed" in line and "point out_dir elsewhere" in line
        assert tree(mnt) == before  # no .hf.tmp-export left, the earlier export untouched
        assert shutil.disk_usage(mnt).used < 2**20  # the disk does not stay full
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_fifo_in_the_data_glob_is_refused_by_name(tmp_path):
    """Reading a FIFO blocks until something writes to it: the run hung with no output."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("to be or not to be, that is the question " * 40)
    os.mkfifo(corpus / "b.txt")
    proc = run_cli(QUICK + ["training.steps=1", "data=files", f"data.files={corpus}/*.txt"], run_dir=tmp_path / "r",
                   timeout=120)
    one_line(proc, 2, f"config error: data.files='{corpus}/*.txt' matches {corpus}/b.txt, which is a FIFO (named pipe), "
                      "not a regular file")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("seed, status", [("-1", 2), ("99999999999999999999", 2), (str(2**63 - 1), 0)],
                         ids=["negative", "huge", "largest"])
def test_a_seed_out_of_range_names_the_key_and_the_range(tmp_path, seed, status):
    """-1 failed in numpy's seeding (169 lines), a huge one in torch's (68); the largest valid one trains."""
    proc = run_cli(QUICK + ["training.steps=1", f"training.seed={seed}"], run_dir=tmp_path / "r")
    if status == 0:
        assert_ok(proc)
        return
    one_line(proc, 2, f"config error: training.seed must be in [0, {2**63 - 1}] (0 … 2**63 - 1), got {seed}")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, module", [
    ("device.memory_gib=nan", "qwen3_research.plan"),  # said "fits with headroom (nan % of capacity)", exit 0
    ("optimizer.lr=nan", "qwen3_research"),  # crashed in AdamW, 44 lines
    ("optimizer.eps=nan", "qwen3_research"),
    ("optimizer.weight_decay=nan", "qwen3_research"),  # trained, then blamed the learning rate
    ("optimizer.betas=[0.9,inf]", "qwen3_research"),  # inf too, inside a list
])
def test_nan_or_inf_is_never_a_valid_number(tmp_path, override, module):
    args = QUICK + ["training.steps=1", override]
    proc = run_cli(args, run_dir=tmp_path / "r") if module == "qwen3_research" else run_cli(args, module=module)
    key, value = override.split("=")
    shown = f"{key}[1]=inf" if value.startswith("[") else f"{key}={value}"
    one_line(proc, 2, f"config error: {shown} is not a finite number; every numeric key needs one (no nan or inf)")
    assert not (tmp_path / "r").exists()


SIGINT_IN_NUMPY = '''
import os, signal, sys

class SigintWhileNumpyImports:
    """Ctrl-C at the first numpy submodule import: inside numpy's import, wherever that happens."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("numpy.") and not os.path.exists(os.environ["MARKER"]):
            open(os.environ["MARKER"], "w").write(name)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintWhileNumpyImports())
'''


def test_ctrl_c_while_numpy_imports_exits_130_with_one_line(tmp_path):
    """torch's C start-up imports numpy and clears any error raised inside (a KeyboardInterrupt too): the Ctrl-C was
    lost, and the run went on or failed later with "module 'numpy' has no attribute 'matrix'" (exit 1, 58 lines).
    A cold process (the warm server has numpy loaded), the SIGINT sent from inside numpy's import by an import hook."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGINT_IN_NUMPY)
    marker = tmp_path / "fired"
    run = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "qwen3_research", *QUICK, "training.steps=1", f"hydra.run.dir={run}"],
                          cwd=ROOT, env=cli_env(PYTHONPATH=str(hook), MARKER=str(marker)), capture_output=True,
                          text=True, timeout=300)
    assert marker.exists(), "the hook never saw numpy import"
    print(f"SIGINT while importing {marker.read_text()}")
    one_line(proc, 130, "interrupted by SIGINT before training started; nothing was written")
    assert not run.exists()


# -- WEAK cases: one line each ------------------------------------------------------------------------------------
# Each case returns (result, exit status, the lines to look at, how the single one starts).


def _compare_with(run: Path, tmp: Path, edit) -> tuple:
    copy = linked_copy(run, tmp / "run")
    metrics = copy / "metrics.jsonl"
    data = metrics.read_bytes()
    metrics.unlink()  # a hard link: write a new file, not through to the shared run's
    metrics.write_bytes(edit(data))
    proc = run_cli([str(copy), "--out", str(tmp / "cmp")], module="qwen3_research.compare")
    return proc, 3, lines(proc.stderr), f"warning: {metrics} "


def _resume_read_only(run: Path, base: Path, tmp: Path) -> tuple:
    copy = linked_copy(run, tmp / "copy")
    ro = tmp / "ro"
    ro.mkdir()
    if not (mount("--bind", str(copy), str(ro)) and mount("-o", "remount,bind,ro", str(ro))):
        pytest.skip("this machine does not allow a read-only bind mount")
    try:
        proc = run_cli(QUICK + ["training.steps=3", "checkpoint.enable=true", "checkpoint.resume=auto",
                                f"model.init_from={base}"], run_dir=ro)
    finally:
        subprocess.run(["umount", str(ro)])
    return proc, 2, lines(proc.stderr), f"config error: hydra.run.dir={ro}: {ro} is on a read-only file system"


def _read_only_run_dir(tmp: Path) -> tuple:
    mnt = tmp / "ro"
    mnt.mkdir()
    if not mount("-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)):
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        proc = run_cli(QUICK + ["training.steps=1"], run_dir=mnt / "run")
    finally:
        subprocess.run(["umount", str(mnt)])
    return proc, 2, lines(proc.stderr), f"config error: hydra.run.dir={mnt}/run: {mnt} is on a read-only file system"


def _resume_with_another_base(run: Path, base: Path, tmp: Path) -> tuple:
    copy = linked_copy(run, tmp / "run")
    other = linked_copy(base, tmp / "other_base")
    before = tree(copy)
    proc = run_cli(QUICK + ["training.steps=3", "checkpoint.enable=true", "checkpoint.resume=auto",
                            f"model.init_from={other}"], run_dir=copy)
    assert tree(copy) == before  # .hydra/config.yaml still names the base model the weights came from
    return proc, 2, lines(proc.stderr), (f"config error: checkpoint.resume=auto: {copy}/checkpoints/step-00000002 was "
                                         f"trained from model.init_from='{base}', but this run sets model.init_from=")


def _moved_base(base: Path):
    """The base model directory moved away while the case runs (put back afterwards)."""
    class Moved:
        def __enter__(self):
            self.to = base.with_name(base.name + "_moved")
            os.rename(base, self.to)
            return self.to

        def __exit__(self, *exc):
            os.rename(self.to, base)

    return Moved()


def _export_moved_base(run: Path, base: Path, tmp: Path) -> tuple:
    with _moved_base(base):
        proc = run_cli([str(run / "checkpoints"), str(tmp / "hf")], module=EXPORT)
    assert not (tmp / "hf").exists()
    return proc, 2, lines(proc.stderr), (f"config error: checkpoint {run}/checkpoints/step-00000002 was trained from "
                                         f"model.init_from='{base}', which is no longer a directory")


def _export_names_its_step(run: Path, base: Path, tmp: Path) -> tuple:
    with _moved_base(base) as moved:
        proc = run_cli([str(run / "checkpoints"), str(tmp / "hf"), "--init-from", str(moved)], module=EXPORT,
                       timeout=300)
    assert_ok(proc)
    assert json.loads(lines(proc.stdout)[-1])["step"] == 2
    assert (tmp / "hf" / "config.json").is_file() and not list(tmp.glob(".hf.tmp-export*"))
    return proc, 0, [ln for ln in lines(proc.stdout) if ln.startswith("export:")], \
        f"export: step 2 of {run}/checkpoints/step-00000002 -> {tmp}/hf"


def _export_pruned_meanwhile(run: Path, base: Path, tmp: Path) -> tuple:
    """step-2 is removed after the export chose it and before it read it: the export is held at the read of
    --init-from's config.json, a FIFO, until the test has removed step-2 and written the file's contents."""
    ckpts = linked_copy(run / "checkpoints", tmp / "checkpoints")
    held = tmp / "base"
    held.mkdir()
    os.mkfifo(held / "config.json")
    result = {}
    worker = threading.Thread(target=lambda: result.update(proc=run_cli([str(ckpts), str(tmp / "hf"), "--init-from",
                                                                         str(held)], module=EXPORT, timeout=300)))
    worker.start()
    fd = None
    while fd is None and worker.is_alive():  # the export has opened the FIFO for reading (ENXIO until then)
        try:
            fd = os.open(held / "config.json", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.02)
    if fd is not None:
        shutil.rmtree(ckpts / "step-00000002")  # what a running run's checkpoint.keep does
        os.replace(held / "config.json", held / "config.json.fifo")  # a later read gets the regular file
        shutil.copyfile(base / "config.json", held / "config.json")
        os.set_blocking(fd, True)
        os.write(fd, (base / "config.json").read_bytes())
        os.close(fd)
    worker.join(300)
    proc = result["proc"]
    assert fd is not None, f"the export never read --init-from's config.json\n{proc.stderr[-2000:]}"
    return proc, 2, lines(proc.stderr), (f"config error: checkpoint {ckpts}/step-00000002 was removed while it was being "
                                         f"exported (a running run prunes its older checkpoints: checkpoint.keep); "
                                         f"export again: the newest is now {ckpts}/step-00000001")


def _export_at_run_end_fails(tmp: Path) -> tuple:
    """checkpoint.export_hf=true whose verification fails (two tensors swapped by the test hook): one error line
    (was: a traceback), exit 1, no temporary export left in the run dir."""
    run = tmp / "r"
    swap = "model.layers.0.self_attn.o_proj.weight,model.layers.1.self_attn.o_proj.weight"
    proc = run_cli(QUICK + ["training.steps=1", "checkpoint.enable=true", "checkpoint.export_hf=true"], run_dir=run,
                   env=cli_env(QWEN3_RESEARCH_TEST_SWAP_EXPORT=swap))
    assert not (run / "hf").exists() and not list(run.glob(".hf.tmp-export*"))
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    got = [ln for ln in lines(proc.stderr) if not ln.startswith("Loading weights")]  # transformers' reload progress bar
    return proc, 1, got, f"error: HF export {run}/hf: written tensors differ from the trained ones; worst model.layers.0"


def _ctrl_c_during_export(run: Path, tmp: Path) -> tuple:
    out = tmp / "hf"
    partial = tmp / ".hf.tmp-export"
    proc = subprocess.Popen([sys.executable, "-m", EXPORT, str(run / "checkpoints"), str(out)], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # while the files are being written
    stdout, stderr = proc.communicate(timeout=240)
    assert not partial.exists() and not out.exists()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done, 130, lines(stderr), "interrupted by SIGINT; nothing was exported (no partial files are left"


def _file_size_limit_during_save(tmp: Path) -> tuple:
    """ulimit -f below a checkpoint's size (the kernel's SIGXFSZ is ignored by Python: the write fails, EFBIG)."""
    limit = 50 * 2**20

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = tmp / "r"
    proc = subprocess.run([sys.executable, "-m", "qwen3_research", *QUICK, "training.steps=2", "checkpoint.enable=true",
                           "checkpoint.every=1", f"hydra.run.dir={run}"], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=300, preexec_fn=limited)
    assert "free space" not in proc.stderr  # the advice fits the cause
    assert not list((run / "checkpoints").iterdir())  # the partial save is gone
    return proc, 1, lines(proc.stderr), (f"error: checkpoint: cannot save step 1 to {run}/checkpoints (a file would "
                                         f"exceed this process's file-size limit ({limit} bytes, ulimit -f {limit // 1024}))")


def _doctor_hidden_gpus(tmp: Path) -> tuple:
    import torch

    proc = run_cli(["device=cuda"], module="qwen3_research.doctor", env=cli_env(CUDA_VISIBLE_DEVICES="garbage"))
    fixes = [ln for ln in lines(proc.stdout) if ln.startswith("- device:")]
    assert "install a CUDA build" not in proc.stdout or torch.version.cuda is None
    start = ("- device: this torch is a CPU-only build" if torch.version.cuda is None else
             "- device: CUDA_VISIBLE_DEVICES='garbage' names no GPU")
    return proc, 1, fixes, start


def _rendezvous_unreachable(tmp: Path) -> tuple:
    """Two nodes, the other one never there. The endpoint is a loopback address (127.0.0.2: this machine, so no
    traffic leaves it) that is not the literal 127.0.0.1 the config check refuses for several nodes; this process
    hosts the rendezvous and waits for a second node that never comes. A cold process: c10d's log level is read
    when torch loads."""
    import socket

    run = tmp / "r"
    with socket.socket() as sock:  # a free port of this machine
        sock.bind(("127.0.0.2", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "qwen3_research", *QUICK, "training.steps=1", "parallelism.nnodes=2",
                           "parallelism.nproc_per_node=1", f"parallelism.rdzv_endpoint=127.0.0.2:{port}",
                           "parallelism.rdzv_timeout_s=3", f"hydra.run.dir={run}"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    return proc, 1, lines(proc.stderr), f"error: the 2 nodes did not meet at 127.0.0.2:{port} within parallelism.rdzv_timeout_s=3"


def _jsonl_text(tmp: Path, value: str, kind: str) -> tuple:
    f = tmp / "docs.jsonl"
    f.write_text('{"text": ' + value + "}\n" + '{"text": "a real document"}\n' * 200)
    proc = run_cli(QUICK + ["training.steps=1", "data=files", f"data.files={f}"], run_dir=tmp / "r")
    return proc, 2, lines(proc.stderr), f"config error: data.text_field='text': {f} line 1 is {kind}"


def _config(tmp: Path, *overrides: str) -> tuple:
    proc = run_cli(QUICK + ["training.steps=1", *overrides], run_dir=tmp / "r")
    assert not (tmp / "r" / "summary.json").exists()
    return proc, 2, lines(proc.stderr)


WEAK = {
    "interpolation-loop": lambda t, r, b: (*_config(t, "training.steps=${training.steps}"),
                                           "config error: training.steps: Recursive interpolation detected"),
    # the fault hook left the schema for tests/hooks (QWEN3_TEST_FAULT; its syntax: test_a_malformed_fault_is_refused)
    "fault-key-removed": lambda t, r, b: (*_config(t, "training.fault=raise@1"),
                                          "config error: training.fault: unknown key"),
    "max-documents-0": lambda t, r, b: (*_config(t, "data.max_documents=0"),
                                        "config error: data.max_documents must be >= 1"),
    "val-fraction-0.99": lambda t, r, b: (*_config(t, "data.val_fraction=0.99"),
                                          "config error: data.val_fraction=0.99 holds out 38 of 38 documents"),
    "path-with-parentheses": lambda t, r, b: (*_config(t, "data=files", "data.files=/data/my docs (old)/*.txt"),
                                              "config error: data.files: Hydra cannot parse the value "
                                              "'/data/my docs (old)/*.txt' (mismatched input ' (' expecting <EOF>); "
                                              "quote it: 'data.files=\"/data/my docs (old)/*.txt\"'"),
    "path-split-by-the-shell": lambda t, r, b: (*_config(t, "data=files", "data.files=/data/my", "docs/*.txt"),
                                                "config error: 'docs/*.txt' is not an override; write key=value (e.g. "
                                                "training.steps=10) or group=option (e.g. model=native_moe); list them "
                                                "with --help; if it is the rest of data.files's value (the shell splits "
                                                "at spaces), quote the whole override: 'data.files=\"/data/my docs/*.txt\"'"),
    "compare-invalid-bytes": lambda t, r, b: _compare_with(r, t, lambda d: d + b'\xff\xfe{"step": 3}\n'),
    "compare-non-object-line": lambda t, r, b: _compare_with(r, t, lambda d: d + b"[1, 2, 3]\n"),
    "compare-truncated": lambda t, r, b: _compare_with(r, t, lambda d: d.splitlines(keepends=True)[0]),
    "export-names-its-step": lambda t, r, b: _export_names_its_step(r, b, t),
    "export-pruned-meanwhile": lambda t, r, b: _export_pruned_meanwhile(r, b, t),
    "export-max-shard-size": lambda t, r, b: (lambda p: (p, 2, lines(p.stderr), "config error: --max-shard-size: "
                                                         "'lots' is not a size"))(
        run_cli([str(r / "checkpoints"), str(t / "hf"), "--max-shard-size", "lots"], module=EXPORT)),
    "export-ctrl-c": lambda t, r, b: _ctrl_c_during_export(r, t),
    "export-at-run-end-fails": lambda t, r, b: _export_at_run_end_fails(t),
    "export-moved-init-from": lambda t, r, b: _export_moved_base(r, b, t),
    "save-file-size-limit": lambda t, r, b: _file_size_limit_during_save(t),
    "read-only-run-dir": lambda t, r, b: _read_only_run_dir(t),
    "resume-read-only-fs": lambda t, r, b: _resume_read_only(r, b, t),
    "resume-another-init-from": lambda t, r, b: _resume_with_another_base(r, b, t),
    "wandb-project-slash": lambda t, r, b: (*_config(t, "logging.wandb.project=team/qwen3", "logging.wandb.mode=offline"),
                                            "config error: logging.wandb.project='team/qwen3': a W&B project name"),
    "doctor-cuda-visible-devices": lambda t, r, b: _doctor_hidden_gpus(t),
    "rdzv-malformed": lambda t, r, b: (*_config(t, "parallelism.nproc_per_node=2", "parallelism.rdzv_endpoint=garbage:xx"),
                                       "config error: parallelism.rdzv_endpoint='garbage:xx' is not HOST:PORT"),
    "rdzv-not-this-host": lambda t, r, b: (*_config(t, "parallelism.nproc_per_node=2",
                                                    "parallelism.rdzv_endpoint=192.0.2.1:29500"),
                                           "config error: parallelism.rdzv_endpoint='192.0.2.1:29500': 192.0.2.1 is not "
                                           "an address of this host"),
    "rdzv-unreachable": lambda t, r, b: _rendezvous_unreachable(t),
    "jsonl-text-null": lambda t, r, b: _jsonl_text(t, "null", "null, not a string"),
    "jsonl-text-number": lambda t, r, b: _jsonl_text(t, "12345", "a number (12345), not a string"),
    "jsonl-text-list": lambda t, r, b: _jsonl_text(t, '["a", "b"]', 'a list (["a", "b"]), not a string'),
}
COLD = {"export-ctrl-c", "save-file-size-limit", "doctor-cuda-visible-devices", "rdzv-unreachable"}


def test_a_malformed_fault_is_refused():
    """The fault hook (tests/hooks) refuses a spec that is not WHAT@STEP[:rankR] before anything runs, both where a
    test asks for it (fault_env) and where an interpreter starts with it (install_from_environment)."""
    from tests.conftest import fault_env, hooks_env
    from tests.hooks import qwen3_test_hooks as hooks

    for bogus in ("bogus", "nan@0", "boom@2", "kill@2:1", "raise@"):
        with pytest.raises(ValueError, match=r"QWEN3_TEST_FAULT='.*' is not WHAT@STEP\[:rankR\]"):
            fault_env(bogus)
    assert [hooks.check_fault(s) for s in ("nan@2", "kill@4:rank1", "term@12", "oom@1", "raise@3:rank0")]
    proc = subprocess.run([sys.executable, "-c", "pass"], env=cli_env(**hooks_env(**{hooks.FAULT_ENV: "bogus"})),
                          capture_output=True, text=True, timeout=60)  # sitecustomize.py, as the interpreter starts
    assert proc.returncode == 2 and proc.stderr.startswith("test hook: QWEN3_TEST_FAULT='bogus' is not WHAT@STEP[:rankR]"), \
        proc.stderr


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in COLD else c for c in WEAK])
def test_weak_case_is_one_line(trained, base_model, tmp_path, case):
    proc, status, got, start = WEAK[case](tmp_path, trained[0], base_model)
    assert proc.returncode == status and len(got) == 1 and got[0].startswith(start), (
        f"exit {proc.returncode} (want {status}); want one line starting {start!r}, got {got}\n"
        f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}")
    print(f"{case}: exit {proc.returncode}: {got[0]}")


SIGINT_AFTER_EXPORT_MKDIR = '''
import os, pathlib, signal

_mkdir = pathlib.Path.mkdir


def mkdir(self, *args, **kwargs):
    """Ctrl-C the moment the export's temporary directory exists (once): the next bytecode raises it."""
    _mkdir(self, *args, **kwargs)
    if self.name.endswith(".tmp-export") and not os.path.exists(os.environ["MARKER"]):
        open(os.environ["MARKER"], "w").close()
        os.kill(os.getpid(), signal.SIGINT)


pathlib.Path.mkdir = mkdir
'''


def test_ctrl_c_right_after_the_export_makes_its_directory_leaves_nothing(trained, tmp_path):
    """The temporary export directory was made before the ``try`` that removes it on any exception: a Ctrl-C in
    between (the full suite's ``export-ctrl-c`` case once polled into it) left ``.hf.tmp-export`` behind. The
    signal is sent by a hook right after that ``mkdir``, not by a timer."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGINT_AFTER_EXPORT_MKDIR)
    marker, out = tmp_path / "fired", tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", EXPORT, str(trained[0] / "checkpoints"), str(out)], cwd=ROOT,
                          env=cli_env(PYTHONPATH=str(hook), MARKER=str(marker)), capture_output=True, text=True,
                          timeout=300)
    assert marker.exists(), "the hook never saw the export's mkdir"
    one_line(proc, 130, "interrupted by SIGINT; nothing was exported (no partial files are left")
    assert not (tmp_path / ".hf.tmp-export").exists() and not out.exists()


def test_a_checkpointed_run_prints_no_library_noise(trained):
    """torch's "torch.distributed is disabled … single process" UserWarning (with its source line, on every save)
    and torchtitan's "[root][INFO] - Total parameter count" (Hydra's console handler on the root logger) are gone;
    the INFO line is still in the run's log file."""
    run, proc = trained
    assert lines(proc.stderr) == [], proc.stderr
    assert not [ln for ln in lines(proc.stdout) if "[root]" in ln or "Warning" in ln], proc.stdout
    assert "Total parameter count" in (run / "__main__.log").read_text()
