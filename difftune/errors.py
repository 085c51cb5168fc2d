"""The one exception type users see: a message that says what is wrong and what to do."""

import importlib.util


class DifftuneError(Exception):
    """Bad input (config, data, model path): the CLI prints the message and exits 2, no traceback."""


class BatchBeyondData(DifftuneError):
    """A batch larger than the data holds; `largest` is the largest per-process batch it does hold (the batch-size
    finder stops there: the data, not memory, sets the limit)."""

    def __init__(self, message: str, largest: int):
        super().__init__(message)
        self.largest = largest


# How the CLI prints a DifftuneError; the UI finds a failed job's reason in its log by it.
ERROR_PREFIX = "difftune: error: "


def require_extra(module: str, extra: str, setting: str, instead: str) -> None:
    """Stop, with the command that installs it, when the optional package a setting needs is missing."""
    if importlib.util.find_spec(module) is None:
        raise DifftuneError(f"{setting} needs {module}: `pip install difftune[{extra}]`, or {instead}")
