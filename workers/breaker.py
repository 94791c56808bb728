"""The worker's circuit breaker: when a worker stops serving instead of failing every
request it is sent (``workers.engine_thread``, ``workers.runtime``)."""

from __future__ import annotations

# Failed engine steps in a row after which a worker stops for its supervisor to restart
# it: a sticky fault (a CUDA error, an engine wedged in a bad state) would otherwise fail
# every request sent to a worker that still heart-beats, and is still routed to.
MAX_FAILED_STEPS = 3
# What a broken worker's leases are cut to: gone at once (PEXPIRE 0 deletes the key,
# where it is still this worker's), so its requests resume elsewhere now.
LEASE_GIVEN_BACK_S = 0.0
# Errors after which a device is unusable until the process restarts (CUDA's sticky
# errors: every later call on the context fails the same way).
_FATAL_MARKERS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "CUBLAS_STATUS",
    "cuDNN error",
)


def unrecoverable(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the engine unusable: no step can succeed after it."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ == "AcceleratorError" or any(m in text for m in _FATAL_MARKERS)
