"""prefixcache: run small language models on narrow automation jobs through a cached prompt prefix.

The library surface::

    from prefixcache import load_model, load_task, Classifier, RunConfig, Record
    clf = Classifier(load_model("smollm2-135m"), load_task("support-tickets"))
    for p in clf.classify([Record(0, {"text": "I was charged twice"})], RunConfig("batched", 32)):
        print(p.id, p.label, p.scores.probabilities)
"""

from .errors import PrefixCacheError
from .model.load import load_model
from .run.classify import Classifier, Prediction, Record, RunConfig
from .spec.task import Task, load_task

__all__ = ["Classifier", "Prediction", "PrefixCacheError", "Record", "RunConfig", "Task", "load_model", "load_task"]
__version__ = "0.1.0"
