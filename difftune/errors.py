"""The one exception type users see: a message that says what is wrong and what to do."""


class DifftuneError(Exception):
    """Bad input (config, data, model path): the CLI prints the message and exits 2, no traceback."""


# How the CLI prints a DifftuneError; the UI finds a failed job's reason in its log by it.
ERROR_PREFIX = "difftune: error: "
