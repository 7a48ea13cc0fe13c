"""Checkpoints named by Hugging Face Hub id (``org/name``) as well as by directory.

:func:`resolve` turns a name into a local directory: a directory that exists is used as it is (it
wins over an id spelled the same); anything else that is a valid repository id is fetched with
huggingface_hub's own ``snapshot_download``, so the Hub cache, ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, tokens and download progress behave as in transformers. Only the files stree
reads are fetched: configs (``*.json``: config, generation config, tokenizer config and
vocabulary, weight index), safetensors weights, tokenizer and chat-template files; ``*.bin`` /
``*.pt`` weights only for a repository without safetensors (mamba_ssm's checkpoints).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["resolve"]

READ = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
PICKLED = ["*.bin", "*.pt"]


def resolve(name, revision: str | None = None) -> Path:
    """The local directory of checkpoint ``name``: a directory, or a Hub id (downloaded, or found
    in the Hub cache; ``revision``: a branch, tag or commit, default ``main``). A ValueError
    names the id when it cannot be had (not cached while offline, not on the Hub, a revision it
    lacks, no access); a name that is neither is returned unchanged for the loader's own error."""
    if isinstance(name, Path) or not isinstance(name, str):
        if revision is not None:
            raise ValueError(f"revision={revision!r} is for Hub ids; {name} is a path")
        return Path(name)
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a str (a branch, tag or commit), got {type(revision).__name__}")
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(name):
        if revision is not None:
            raise ValueError(f"revision={revision!r} is for Hub ids; {name!r} is a local path")
        return path
    return _snapshot(name, revision)


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is spelled as a Hub repository id (``name`` or ``org/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = "" if revision is None else f" at revision {revision!r}"
    # offline, said outright: huggingface_hub 1.x asks the Hub for a commit hash's file list
    # whatever HF_HUB_OFFLINE says, and its own guard then refuses the request
    options = dict(revision=revision, local_files_only=constants.HF_HUB_OFFLINE)
    try:
        path = Path(snapshot_download(repo, allow_patterns=READ, **options))
        if not any(path.glob("*.safetensors")):  # weights pickled by torch.save only (mamba_ssm's)
            path = Path(snapshot_download(repo, allow_patterns=READ + PICKLED, **options))
    except LocalEntryNotFoundError:
        raise ValueError(f"{repo!r} is not a local directory, and the Hub id {repo!r}{at} is not in the Hub cache "
                         "(offline: HF_HUB_OFFLINE, or no connection): download it once online, or give its "
                         "directory") from None
    except RevisionNotFoundError:
        raise ValueError(f"the Hub repository {repo!r} has no revision {revision!r}") from None
    except GatedRepoError:
        raise ValueError(f"the Hub repository {repo!r} is gated: accept its terms on the Hub and log in "
                         "(hf auth login or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo!r} is not a local directory, and no Hub repository {repo!r} exists (or it is "
                         "private: log in with hf auth login or HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise ValueError(f"the Hub id {repo!r}{at} could not be fetched: {exc}") from None
    return path
