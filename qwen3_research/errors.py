"""Exception types shared across the package: the bottom of the import stack (imports nothing).

Every module that raises or catches one of these imports it from here, so no module has to
import a higher one (trainer, launch, export) just to name an exception.
"""


class ConfigError(ValueError):
    """A configuration problem the user must fix; printed as one line, exit status 2."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss under nan_policy=stop, …); the message says why. Exit 1."""


class ExportError(RuntimeError):
    """A Hugging Face export failed its checks; the last good export is left in place. Exit 1."""


class WorkerGroupError(RuntimeError):
    """A rank of a worker group failed; the message names the rank and its error. Exit 1."""
