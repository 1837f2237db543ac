"""Models named as on the Hugging Face Hub: ``org/name`` (a safetensors repo), ``org/name:QUANT``
or ``org/name/file.gguf`` (a GGUF repo, as llama.cpp's ``-hf`` takes them), resolved to files in
huggingface_hub's cache.

Everything goes through huggingface_hub, so its cache and environment apply as they do to
transformers: ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` (a cached model then loads with no network call). Only what loading reads is
downloaded: for a safetensors repo its config, tokenizer and generation config files and the
shards its index names (never ``.bin``, ``.pth`` or ONNX copies); for a GGUF repo the one file,
or every part of a split one.

A name that is an existing path is that path; anything else that is not a repo id, or a repo,
revision or file the hub (or, offline, the cache) does not have, is a
:class:`ModelNotFoundError` naming it and what to do.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["ModelNotFoundError", "HubModel", "download_files", "parse_model_name", "repo_files",
           "resolve_model", "resolve_tokenizer"]

# Files a tokenizer folder may be read from (fastllm.Tokenizer.from_pretrained).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "config.json")
_INDEX = "model.safetensors.index.json"
# llama.cpp's default when a GGUF repo is named without a quantization.
_DEFAULT_QUANT = "Q4_K_M"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[\w]")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class ModelNotFoundError(FileNotFoundError):
    """A model name that names no local path and that the Hugging Face Hub (or its cache, when
    offline) cannot give; the message says what to do."""


@dataclass(frozen=True)
class HubModel:
    """A model named as on the hub: ``repo_id``, and for a GGUF repo the ``quant`` to pick
    (``org/name:Q4_K_M``) or the ``filename`` (``org/name/path/file.gguf``)."""

    repo_id: str
    quant: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        if self.filename is not None:
            return f"{self.repo_id}/{self.filename}"
        return self.repo_id if self.quant is None else f"{self.repo_id}:{self.quant}"


def parse_model_name(name: str) -> HubModel | None:
    """The hub name ``name`` spells, or None when it is not one (a path, say)."""
    repo, _, quant = name.partition(":")
    if quant and not re.fullmatch(r"[\w.-]+", quant):
        return None
    parts = repo.split("/")
    if len(parts) > 2 and parts[-1].lower().endswith(".gguf") and not quant:
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
        if ".." in parts[2:] or "" in parts[2:]:
            return None
    else:
        repo_id, filename = repo, None
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
        return None
    return HubModel(repo_id, quant or None, filename)


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local path of ``model``: itself when it exists, else the hub repo it names,
    downloaded into (or found in) huggingface_hub's cache at ``revision`` (default: the main
    branch): the model folder of a safetensors repo, the ``.gguf`` file of a GGUF repo (its
    first part when split; the loader reads the others beside it)."""
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a model on the hub; {model} is a "
                             "local path")
        return path
    name = _hub_name(model, "model")
    files = repo_files(name.repo_id, revision)
    if name.quant is not None or name.filename is not None or (
            "config.json" not in files and any(_is_gguf(f) for f in files)):
        wanted = _gguf_files(name, files)
        folder = download_files(name, revision, wanted)
        return folder / wanted[0]
    if "config.json" not in files:
        raise ModelNotFoundError(f"{name.repo_id} (revision {revision or 'main'}) holds no "
                                 "config.json and no .gguf file: not a model fastllm can load")
    wanted = [f for f in files if f in TOKENIZER_FILES]
    if _INDEX in files:
        index = download_files(name, revision, [_INDEX]) / _INDEX
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                .values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{name.repo_id}: {_INDEX} has no valid weight_map: {error}"
                             ) from None
        wanted += [_INDEX, *shards]
    else:
        wanted += [f for f in files if "/" not in f and f.endswith(".safetensors")]
    # No safetensors: download config and tokenizer only; the loader then names the pickle
    # files it refuses.
    return download_files(name, revision, wanted)


def resolve_tokenizer(tokenizer: str | os.PathLike, revision: str | None = None) -> Path:
    """The local path of ``tokenizer``: itself when it exists, else the hub repo it names with
    only its tokenizer files downloaded (a GGUF repo: its ``.gguf`` file, which holds the
    tokenizer)."""
    path = Path(tokenizer).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"tokenizer_revision={revision!r} applies to a tokenizer on the "
                             f"hub; {tokenizer} is a local path")
        return path
    name = _hub_name(tokenizer, "tokenizer")
    files = repo_files(name.repo_id, revision)
    wanted = [f for f in files if f in TOKENIZER_FILES]
    if name.quant is not None or name.filename is not None or not (
            "tokenizer.json" in wanted or "tokenizer.model" in wanted):
        return resolve_model(str(name), revision)
    return download_files(name, revision, wanted)


def _hub_name(model: str | os.PathLike, what: str) -> HubModel:
    name = parse_model_name(os.fspath(model)) if isinstance(model, str) else None
    if name is None:
        raise ModelNotFoundError(f"no {what} at {model}: not a file or folder, nor a Hugging "
                                 "Face repo id (org/name, org/name:QUANT or org/name/file.gguf)")
    return name


