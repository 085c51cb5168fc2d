"""A run's output folder on the Hugging Face Hub (`difftune push`, and `export.push_to_hub` at the end of a run): the
result files, the model card (model_card.py) and the samples, through `huggingface_hub`'s `create_repo` and
`upload_folder`; never the checkpoints, snapshots or logs unless asked (gigabytes a checkpoint, of use to a resume
alone). Offline or without a token it says so in one line before any upload, and the folder is left as it was.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from huggingface_hub import constants, create_repo, get_token, upload_folder
from huggingface_hub.errors import HfHubHTTPError

from difftune.adapters.model_card import CARD_FILE
from difftune.errors import DifftuneError

# What stays on this machine: the resume state, the in-run snapshots, the logs, hidden files (a run's lock).
LOCAL_ONLY = ["checkpoints/**", "snapshots/**", "logs/**", ".*", "**/.*"]
TRAINING_STATE = ("checkpoints/**", "snapshots/**")


def push(folder: Path, repo_id: str, private: bool = False, with_checkpoints: bool = False) -> str:
    """Uploads `folder` (a run's output) to the model repository `repo_id`, made if missing; its commit's URL."""
    what = f"difftune push {folder} {repo_id}"
    if not (folder / CARD_FILE).is_file():
        raise DifftuneError(f"{what}: no {CARD_FILE} in {folder}: not the output folder of a finished difftune run")
    if constants.HF_HUB_OFFLINE:
        raise DifftuneError(f"{what}: offline (HF_HUB_OFFLINE is set); unset it on a machine that reaches the Hub")
    token = get_token()
    if token is None:
        raise DifftuneError(f"{what}: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN")
    ignored = [pattern for pattern in LOCAL_ONLY if not (with_checkpoints and pattern in TRAINING_STATE)]
    try:
        create_repo(repo_id, token=token, private=private, exist_ok=True)
        commit = upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            ignore_patterns=ignored,
            commit_message=f"difftune: {folder.name}",
            token=token,
        )
    except (HfHubHTTPError, httpx.HTTPError, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DifftuneError(f"{what}: {reason}") from None
    return commit.commit_url
