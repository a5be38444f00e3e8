"""Fixtures shared by the kernel tests."""

import pytest

from pallas_kernels import row_gemv


@pytest.fixture
def gemv_spy(monkeypatch):
    """spy(module, sms=None, items=0, tiles=0, kernel=row_gemv, stages=None) -> a list that grows
    by one per call of ``module.gemv`` (a format's GEMV on ``kernel``: the one-row ``row_gemv``
    or the few-row ``mma_gemv``). With ``sms`` the kernel sees that many SMs, and the case must
    be what it is for: ``items`` items spread unevenly over the CTAs, ``tiles`` K tiles per item
    refilling the ring of ``stages`` slots (the kernel's ``_STAGES`` unless the plan says)."""

    def spy(module, sms=None, items=0, tiles=0, kernel=row_gemv, stages=None):
        if sms:
            monkeypatch.setattr(kernel, "num_sms", lambda: sms)
            assert items % (sms * kernel._CTAS_PER_SM) and tiles > (stages or kernel._STAGES)
        calls, real = [], module.gemv
        monkeypatch.setattr(module, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        return calls

    return spy
