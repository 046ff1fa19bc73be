"""The test hooks of tests/hooks/qwen3_test_hooks.py, in every interpreter a CLI test starts.

A test puts this folder on PYTHONPATH (tests/conftest.py: ``hooks_env``, ``fault_env``); Python imports this file
as an interpreter starts (``site``), and so do the warm server's children (tests/warm_cli.py), the ranks a run
spawns and torchrun's workers, which inherit the environment. It wraps parts of qwen3_research from outside when
the environment asks for a hook, and does nothing otherwise."""

import os
import sys

import qwen3_test_hooks

try:
    qwen3_test_hooks.install_from_environment()
except ValueError as e:  # a test's own mistake: stop here (site would print it and run on without the hook)
    print(f"test hook: {e}", file=sys.stderr, flush=True)
    os._exit(2)
