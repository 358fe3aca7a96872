"""prefixcache: run small language models on narrow automation jobs through a cached prompt prefix.

The library surface::

    from prefixcache import load_model, load_task, Classifier, RunConfig, Record
    clf = Classifier(load_model("smollm2-135m"), load_task("support-tickets"))
    for p in clf.classify([Record(0, {"text": "I was charged twice"})], RunConfig("batched", 32)):
        print(p.id, p.label, p.confidence, p.abstained)  # label None when it abstained (see Trust)

The names load lazily (a module ``__getattr__``): ``import prefixcache`` imports neither torch nor
transformers; the first use of ``Classifier`` or ``load_model`` does.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_LAZY = {
    "Classifier": ".scheduler.classify",
    "Mode": ".types",
    "Prediction": ".types",
    "PrefixCacheError": ".errors",
    "Record": ".types",
    "RunConfig": ".types",
    "Task": ".task.definition",
    "load_model": ".model.load",
    "load_task": ".task.definition",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
