"""Fixtures shared by the kernel tests."""

import pytest

from pallas_kernels import mma_gemv, row_gemv


@pytest.fixture
def gemv_spy(monkeypatch):
    """spy(module, sms=None, items=0, tiles=0, kernel=row_gemv, stages=None) -> a list that grows
    by one per call of ``module.gemv`` (a format's GEMV on ``kernel``: the one-row ``row_gemv``
    or the few-row ``mma_gemv``). With ``sms`` both kernels see that many SMs (the one-row
    choice between them compares their loads); with ``items`` too, the case must be what it is
    for: that many items spread unevenly over ``kernel``'s CTAs, ``tiles`` K tiles per item
    refilling the ring of ``stages`` slots (the kernel's ``_STAGES`` unless the plan says)."""

    def spy(module, sms=None, items=0, tiles=0, kernel=row_gemv, stages=None):
        if sms:
            for each in (row_gemv, mma_gemv):
                monkeypatch.setattr(each, "num_sms", lambda: sms)
        if sms and items:
            assert items % (sms * kernel._CTAS_PER_SM) and tiles > (stages or kernel._STAGES)
        calls, real = [], module.gemv
        monkeypatch.setattr(module, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        return calls

    return spy
