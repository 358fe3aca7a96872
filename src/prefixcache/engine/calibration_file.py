"""The calibration file: a prompt-only task's calibration, stored beside the task (``prefixcache fit --prompt-only``).

A task scored by its prompt alone (no fitted head) has no out-of-fold predictions to calibrate on, so
``fit --prompt-only`` scores labelled rows through the prompt, fits a temperature on them
(:func:`~prefixcache.engine.confidence.fit_temperature`) and writes this small JSON file; a task file
names it (``calibration: tickets.calibration.json``, relative to the task file) or ``--calibration``
does. Its keys: ``format`` (:data:`FORMAT`), ``task``, ``model``, ``prefix_sha256``, ``labels``,
``method`` (the scoring method it was fitted for), ``calibration``, ``rows`` (the fitted rows'
calibrated confidences and whether each was right, for ``--target-accuracy``) and ``ece`` (raw and
calibrated, on those rows). The temperature is fitted on the same rows its figures describe: one
number, so it barely overfits, but the figures are in-sample.

:func:`task_trust` is what a classifier does by default: the head's calibration, else the task's
calibration file, and the task's threshold (``min_confidence`` or ``target_accuracy``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ..errors import HeadMismatchError, InputError, setting
from .confidence import Calibration, Trust, threshold_for_accuracy
from .head_file import check, head_calibration, oof_rows

FORMAT = "prefixcache-calibration/1"


def save_calibration(document: Mapping, path: str | Path) -> Path:
    """Write a calibration document (sorted keys, indented) and return its path."""
    path = Path(path)
    path.write_text(json.dumps(dict(document, format=FORMAT), sort_keys=True, indent=1) + "\n", encoding="utf-8")
    return path


def load_calibration(path: str | Path) -> dict:
    """Read a calibration file.

    Raises:
        InputError: missing, unreadable, or not a prefixcache calibration file.
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"calibration file {str(path)!r} cannot be read ({exc}); write one with "
                         f"`prefixcache fit` with {setting('prompt_only')}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise InputError(f"{str(path)!r} is not a prefixcache calibration file; write one with `prefixcache fit` with "
                         f"{setting('prompt_only')}")
    return document


def stored_rows(head, calibration: Mapping | None):
    """The (confidence, correct) rows a threshold is chosen on: the head's out-of-fold rows, else the calibration
    file's rows, else None."""
    if head is not None:
        return oof_rows(head.manifest)
    return oof_rows({"oof": calibration.get("rows")}) if calibration else None


def choose_threshold(rows, min_confidence: float | None, target_accuracy: float | None):
    """``(min_confidence, Threshold or None)`` from a direct threshold or a target accuracy over ``rows``.

    Raises:
        InputError: a target with no stored rows to choose on, or one that even the most confident rows miss.
    """
    if target_accuracy is None:
        return min_confidence, None
    if rows is None:
        raise InputError(f"{setting('target_accuracy')} chooses a threshold on a head's out-of-fold predictions or a "
                         f"calibration file's rows, and there are none: fit a head (or a calibration file: `prefixcache fit` "
                         f"with {setting('prompt_only')}), "
                         f"or give {setting('min_confidence')}")
    found = threshold_for_accuracy(*rows, target_accuracy)
    if found is None:
        raise InputError(f"no threshold reaches {target_accuracy:.1%} accuracy on the {len(rows[0])} stored rows: "
                         f"lower {setting('target_accuracy')}")
    return found.threshold, found


def task_trust(task, head, loaded, prompt, calibration_path=None, min_confidence=None, target_accuracy=None) -> Trust:
    """The calibration and threshold of a classifier of ``task``: ``head``'s calibration, else the calibration file
    (``calibration_path``, else the task's ``calibration:``), checked against the model, prompt and labels; the
    threshold given, else the task file's.

    Raises:
        HeadMismatchError: the calibration file was fitted for another model, prompt or label set.
        InputError: see :func:`load_calibration` and :func:`choose_threshold`.
    """
    path = calibration_path or getattr(task, "calibration", None)
    document = load_calibration(path) if path is not None and head is None else None
    if document is not None:
        try:
            check(document, loaded, prompt, list(prompt.label_ids))
        except HeadMismatchError as exc:
            raise HeadMismatchError(str(exc).replace("this head", "this calibration file")) from None
    calibration = head_calibration(head) if head is not None else (
        Calibration.from_json(document["calibration"]) if document else Calibration())
    if min_confidence is None and target_accuracy is None:
        min_confidence, target_accuracy = getattr(task, "min_confidence", None), getattr(task, "target_accuracy", None)
    threshold, chosen = choose_threshold(stored_rows(head, document), min_confidence, target_accuracy)
    return Trust(calibration, threshold, chosen)
