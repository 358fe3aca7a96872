"""The head file: a fitted label head as one ``.safetensors`` file, with its JSON manifest inside.

Layout: two float32 tensors, ``weight [L, F]`` and ``bias [L]``, and one metadata entry,
``prefixcache.head``, holding the manifest as JSON (sorted keys, no whitespace, no timestamps),
so saving a loaded head writes the same bytes. The manifest (:data:`MANIFEST_KEYS`):

* ``format``: :data:`FORMAT`;
* ``model``: the model's ``identity``; ``dtype``: the dtype the features were computed in;
* ``prefix_sha256``: SHA-256 of the stored prefix's token ids (:func:`~prefixcache.cache.disk.token_hash`);
* ``feature``: the feature spec; ``labels``: the label order; ``prompt_scale``: see
  :class:`~prefixcache.engine.head.FittedHead`;
* ``training``: ``rows`` and ``text_sha256``, the sorted SHA-256 of every training row's normalized
  text (:func:`text_hash`), which ``eval`` reads to refuse rows the head was fitted on;
* ``cv``: the cross-validated figures (``accuracy``, ``macro_f1``, ``folds``, ``C``, ...);
* ``calibration`` (optional; heads written before it load without one): the temperature fitted on the
  cross-validated out-of-fold predictions (:class:`~prefixcache.engine.confidence.Calibration`), and
  ``oof``: those rows' calibrated confidences and whether each was right, from which ``--target-accuracy``
  picks a threshold (:func:`oof_rows`);
* ``versions``: prefixcache, torch, transformers and scikit-learn;
* ``tuned`` (only in a head with a tuned prefix): how the prefix was fitted (:mod:`prefixcache.eval.tune_prefix`):
  its length, epochs, learning rate, seed, the held-out rows and their accuracy, and which ``head`` the file
  carries (``refitted`` on the tuned prefix's states, with ``refit``: how, :mod:`prefixcache.eval.tune_refit`;
  or ``joint``, trained with the prefix); a tuned prefix's ``calibration`` and ``oof`` come from the held-out rows.
  The prefix itself is stored beside ``weight`` and ``bias`` as ``prefix.token_ids [P]`` and float32
  ``prefix.k.{i}``, ``prefix.v.{i}`` ``[1, kv_heads, P, head_dim]`` per layer, and read back bit for bit.

:func:`check` refuses a head against another model, prompt, label set or feature spec; :func:`check_fields` an
extraction task's tuned prefix (no labels; ``fields``: the task's field names, in order) against another model,
prompt or field set.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from ..cache.disk import token_hash
from ..cache.kv import PrefixKV
from ..errors import HeadMismatchError, InputError, setting
from ..task.selection import normalize_text
from .confidence import Calibration, Trust
from .head import FittedHead

FORMAT = "prefixcache-head/1"
PREFIX = "prefix."  # the tensor names of a tuned prefix start so
METADATA_KEY = "prefixcache.head"
MANIFEST_KEYS = ("format", "model", "dtype", "prefix_sha256", "feature", "labels", "prompt_scale", "training", "cv", "versions")
VERSIONED = {"prefixcache": "prefixcache", "torch": "torch", "transformers": "transformers", "scikit-learn": "scikit-learn"}


def text_hash(fields: Mapping[str, object], names: Sequence[str]) -> str:
    """SHA-256 of a row's normalized text: its ``names`` fields, each normalized
    (:func:`~prefixcache.task.selection.normalize_text`: case-folded, punctuation dropped, spaces collapsed),
    joined by newlines. Two rows that ``eval`` would call the same text get the same hash."""
    text = "\n".join(normalize_text(str(fields.get(name, ""))) for name in names)
    return hashlib.sha256(text.encode()).hexdigest()


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a head depends on (``"absent"`` when not installed)."""
    versions = {}
    for key, dist in VERSIONED.items():
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[key] = "absent"
    return versions


def prefix_hash(prompt) -> str:
    """The hash a head keeps of a prompt: SHA-256 of its stored prefix's token ids."""
    return token_hash(prompt.prefix_ids)


