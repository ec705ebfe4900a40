"""Hugging Face Hub model ids (``meta-llama/Llama-3.2-3B``, ``ORG/NAME@REVISION``) → a local config.json.

Only ``config.json`` is read, through :mod:`huggingface_hub` (the ``hub`` extra): from the local
cache first, downloading it alone when it is missing and the Hub is reachable; weights are never
downloaded. ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) keeps to the cache; ``HF_HUB_CACHE``
/ ``HF_HOME`` and ``HF_ENDPOINT`` are read when the call is made; ``HF_TOKEN`` or
``huggingface-cli login`` give access to gated repositories. Example::

    >>> is_hub_id("meta-llama/Llama-3.2-3B"), is_hub_id("configs/llama.json"), is_hub_id("gpt2")
    (True, False, False)

A preset name or an existing path always wins (:func:`memplan.model.load_model` asks them first);
an id needs its ``ORG/`` (ids without one, such as ``gpt2``, moved under an organisation on the Hub).
Every failure is one :class:`~memplan.errors.ModelConfigError` sentence: malformed id, not cached
while offline, unknown repository or revision, gated repository without a token, Hub unreachable.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from memplan.errors import MissingDependencyError, ModelConfigError

__all__ = ["hub_config_path", "is_hub_id", "looks_like_hub_id", "split_hub_id"]

#: One part of a repo id (huggingface_hub.utils.validate_repo_id's rule): letters, digits, ``-_.``,
#: no leading/trailing ``-``/``.``, at most 96 characters over the whole id.
_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_MAX_ID = 96
#: Seconds to wait for the Hub's TCP port before calling it unreachable.
_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_ENDPOINT = "https://huggingface.co"


def split_hub_id(ref: str) -> tuple[str, str | None]:
    """``ORG/NAME@REV`` → (``ORG/NAME``, ``REV`` or None)."""
    repo_id, sep, revision = ref.partition("@")
    return repo_id, (revision or None) if sep else None


def looks_like_hub_id(ref: str) -> bool:
    """``ref`` is written as a Hub id (``ORG/NAME[@REV]``) rather than a path: one slash, no
    ``./`` ``~`` or leading ``/``, no ``.json`` ending. Says nothing about whether it is well formed."""
    text = ref.strip()
    if text.startswith((".", "/", "~")) or text.endswith(".json") or "\\" in text:
        return False
    return split_hub_id(text)[0].count("/") == 1


def is_hub_id(ref: str) -> bool:
    """``ref`` is a well-formed Hub model id ``ORG/NAME`` with an optional ``@REVISION``."""
    if not looks_like_hub_id(ref):
        return False
    repo_id, revision = split_hub_id(ref.strip())
    parts = repo_id.split("/")
    if len(repo_id) > _MAX_ID or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return False
    if revision is not None and (not revision.strip() or any(c.isspace() for c in revision)):
        return False
    return all(_PART.match(part) for part in parts)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def _cache_dir() -> str | None:
    """The Hub cache as huggingface_hub resolves it, read now (None: the library's default)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    home = os.environ.get("HF_HOME")
    return os.path.join(os.path.expanduser(home), "hub") if home else None


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def _reachable(endpoint: str) -> bool:
    """Whether the endpoint's host answers on its port (a quick probe: huggingface_hub itself would
    retry an unreachable host for about 20 seconds)."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_config_path(ref: str) -> Path:
    """The local path of the ``config.json`` of Hub model ``ref`` (``ORG/NAME[@REV]``).

    Reads the cache first; downloads ``config.json`` alone when it is not cached and the Hub is
    reachable (never while offline). Raises :class:`ModelConfigError` with one sentence otherwise.
    """
    ref = ref.strip()
    if not is_hub_id(ref):
        raise ModelConfigError("model", "is not a preset, an existing path, or a well-formed Hugging Face Hub id "
                               "ORG/NAME[@REVISION] (letters, digits, - _ . ; no -- or ..)", ref)
    repo_id, revision = split_hub_id(ref)
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ModuleNotFoundError:
        raise MissingDependencyError("huggingface_hub", feature=f"the Hub model id {ref}", extra="hub") from None
    cache_dir = _cache_dir()
    cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if _offline() or huggingface_hub.constants.HF_HUB_OFFLINE:  # the library reads it once, at import
        raise ModelConfigError("model", "is a Hugging Face Hub id whose config.json is not in the local cache and "
                               "HF_HUB_OFFLINE is set", ref, hint=f"run once online or `huggingface-cli download "
                               f"{repo_id} config.json`" + (f" --revision {revision}" if revision else ""))
    endpoint = _endpoint()
    if not _reachable(endpoint):
        raise ModelConfigError("model", f"is a Hugging Face Hub id, its config.json is not cached and {endpoint} "
                               "is not reachable", ref, hint=f"connect, or on a machine online run `huggingface-cli "
                               f"download {repo_id} config.json` and copy the cache (HF_HUB_CACHE)")
    try:
        path = huggingface_hub.hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir,
                                               endpoint=endpoint)
    except hub_errors.GatedRepoError:
        hint = ("your token's account has no access yet: accept the licence on the model's page" if
                huggingface_hub.get_token() else "set HF_TOKEN or run `huggingface-cli login`")
        raise ModelConfigError("model", "is a gated Hugging Face repository: access needs a token of an account "
                               "that accepted its licence", ref, hint=hint) from None
    except hub_errors.RepositoryNotFoundError:
        hint = "check the spelling; a private repository also needs HF_TOKEN or `huggingface-cli login`"
        raise ModelConfigError("model", "is not a repository on the Hugging Face Hub", ref, hint=hint) from None
    except hub_errors.RevisionNotFoundError:
        raise ModelConfigError("model", f"revision {revision!r} does not exist in {repo_id}", ref) from None
    except hub_errors.LocalEntryNotFoundError:
        raise ModelConfigError("model", f"config.json could not be fetched from {endpoint} and is not cached", ref,
                               hint="check the connection and retry") from None
    except hub_errors.EntryNotFoundError:
        raise ModelConfigError("model", "the Hub repository has no config.json (not a transformers model?)",
                               ref) from None
    except (hub_errors.HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError("model", f"config.json could not be fetched from the Hub ({first})", ref) from None
    return Path(path)
