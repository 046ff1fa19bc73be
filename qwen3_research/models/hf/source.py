"""Where ``model=hf`` gets its model from: ``model.path`` as a local directory or a Hub id, and the one-line refusals
when neither can be had here (read at resolution, ``models.hf.describe``, and by the model before it loads)."""

from __future__ import annotations

import os
import socket
import urllib.parse

from qwen3_research.config import ConfigError


def _refuse_an_unreachable_hub(repo_id: str) -> None:
    """A Hub id this host neither has in its Hugging Face cache nor can reach: one line at once, where the Hub client
    retried for ~30 s and printed 25 lines before transformers' "couldn't connect" (issue 40 weak case). Whether the
    Hub's host resolves is what is asked (no request is made); HF_HUB_OFFLINE=1 leaves it to the cache alone."""
    # deferred: the Hub client loads only for a Hub id (a config error on a local path exits before it)
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise ConfigError(f"model.path={repo_id!r} is a Hub id that is not in this host's Hugging Face cache, and "
                          f"{host} cannot be reached from here ({e.strerror or e}): download it where there is network "
                          f"(hf download {repo_id} --local-dir DIR) and set model.path=DIR") from None


def check_source(path: str) -> None:
    """``model.path`` that is neither a directory here nor a Hub id this host can get: one line (a missing local
    path, a Hub id offline). Read at resolution and by the model before it loads (``model.HFCausalLM``)."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return
    if os.path.isabs(local) or path.startswith((".", "~")) or os.sep * 2 in local:
        # issue 40: was "Repo id must be in the form 'repo_name' ..." from the Hub client
        raise ConfigError(f"model.path={path!r}: no such directory (a local path; a Hub id is namespace/name): give "
                          "the directory that holds config.json and the weights")
    _refuse_an_unreachable_hub(path)
