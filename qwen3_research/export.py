"""``python -m qwen3_research.export``: a saved DCP checkpoint -> a verified Hugging Face directory.

    python -m qwen3_research.export <checkpoint dir> <out_dir> [--max-shard-size 5GB] [--force] [--init-from DIR]

The model is rebuilt from the checkpoint's run config (an init_from model's architecture from its
config.json; ``--init-from`` names that directory when it has moved since training), its weights read
from any saved layout, then written, verified and published by the model's own export (sharded
safetensors + index, config.json, tokenizer files; moved into place only when transformers reloads it
with no missing/unexpected keys and matching logits). The work is ``run/export_hf.py``, this command's
heavy half, imported once the arguments are read. The report lands in
``out_dir/export_verification.json``; the command names the step it exported. On any failure (a
failed check, a full disk, Ctrl-C) nothing is left behind and an earlier out_dir is untouched. At the
end of a run, ``checkpoint.export_hf=true`` does the same from the trainer's (sharded) model into
``<run dir>/hf``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from qwen3_research import startup
from qwen3_research.errors import ConfigError, ExportError
from qwen3_research.signals import Terminated, raise_terminated

if __name__ == "__main__":  # Ctrl-C / SIGTERM while torch imports: 128+signal, one line
    startup.exit_at_once_while_importing("before the export started; nothing was written")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m qwen3_research.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a step-N checkpoint directory, or a directory of them (newest is used)")
    ap.add_argument("out_dir", help="the Hugging Face directory to write")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    ap.add_argument("--force", action="store_true", help="replace a non-empty out_dir (after verification)")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="the base model directory (model.init_from) when it moved since training")
    args = ap.parse_args(argv)
    startup.quiet_libraries()
    # deferred: start-up (--help and a bad argument exit before torch loads; the heavy half loads torch, transformers)
    from qwen3_research.run import export_hf

    # From here Ctrl-C and SIGTERM unwind the export (its temporary directory is removed on the way out).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        try:
            export_hf.parse_size(args.max_shard_size)  # before any work (it failed after 11 s of loading)
        except ValueError as e:
            raise ConfigError(f"--max-shard-size: {e}; write e.g. 5GB, 500MB or a number of bytes") from None
        report = export_hf.export_checkpoint(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                                             force=args.force, init_from=args.init_from)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (KeyboardInterrupt, Terminated) as e:
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(f"interrupted by {name}; nothing was exported (no partial files are left; {args.out_dir} is as it was)",
              file=sys.stderr, flush=True)
        sys.exit(128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT))
    print(json.dumps({k: report[k] for k in ("step", "checkpoint", "missing_keys", "unexpected_keys",
                                             "max_abs_logit_diff", "files")}))


if __name__ == "__main__":
    main()
