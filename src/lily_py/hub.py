"""Resolve a local folder or a Hugging Face repo id to a local checkpoint folder.

Hub downloads fetch only what the text model needs: config, tokenizer, chat template,
generation config, and the safetensors shards that hold at least one text tensor (the index
tells which); vision-only shards are never downloaded. huggingface_hub shows its progress bars
and uses its cache, so a second load works offline.
"""
from __future__ import annotations

import json
import os
import re

from .checkpoint import text_weight_files
from .errors import CheckpointError

META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "model.safetensors.index.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(s: str) -> bool:
    return bool(_REPO_ID.match(s)) and not s.startswith((".", "/", "~"))


def looks_like_path(s: str) -> bool:
    """A missing ``s`` that is meant as a local folder, not a repo id: it starts with ``.``,
    ``/`` or ``~``, has more than one slash or a trailing one, uses the OS separator, or its
    first component is an existing local folder (``models/qwen`` next to ``models/``)."""
    if s.startswith((".", "/", "~")) or s.count("/") > 1 or s.endswith("/") or \
            (os.sep != "/" and os.sep in s):
        return True
    head = s.split("/", 1)[0]
    return "/" in s and os.path.isdir(head)


def resolve(path_or_id: str | os.PathLike, *, revision: str | None = None) -> str:
    s = os.path.expanduser(os.fspath(path_or_id))
    if os.path.isdir(s):
        return s
    if os.path.exists(s):
        raise CheckpointError(f"{s}: is a file; pass the checkpoint folder (with config.json "
                              "and *.safetensors)")
    raw = os.fspath(path_or_id)
    if looks_like_path(raw) or looks_like_path(s):
        parent = os.path.dirname(os.path.abspath(s.rstrip("/")))
        hint = "" if os.path.isdir(parent) else f"; its parent {parent} does not exist either"
        raise CheckpointError(f"{s}: no such folder (read as a local path, not a Hugging Face "
                              f"repo id{hint})")
    if not is_repo_id(s):
        raise CheckpointError(f"{s}: no such folder, and not a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise CheckpointError(f"{s}: loading from the hub needs huggingface_hub ({e})") from None
    try:
        folder = snapshot_download(s, revision=revision, allow_patterns=META_FILES)
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                shards = text_weight_files(json.load(f))
        else:
            shards = ["model.safetensors"]
        folder = snapshot_download(s, revision=revision, allow_patterns=META_FILES + shards)
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{s}: not in the local Hugging Face cache and the hub cannot be "
                              f"reached (offline?): {e}") from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"{s}: the Hugging Face hub refused the download: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{s}: download failed: {e}") from None
    return folder
