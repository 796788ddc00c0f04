"""Which files a model name means: a packaged model, a local HF directory, or a Hugging Face Hub snapshot.

A Hub id ("org/name") is resolved by huggingface_hub itself, as ``from_pretrained`` resolves one: the cache
under HF_HOME (or HF_HUB_CACHE), a download of what is missing unless HF_HUB_OFFLINE is set, HF_TOKEN for
a gated or private repository, and ``model.revision`` (a branch, tag or commit; None is "main"). Only what
a model needs is fetched: config, generation config, tokenizer files, chat template, the repo's own Python
code (run only with ``model.trust_remote_code``) and safetensors weights; never pickle weights
(``pytorch_model*.bin``: unpickling can run code, opsd.models.trust), GGUF, ONNX, subfolders or
``consolidated.*`` copies. An existing local path wins over a Hub id, as in from_pretrained.

`opsd run` resolves its models once, before any role starts (`resolve_run`), pins each Hub model's
revision to the resolved commit in the run's config.yaml (every role then loads that same snapshot, from
the cache, or the same commit on another machine) and records what it resolved in ``<run_dir>/model.json``
(`write_run_models`). A model that cannot be had is refused with one line (`ModelUnavailableError`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from opsd.config import ModelSection, RunConfig
from opsd.models.packaged import PACKAGED_MODELS, TINY_RANDOM, is_packaged, packaged_model

COMMIT = re.compile(r"[0-9a-f]{40}")
# What from_pretrained reads of a causal LM and its tokenizer (top-level files only: `SKIPPED`).
MODEL_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken", "chat_template.jinja",
               "chat_template.json", "*.py"]
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
# Subfolders (other formats, original checkpoints) and Mistral's consolidated.* second copy of the weights.
SKIPPED = ["*/*", "consolidated.*"]
RUN_FILE = "model.json"  # <run_dir>/model.json: the models `opsd run` resolved


class ModelUnavailableError(ValueError):
    """A Hub model that cannot be had: offline and not cached, no such repository or revision, gated without
    access, the Hub unreachable. The message is one line naming the id, the revision and the command that
    fetches it."""


@dataclass(frozen=True)
class ResolvedModel:
    """What a model name resolved to.

    name: as configured; revision: the Hub revision asked for ("main" when none was given), None for a
    packaged model or a local dir; commit: the 40-hex commit of the Hub snapshot, None for a packaged model
    or a local dir; path: the local HF directory every load reads.
    """

    name: str
    revision: str | None
    commit: str | None
    path: Path

    def record(self) -> dict[str, str | None]:
        """{"name", "revision", "commit", "path"} as JSON values (model.json, metrics.jsonl's first line)."""
        return {"name": self.name, "revision": self.revision, "commit": self.commit, "path": str(self.path)}


def is_hub_id(name: str) -> bool:
    """True when `name` has the form of a Hub model id, "org/name" (huggingface_hub's own rules for each part);
    a path such as "./org/name", "/models/x" or "~/x" is not one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or name.startswith((".", "~", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(cfg: ModelSection, what: str = "model") -> ResolvedModel:
    """Resolve ``cfg.name`` (`what` names the section in messages: "model" or "teacher.model").

    A packaged model is converted once (opsd.models.packaged); an existing local directory is used as it is;
    a Hub id is resolved and, unless HF_HUB_OFFLINE is set, downloaded through huggingface_hub's cache.

    Raises ModelUnavailableError (one line) for a Hub model that cannot be had; ValueError for a revision
    on a packaged model or a local directory (they have none: refused rather than ignored, so no record shows
    a pin that was not applied); FileNotFoundError for a name that is neither of the three, or a local
    directory without config.json.
    """
    name = cfg.name
    if is_packaged(name):
        _no_revision(cfg, what, "a packaged model (it ships with opsd)")
        return ResolvedModel(name, None, None, packaged_model(cfg))
    local = Path(name).expanduser()
    if local.exists() or not is_hub_id(name):
        if not local.exists():
            raise FileNotFoundError(
                f"{what} {name!r} is neither a packaged model {sorted([*PACKAGED_MODELS, TINY_RANDOM])}, nor a local "
                "HF directory with config.json, nor a Hugging Face Hub id (org/name)")
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{what} {name!r}: the local directory has no config.json (not a HF model directory)")
        _no_revision(cfg, what, "a local directory")
        return ResolvedModel(name, None, None, local)
    return _from_hub(cfg, what)


def _no_revision(cfg: ModelSection, what: str, kind: str) -> None:
    if cfg.revision is not None:
        raise ValueError(f"{what}.revision {cfg.revision!r} pins a Hugging Face Hub revision, but {what}.name "
                         f"{cfg.name!r} is {kind}, which has none: drop {what}.revision")


def _from_hub(cfg: ModelSection, what: str) -> ResolvedModel:
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import XetDownloadError

    revision = cfg.revision or "main"
    if COMMIT.fullmatch(revision):  # a commit never changes: a complete snapshot in the cache needs no Hub call
        try:  # (every role of a run loads its pinned commit: no role waits on an unreachable Hub)
            path = Path(snapshot_download(cfg.name, revision=revision, local_files_only=True))
        except (OSError, ValueError):
            path = None
        if path is not None and (path / "config.json").is_file() and _weights(path):
            return ResolvedModel(cfg.name, revision, path.name, path)
    try:
        path = Path(snapshot_download(cfg.name, revision=revision, allow_patterns=MODEL_FILES + SAFETENSORS,
                                      ignore_patterns=SKIPPED))
    except (OSError, ValueError, httpx2.HTTPError, httpx2.InvalidURL, XetDownloadError) as e:
        raise _unavailable(cfg, what, e) from e
    if not (path / "config.json").is_file():
        raise _refusal(cfg, what, f"the snapshot {path} has no config.json (not a transformers model?)")
    files = list(path.glob("*.safetensors"))
    if not files:  # an older repo with pytorch_model*.bin alone: opsd never unpickles weights
        raise _refusal(cfg, what, f"the snapshot {path} has no safetensors weights (*.safetensors; pickle weights "
                                  "such as pytorch_model*.bin are never loaded)")
    missing = [p.name for p in files if not p.is_file()]
    if missing:  # a snapshot link whose blob is gone (an interrupted download, a pruned cache)
        raise _refusal(cfg, what, f"the snapshot {path} links {', '.join(sorted(missing))} to a missing file")
    return ResolvedModel(cfg.name, revision, path.name, path)


def _weights(path: Path) -> bool:
    """True when every weights file of the snapshot `path` is readable (a link to its blob, not a dangling one)."""
    files = list(path.glob("*.safetensors"))
    return bool(files) and all(p.is_file() for p in files)


def _refusal(cfg: ModelSection, what: str, why: str) -> ModelUnavailableError:
    """The one line: the id, the revision, why, and the command that fetches it (which must override
    HF_HUB_OFFLINE when it is set)."""
    from huggingface_hub import constants

    revision = cfg.revision or "main"
    fetch = f"{'HF_HUB_OFFLINE=0 ' if constants.is_offline_mode() else ''}hf download {cfg.name} --revision {revision}"
    return ModelUnavailableError(f"{what} {cfg.name!r} revision {revision!r} is not available: {why}; fetch it with "
                                 f"`{fetch}` (or run `opsd prepare CONFIG` online: it fetches only the files opsd loads)")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _unavailable(cfg: ModelSection, what: str, e: BaseException) -> ModelUnavailableError:
    """The one-line refusal for huggingface_hub's error `e` (its classes, most specific first)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError, RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = cfg.revision or "main"
    cache = constants.HF_HUB_CACHE
    if isinstance(e, GatedRepoError):
        why = "the repository is gated: accept its terms on its Hub page, then set HF_TOKEN (or `hf auth login`)"
    elif isinstance(e, RepositoryNotFoundError):
        why = "the Hub has no such repository (or it is private: set HF_TOKEN to a token that can read it)"
    elif isinstance(e, RevisionNotFoundError):
        why = f"the repository has no revision {revision!r} (a branch, tag or commit)"
    elif isinstance(e, IncompleteSnapshotError):
        why = f"its snapshot in the Hugging Face cache ({cache}) misses files, and none can be fetched now"
    elif isinstance(e, LocalEntryNotFoundError):
        held = _cached_revisions(cache, cfg.name)
        held = f" (it holds {', '.join(held)})" if held else ""
        if constants.is_offline_mode():
            why = f"HF_HUB_OFFLINE is set and the revision is not in the Hugging Face cache ({cache}){held}"
        else:
            cause = e.__cause__ or e
            why = (f"no answer from the Hub ({type(cause).__name__}: {_first_line(cause)}) and the revision is not "
                   f"in the Hugging Face cache ({cache}){held}")
    elif isinstance(e, HfHubHTTPError):
        status = e.response.status_code if getattr(e, "response", None) is not None else "?"
        why = f"the Hub answered HTTP {status} ({_first_line(e)})"
    else:
        why = f"{type(e).__name__}: {_first_line(e)}"
    return _refusal(cfg, what, why)


def _cached_revisions(cache: str, name: str) -> list[str]:
    """The branch and tag names the Hugging Face cache holds for model `name` (its refs/ files), sorted."""
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(cache) / repo_folder_name(repo_id=name, repo_type="model") / "refs"
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []


def resolve_run(cfg: RunConfig) -> dict[str, ResolvedModel]:
    """Resolve a run's models once: {"model": ..., "teacher_model": ...}, the latter only when an external teacher
    scores (teacher.source model and a method with a teacher).

    Pins each Hub model's revision in `cfg` (in place) to its resolved commit, and makes a relative
    ``chat_template`` path absolute, so the config dumped afterwards makes every role load the same files. Raises as `resolve_model` (the teacher's messages say teacher.model).
    """
    out = {"model": resolve_model(cfg.model)}
    if cfg.needs_teacher and cfg.teacher.source == "model":
        out["teacher_model"] = resolve_model(cfg.teacher.model, "teacher.model")
    if out["model"].commit is not None:
        cfg.model = cfg.model.model_copy(update={"revision": out["model"].commit})
    if "teacher_model" in out and out["teacher_model"].commit is not None:
        cfg.teacher.model = cfg.teacher.model.model_copy(update={"revision": out["teacher_model"].commit})
    for section in (cfg.model, cfg.teacher.model):  # a relative template path means the same file for every role
        if section is not None and section.chat_template and "{" not in section.chat_template:
            section.chat_template = str(Path(section.chat_template).expanduser().absolute())
    return out


def write_run_models(run_dir: Path, models: dict[str, ResolvedModel]) -> Path:
    """Write ``<run_dir>/model.json``: {"model": record, "teacher_model": record (an external teacher only)}, each
    record {"name", "revision" (as asked), "commit" (null unless a Hub model), "path"}. Atomic (temp + rename)."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps({k: m.record() for k, m in models.items()}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_run_models(run_dir: Path) -> dict[str, dict] | None:
    """The records of ``<run_dir>/model.json`` (`write_run_models`), or None without a readable file (roles
    started one by one, by compose or k8s, have none)."""
    try:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
