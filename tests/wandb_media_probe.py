"""Run through the warm CLI by tests/test_warm_cli.py: W&B's media directory (made when wandb is imported, in the
warm server before the fork) must exist in every child, whatever an earlier child did at its exit."""

import os

from wandb.sdk.data_types._private import MEDIA_TMP

print(f"media dir {MEDIA_TMP.name} exists={os.path.isdir(MEDIA_TMP.name)}")
