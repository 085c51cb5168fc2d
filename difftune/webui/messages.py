"""How the UI's tabs say a failure on the page."""

from __future__ import annotations

from difftune.errors import DifftuneError


def error_markdown(err: Exception) -> str:
    """A failure as the page shows it: difftune's own message, or an unexpected exception with its kind."""
    text = str(err) if isinstance(err, DifftuneError) else f"{type(err).__name__}: {err}"
    return f"**Error**\n\n```\n{text}\n```"
