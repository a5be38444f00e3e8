"""Mosaic GPU KDA kernels (work in progress)."""

SUPPORTED_DIMS = (64, 128)


def check_kernel_dims(kd, vd):
  if kd not in SUPPORTED_DIMS or vd != kd:
    raise ValueError(f"the Pallas KDA kernels need K == V in {SUPPORTED_DIMS}, got K={kd}, "
                     f"V={vd}; use backend='xla' for other head sizes")


def chunk_kda_pallas(q, k, v, g, beta, **kw):
  check_kernel_dims(q.shape[-1], v.shape[-1])
  raise NotImplementedError("Pallas chunk_kda is not written yet; use backend='xla'")


def kda_decode_pallas(q, k, v, g, beta, state_pool, slots, **kw):
  check_kernel_dims(q.shape[-1], v.shape[-1])
  raise NotImplementedError("Pallas kda_decode is not written yet; use backend='xla'")


def kda_verify_pallas(q, k, v, g, beta, state_pool, slots, **kw):
  check_kernel_dims(q.shape[-1], v.shape[-1])
  raise NotImplementedError("Pallas kda_verify is not written yet; use backend='xla'")
