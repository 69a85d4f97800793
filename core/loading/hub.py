"""Hugging Face hub ids as ``model.path``: ``org/name`` or ``org/name@revision``, resolved into huggingface_hub's cache.

Only what serving needs is fetched (config, generation config, tokenizer files,
safetensors and their index). With ``HF_HUB_OFFLINE=1``, or when the hub
cannot be reached, a cached snapshot is used; a hub id that is not cached
fails with one line saying so. The cache is huggingface_hub's own
(``HF_HOME`` / ``HF_HUB_CACHE``), so a model downloaded with
``hf download`` is found here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# What a model folder needs for serving; weights in other formats (*.bin, *.pt, *.gguf) are not fetched.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]

# Hub naming rules: letters, digits, '-', '_', '.'; no leading/trailing '.' or '-', no '--' or '..'.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9._/-]+))?$")


class HubError(RuntimeError):
    """A hub id could not be resolved to a local folder; the message is one line saying why."""


@dataclass(frozen=True)
class HubId:
    """A parsed ``org/name[@revision]``."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(path: str) -> HubId | None:
    """``org/name`` or ``org/name@revision`` as a HubId; None for anything else (a local path)."""
    match = _HUB_ID.match(path)
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"])


def download(hub_id: HubId) -> str:
    """The local snapshot folder of ``hub_id``, downloading what is missing unless offline."""
    from huggingface_hub import constants, snapshot_download

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return snapshot_download(
            hub_id.repo_id,
            revision=hub_id.revision,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
        )
    except Exception as exc:  # huggingface_hub raises many types; each becomes one line for the user
        raise HubError(_explain(hub_id, exc, offline, constants.HF_HUB_CACHE)) from None


def _explain(hub_id: HubId, exc: Exception, offline: bool, cache: str) -> str:
    from huggingface_hub import errors

    kind = type(exc).__name__
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"model.path '{hub_id}': revision '{hub_id.revision}' does not exist on the Hugging Face hub"
    if isinstance(exc, errors.GatedRepoError):
        return (f"model.path '{hub_id}' is a gated repository; accept its terms on huggingface.co and log in "
                "(hf auth login or HF_TOKEN)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"model.path '{hub_id}' is neither a local path nor a Hugging Face hub repository "
                "(or it is private: log in with hf auth login or HF_TOKEN)")
    if isinstance(exc, errors.LocalEntryNotFoundError) or offline:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        return (f"model.path '{hub_id}' is a Hugging Face hub id that is not in the local cache ({cache}) "
                f"and {why}; download it first (hf download {hub_id.repo_id}) or give a local folder")
    return f"model.path '{hub_id}': downloading from the Hugging Face hub failed ({kind}: {_first_line(exc)})"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"


def default_served_name(model_path: str | None, model_dir: str) -> str:
    """The name a server reports for the model: a hub id's ``org/name``, else the model folder's name."""
    hub_id = parse_hub_id(model_path) if model_path and not Path(model_path).expanduser().exists() else None
    return hub_id.repo_id if hub_id is not None else Path(model_dir).name
