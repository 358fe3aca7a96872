"""The bench tests' peaks: the bench measures the matmul peak and the model's projection shapes for
``seconds`` of wall clock per size and dtype (0.6 s each by default, about 4 s per bench run whatever the
model). The tests check that the peaks are measured, positive and used in the percentages, not their
precision, so here each is measured over a short window on the smaller of the default sizes."""

from __future__ import annotations

from functools import partial

import pytest

from prefixcache.bench import job, roofline


@pytest.fixture(autouse=True)
def short_peak_windows(monkeypatch):
    monkeypatch.setattr(job, "matmul_peak_gflops", partial(roofline.matmul_peak_gflops, seconds=0.05, sizes=(1024,)))
    monkeypatch.setattr(job, "shape_peak", partial(roofline.shape_peak, seconds=0.05))