def manifest_json(manifest: Mapping) -> str:
    """The manifest's one canonical JSON text (sorted keys, compact)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def save_head(head: FittedHead, path: str | Path) -> Path:
    """Write ``head`` (tensors and ``head.manifest``) to ``path``. Deterministic: same head, same bytes."""
    missing = [key for key in MANIFEST_KEYS if key not in head.manifest]
    if missing:
        raise ValueError(f"the head's manifest lacks {missing}")
    manifest = dict(head.manifest, labels=list(head.labels), feature=head.feature, prompt_scale=head.prompt_scale)
    tensors = {"weight": head.weight.float().contiguous(), "bias": head.bias.float().contiguous()}
    if head.prefix is not None:
        tensors |= {f"{PREFIX}{name}": t.float() if name != "token_ids" else t for name, t in head.prefix.to_tensors().items()}
    path = Path(path)
    save_file(tensors, str(path), metadata={METADATA_KEY: manifest_json(manifest)})
    return path


def load_head(path: str | Path) -> FittedHead:
    """Read a head file.

    Raises:
        InputError: the file is missing, not a safetensors file, or not a prefixcache head.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"head file {str(path)!r} does not exist; fit one with `prefixcache fit`")
    try:
        with safe_open(str(path), framework="pt") as handle:
            text = (handle.metadata() or {}).get(METADATA_KEY)
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"head file {str(path)!r} cannot be read ({exc}); fit it again with `prefixcache fit`") from exc
    try:
        manifest = json.loads(text) if text else None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"no {FORMAT} manifest")
        return FittedHead(
            tensors["weight"], tensors["bias"], float(manifest["prompt_scale"]), tuple(manifest["labels"]),
            manifest["feature"], manifest, _stored_prefix(tensors),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{str(path)!r} is not a prefixcache head file ({exc}); fit one with `prefixcache fit`") from exc


def _stored_prefix(tensors: Mapping[str, torch.Tensor]) -> PrefixKV | None:
    """The tuned prefix stored in a head file's tensors, or None when it has none."""
    named = {name.removeprefix(PREFIX): t for name, t in tensors.items() if name.startswith(PREFIX)}
    return PrefixKV.from_tensors(named) if named else None


def head_for(task, head: FittedHead | str | Path | None = None) -> FittedHead | None:
    """The head to use for ``task``: ``head`` (a head, or a path to load), else the task file's ``head:``, else None.

    Raises:
        InputError: the file cannot be read as a head.
    """
    if isinstance(head, FittedHead):
        return head
    path = head if head is not None else getattr(task, "head", None)
    return load_head(path) if path is not None else None


def head_calibration(head: FittedHead | None) -> Calibration:
    """The calibration a head file stores, or the identity (no head, or a head fitted before calibration)."""
    stored = head.manifest.get("calibration") if head is not None else None
    return Calibration.from_json(stored) if stored else Calibration()


def head_trust(head: FittedHead | None) -> Trust:
    """What a classifier through ``head`` does by default: the head's calibration, no threshold."""
    return Trust(head_calibration(head))


def oof_rows(manifest: Mapping) -> tuple[list[float], list[bool]] | None:
    """The stored out-of-fold (confidence, correct) rows, or None when the head has none."""
    oof = manifest.get("oof")
    if not oof:
        return None
    return [float(c) for c in oof["confidence"]], [bool(k) for k in oof["correct"]]


def describe_head(head: FittedHead | None) -> dict | None:
    """What a listing shows of a head (``GET /v1/tasks``): feature, kind, labels, training rows, CV figures."""
    if head is None:
        return None
    cv, training = head.manifest.get("cv", {}), head.manifest.get("training", {})
    return {"feature": head.feature, "on_prompt": head.on_prompt, "labels": len(head.labels),
            "training_rows": training.get("rows"), "cv_accuracy": cv.get("accuracy"), "cv_macro_f1": cv.get("macro_f1"),
            "fitted_for_task": head.manifest.get("task"), "tuned_prefix_tokens": head.prefix.length if head.tuned else None}


def check(manifest: Mapping, loaded, prompt, labels: Sequence[str], feature: str | None = None) -> None:
    """Refuse a head fitted for something else.

    Args:
        loaded: the model the head is applied with (its ``identity``).
        prompt: the prompt whose stored prefix conditions the features (its ``prefix_ids``).
        labels: the task's label order. ``feature``: the feature spec asked for (None: not checked).

    Raises:
        HeadMismatchError: naming each of model / prompt / labels / feature that differs, expected vs found.
    """
    found = {"model": loaded.identity, "prompt": prefix_hash(prompt), "labels": list(labels)}
    expected = {"model": manifest.get("model"), "prompt": manifest.get("prefix_sha256"), "labels": manifest.get("labels")}
    if feature is not None:
        found["feature"], expected["feature"] = str(feature), manifest.get("feature")
    _refuse_differences(found, expected)


def check_fields(manifest: Mapping, loaded, prompt, fields: Sequence[str]) -> None:
    """Refuse an extraction task's tuned prefix (``fit --task T --tune prefix``, manifest ``fields``) fitted for
    another model, prompt or field set.

    Raises:
        HeadMismatchError: naming each of model / prompt / fields that differs, expected vs found.
    """
    found = {"model": loaded.identity, "prompt": prefix_hash(prompt), "fields": list(fields)}
    expected = {"model": manifest.get("model"), "prompt": manifest.get("prefix_sha256"), "fields": manifest.get("fields")}
    _refuse_differences(found, expected)


def _refuse_differences(found: Mapping, expected: Mapping) -> None:
    differ = [name for name in found if found[name] != expected[name]]
    if differ:
        detail = "; ".join(_difference(name, expected[name], found[name]) for name in differ)
        raise HeadMismatchError(
            f"this head was fitted for another {' and '.join(differ)} ({detail}); "
            f"fit a head for this task and model with `prefixcache fit`, or drop {setting('head')}"
        )


def _difference(name: str, expected, found) -> str:
    text = f"{name}: the head expects {_show(name, expected)}, found {_show(name, found)}"
    if name in ("labels", "fields") and isinstance(expected, list):
        missing, extra = [x for x in expected if x not in found], [x for x in found if x not in expected]
        text += f" (not in the task: {missing}; not in the head: {extra})" if missing or extra else " (another order)"
    return text


def _show(name: str, value) -> str:
    if name == "prompt" and isinstance(value, str):
        return f"prefix sha256 {value[:12]}…"
    if name in ("labels", "fields") and isinstance(value, list):
        return f"{len(value)} {name} [{', '.join(map(str, value[:6]))}{', …' if len(value) > 6 else ''}]"
    return repr(value)


def same_dtype(manifest: Mapping, dtype: torch.dtype) -> bool:
    """Whether the head's features were computed in ``dtype`` (another dtype works, with drift)."""
    return manifest.get("dtype") == str(dtype).removeprefix("torch.")