def _is_gguf(file: str) -> bool:
    return file.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(file).name.lower()


def _hub_error(error: Exception, name: HubModel, revision: str | None) -> ModelNotFoundError:
    """huggingface_hub's error for ``name`` as one message saying what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo, at = name.repo_id, f"revision {revision or 'main'}"
    if isinstance(error, GatedRepoError):
        message = (f"{repo} is a gated repo on {constants.ENDPOINT}: accept its terms on its "
                   "page, then set HF_TOKEN (or run `hf auth login`)")
    elif isinstance(error, RepositoryNotFoundError):
        message = (f"no model at {name}: not a local path, and {constants.ENDPOINT} has no repo "
                   f"{repo} (check the name; a private repo needs HF_TOKEN or `hf auth login`)")
    elif isinstance(error, RevisionNotFoundError):
        message = f"{repo} has no {at} (a branch, tag or commit of the repo)"
    elif isinstance(error, RemoteEntryNotFoundError):
        message = f"{repo} ({at}) lacks a file it lists: {error}"
    elif isinstance(error, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        message = (f"{name} ({at}) is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                   "and HF_HUB_OFFLINE is set: download it first (unset HF_HUB_OFFLINE, or "
                   f"`hf download {repo}`)")
    else:
        message = (f"cannot get {name} ({at}) from {constants.ENDPOINT}, and it is not in the "
                   f"Hugging Face cache ({constants.HF_HUB_CACHE}): {error}")
    return ModelNotFoundError(message)


def repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The files of the repo at ``revision``: listed by the hub, else (offline or unreachable)
    those of its cached snapshot."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    name = HubModel(repo_id)
    unreachable: Exception | None = None
    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().list_repo_files(repo_id, revision=revision)
        except HfHubHTTPError as error:
            status = error.response.status_code if error.response is not None else None
            if status is not None and status < 500:  # the hub's answer about this repo
                raise _hub_error(error, name, revision) from None
            unreachable = error
        except Exception as error:  # no answer (a connection error): the cache may serve
            unreachable = error
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                        allow_patterns=[]))
    except (OSError, ValueError) as error:  # not cached at this revision
        raise _hub_error(unreachable or error, name, revision) from None
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _gguf_files(name: HubModel, files: list[str]) -> list[str]:
    """The GGUF file ``name`` picks from the repo's ``files``, with its other parts when it is
    split (first part first)."""
    ggufs = [f for f in files if _is_gguf(f)]
    if name.filename is not None:
        if name.filename not in files:
            raise ModelNotFoundError(f"{name.repo_id} has no file {name.filename} (its GGUF "
                                     f"files: {', '.join(ggufs) or 'none'})")
        matches = [name.filename]
    else:
        quant = name.quant or _DEFAULT_QUANT
        tag = re.compile(rf"(^|[-._]){re.escape(quant)}([-._]|$)", re.IGNORECASE)
        matches = [f for f in ggufs if tag.search(_SPLIT.sub("", PurePosixPath(f).name)
                                                   .removesuffix(".gguf"))]
        if name.quant is None and not matches and len(_models(ggufs)) == 1:
            matches = ggufs
        if not matches:
            raise ModelNotFoundError(
                f"{name.repo_id} has no GGUF file {'for ' + quant if name.quant else 'named'}"
                f"{'' if name.quant else ' (name one as ' + name.repo_id + ':QUANT)'}; its "
                f"GGUF files: {', '.join(ggufs) or 'none'}")
    models = _models(matches)
    if len(models) > 1:
        raise ValueError(f"{name} matches several GGUF files: {', '.join(sorted(models))}; name "
                         f"one as {name.repo_id}/FILE.gguf")
    (first, parts), = models.items()
    split = _SPLIT.search(first)
    if split is None:
        return [first]
    count = int(split.group(2))
    stem = first[:split.start()]
    wanted = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [f for f in wanted if f not in files]
    if missing:
        raise ModelNotFoundError(f"{name.repo_id} lacks part(s) {', '.join(missing)} of the "
                                 f"split GGUF {first}")
    return wanted


def _models(ggufs: list[str]) -> dict[str, list[str]]:
    """GGUF files by model: a split model's parts under its first part's name."""
    models: dict[str, list[str]] = {}
    for file in sorted(ggufs):
        split = _SPLIT.search(file)
        key = file if split is None else \
            f"{file[:split.start()]}-00001-of-{split.group(2)}.gguf"
        models.setdefault(key, []).append(file)
    return models


def download_files(name: HubModel, revision: str | None, files: list[str]) -> Path:
    """The snapshot folder holding ``files`` of the repo, downloaded (with huggingface_hub's
    progress bars) where the cache lacks them."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name.repo_id, revision=revision, allow_patterns=files))
    except (OSError, ValueError) as error:  # huggingface_hub's errors, as one message
        raise _hub_error(error, name, revision) from None
