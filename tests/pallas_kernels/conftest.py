"""Fixtures shared by the kernel tests."""

import pytest

from pallas_kernels import row_gemv


@pytest.fixture
def gemv_spy(monkeypatch):
    """spy(module, sms=None, items=0, tiles=0) -> a list that grows by one per call of
    ``module.gemv`` (a format's one-row GEMV). With ``sms`` the GEMV sees that many SMs, and the
    case must be what it is for: ``items`` 16-row items spread unevenly over the CTAs, ``tiles``
    K tiles per item refilling the ring."""

    def spy(module, sms=None, items=0, tiles=0):
        if sms:
            monkeypatch.setattr(row_gemv, "num_sms", lambda: sms)
            assert items % (sms * row_gemv._CTAS_PER_SM) and tiles > row_gemv._STAGES
        calls, real = [], module.gemv
        monkeypatch.setattr(module, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        return calls

    return spy
