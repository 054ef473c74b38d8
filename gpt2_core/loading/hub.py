"""Real GPT-2 checkpoints by name ("gpt2", "distilgpt2", "owner/repo"), through huggingface_hub.

huggingface_hub is an optional extra (``pip install 'gpt2-numpy[hub]'``) and is imported only when a name is used.
``download`` puts ``config.json``, the weights (``model.safetensors``, else ``pytorch_model.bin``) and the tokenizer
(``tokenizer.json``, else ``vocab.json`` + ``merges.txt``) into the standard HF cache (``~/.cache/huggingface``,
shared with transformers) and returns the snapshot folder holding them, which ``load_model`` then reads like
any local folder. It looks in the cache first, so a model downloaded once keeps working offline.
"""

from __future__ import annotations

import re
from pathlib import Path

from .config import HUB_REPOS
from ..errors import CheckpointError

__all__ = ["is_hub_name", "download"]

CONFIG = "config.json"
WEIGHTS = (("model.safetensors",), ("pytorch_model.bin",))  # alternatives: the first one the repo has wins
TOKENIZER = (("tokenizer.json",), ("vocab.json", "merges.txt"))

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # "owner/name", as the Hub spells them


def is_hub_name(name: str) -> bool:
    """True for a preset alias ("gpt2", "distilgpt2", ...) or an "owner/repo" id that is not a local path."""
    if Path(name).exists():
        return False
    return name in HUB_REPOS or bool(_REPO_ID.fullmatch(name))


def download(name: str, revision: str | None = None) -> Path:
    """Fetch (or find in the HF cache) a GPT-2 checkpoint and return the local folder holding its files."""
    try:
        import huggingface_hub as hf
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise CheckpointError(f"loading {name!r} by name needs huggingface_hub: pip install 'gpt2-numpy[hub]' "
                              "(or pass the path of a folder holding config.json and the weights)") from None
    repo_id = HUB_REPOS.get(name, name)
    if not _REPO_ID.fullmatch(repo_id):
        raise CheckpointError(f"{name!r} is neither an existing local path nor a Hub name like 'gpt2' or "
                              f"'owner/repo' (known aliases: {', '.join(HUB_REPOS)})")
    try:
        return _fetch(hf, hf_errors, repo_id, revision, local_files_only=True)  # cached already: no network at all
    except hf_errors.LocalEntryNotFoundError:
        pass
    try:
        # One HEAD request without retries first, so being offline is reported at once rather than after the
        # ~30 s of retries hf_hub_download makes on a network error (get_hf_file_metadata retries too in 0.31-0.36).
        url = hf.hf_hub_url(repo_id, CONFIG, revision=revision)
        hf.utils.hf_raise_for_status(hf.utils.http_backoff("HEAD", url, max_retries=0,
                                                            headers=hf.utils.build_hf_headers()))
        return _fetch(hf, hf_errors, repo_id, revision, local_files_only=False)
    except CheckpointError:
        raise
    except hf_errors.RepositoryNotFoundError:
        reason = "there is no such repository on the Hub (or it is private or gated: log in with `hf auth login`)"
    except hf_errors.RevisionNotFoundError:
        reason = f"the repository has no revision {revision!r}"
    except _remote_entry_not_found(hf_errors) as e:
        if isinstance(e, hf_errors.LocalEntryNotFoundError):  # huggingface_hub 0.x: the Hub was not reached
            reason = _unreachable(hf, e)
        else:
            reason = f"the repository has no {CONFIG}, so it is not a model in Hugging Face layout"
    except Exception as e:  # no network, HF_HUB_OFFLINE=1, a proxy, the Hub down, ...
        if "consistency check" in str(e).lower():  # the Hub answered, but a file arrived cut short
            raise CheckpointError(f"the download of {name!r} from the Hugging Face Hub was incomplete "
                                  f"({str(e).splitlines()[0]}); run the same command again to retry") from None
        reason = _unreachable(hf, e)
    alias = f" ({repo_id})" if repo_id != name else ""
    folder = repo_id.split("/")[-1]
    raise CheckpointError(
        f"could not fetch the files of {name!r}{alias} from the Hugging Face Hub: {reason}.\n"
        f"If you meant a local folder: {name!r} does not exist. To get the model another way, run on a machine "
        f"with internet access (pip install huggingface_hub):\n"
        f"    hf download {repo_id} config.json model.safetensors tokenizer.json --local-dir {folder}\n"
        f"copy the {folder} folder here and pass its path: `--model path/to/{folder}` on the command line, "
        f"load_model(\"path/to/{folder}\") in Python."
    )


def _unreachable(hf, e: Exception) -> str:
    offline = " (HF_HUB_OFFLINE is set)" if _offline_mode(hf) else ""
    return (f"the Hub could not be reached{offline} and they are not in the local cache "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


# huggingface_hub 0.x and 1.x name two things differently; both are supported (the CI runs the floor, 0.30):
def _remote_entry_not_found(hf_errors) -> type[Exception]:
    """The error for a file the repository does not have: ``RemoteEntryNotFoundError`` from 1.0 on; in 0.x,
    ``EntryNotFoundError``, of which ``LocalEntryNotFoundError`` (a file neither in the cache nor reachable) is a
    subclass there, so callers tell the two apart with ``isinstance``."""
    return getattr(hf_errors, "RemoteEntryNotFoundError", None) or hf_errors.EntryNotFoundError


def _offline_mode(hf) -> bool:
    """``HF_HUB_OFFLINE``: ``huggingface_hub.is_offline_mode()`` from 1.0 on, ``constants.HF_HUB_OFFLINE`` in 0.x."""
    is_offline_mode = getattr(hf, "is_offline_mode", None)
    return bool(is_offline_mode() if is_offline_mode else hf.constants.HF_HUB_OFFLINE)


def _fetch(hf, hf_errors, repo_id: str, revision: str | None, local_files_only: bool) -> Path:
    def get(filename: str, rev: str | None) -> Path:  # hf_hub_download shows its own progress bar
        return Path(hf.hf_hub_download(repo_id, filename, revision=rev, local_files_only=local_files_only))

    # "not in the cache" or "not in the repo"; a network error must not be mistaken for a missing file
    missing = hf_errors.LocalEntryNotFoundError if local_files_only else _remote_entry_not_found(hf_errors)
    snapshot = get(CONFIG, revision).parent  # .../snapshots/<commit>/
    commit = snapshot.name  # take the other files from the very same commit, so they land in the same folder
    for what, alternatives in (("weights", WEIGHTS), ("tokenizer", TOKENIZER)):
        for i, filenames in enumerate(alternatives):
            try:
                for filename in filenames:
                    get(filename, commit)
                break
            except missing as e:
                if not local_files_only and isinstance(e, hf_errors.LocalEntryNotFoundError):
                    raise  # huggingface_hub 0.x: a network error, not a missing file
                if i == len(alternatives) - 1:
                    if local_files_only:
                        raise
                    names = " or ".join(" + ".join(f) for f in alternatives)
                    raise CheckpointError(f"{repo_id}: the repository has no {what} file ({names}), so it is "
                                          "not a GPT-2 checkpoint this package can load") from None
    return snapshot
