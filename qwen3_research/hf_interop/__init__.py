"""Hugging Face interop for the native backends: config mapping, checks, sharded import and export.

- ``hf_interop.config``: config.json <-> architecture, cheap directory/header checks (no torch).
- ``hf_interop.load``: safetensors -> a sharded native model through DCP's HuggingFaceStorageReader.
- ``hf_interop.export``: a trained model -> a verified HF directory.
- ``preflight``: what the launcher checks before any worker starts.

Imports ``errors``, ``models.registry`` (a backend's HF model_type and MoE-ness, from its spec), ``kernels``
(which kernels replace the experts) and, lazily, ``titan``/``models``; ``run/checkpoint.py`` (distributed checkpoints) and ``export.py`` (the command) import this, never the reverse.
"""
