"""Models given as Hugging Face Hub ids: resolved to a local snapshot through `huggingface_hub`.

A model (or tokenizer) that is not a local path but reads as a repository id (`name` or
`org/name`) is downloaded with `snapshot_download` at `--revision` into `--download-dir`
(default: the Hugging Face cache), on the node that needs it, and its snapshot folder is used
as the path from then on; a snapshot already there is found again with one revision look-up
(none with `HF_HUB_OFFLINE=1`). `HF_ENDPOINT` (a mirror) and `HF_TOKEN` are honoured as
`huggingface_hub` honours them, and `HF_ENDPOINT` is read at each call. Every caller that
opens the checkpoint's files resolves through `local_model_config`; a process resolves each
(id, revision, folder) once. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re

from shoal.engine.config import EngineConfig, ModelConfig
from shoal.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

# The Hub's repository names: an optional owner, then the name; no leading or doubled dots.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
# What serving needs from a repository: its config, tokenizer, weights and chat template files.
_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.gguf", "*.jinja", "*.model", "*.txt")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hub repository: no such local path, and a repository's form."""
    return not os.path.exists(model) and bool(_REPO_ID.match(model)) and ".." not in model


def local_model_config(config: EngineConfig) -> EngineConfig:
    """`config` with its model (and tokenizer) as local paths, downloading what is a Hub id.

    Raises:
        ModelLoadError: the repository or revision does not exist, or the Hub (or its mirror)
            cannot be reached and no snapshot is in the download folder.
    """
    model = config.model
    path = resolve_model(model.model, model.revision, model.download_dir)
    tokenizer = model.tokenizer
    if tokenizer is not None:
        tokenizer = resolve_model(tokenizer, None, model.download_dir)
    if path == model.model and tokenizer == model.tokenizer:
        return config
    local = dataclasses.replace(model, model=path, tokenizer=tokenizer)
    return dataclasses.replace(config, model=local)


def local_model_path(model: ModelConfig) -> str:
    """The local path of `model`'s checkpoint (`resolve_model`)."""
    return resolve_model(model.model, model.revision, model.download_dir)


def resolve_model(model: str, revision: str | None, download_dir: str | None) -> str:
    """A local path for `model`: itself unless it is a Hub id, else its snapshot folder.

    Raises:
        ModelLoadError: as `local_model_config`.
    """
    if not is_hub_id(model):
        return model
    return _download(model, revision, download_dir, os.environ.get("HF_ENDPOINT"))


@functools.lru_cache(maxsize=16)
def _download(
    repo_id: str, revision: str | None, download_dir: str | None, endpoint: str | None
) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    source = endpoint or "the Hugging Face Hub"
    logger.info("resolving %s from %s into %s", where, source, download_dir or "the HF cache")
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=list(_ALLOW_PATTERNS),
            endpoint=endpoint,
        )
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r} on {source}") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"{repo_id} is neither a local path nor a repository on {source} (a private or "
            "gated one needs HF_TOKEN)"
        ) from e
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"{repo_id} is not a local path, and as a Hub id it cannot be downloaded: {source} "
            f"is not reachable and no snapshot of it is in {download_dir or 'the HF cache'} "
            f"({_first_line(e)})"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(
            f"{repo_id} is not a local path, and downloading {where} from {source} failed: "
            f"{_first_line(e)}"
        ) from e
    logger.info("%s is at %s", where, path)
    return str(path)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
