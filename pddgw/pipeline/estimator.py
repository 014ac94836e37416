"""Online estimate of one link's bandwidth and RTT, for the pipeline policy.

Each quantity is an EWMA over the median of the last `window` samples: the
median absorbs a few outliers (a GC pause, a transfer that queued behind
another) as long as they are under half the window, and the EWMA smooths
what is left.  Until samples arrive the estimate is the configured prior.
A level shift - a full window of samples all more than `shift` (25 %) away
from the estimate on the same side, e.g. the WAN's bandwidth stepping down
or up - moves the estimate to their median at once: the link changed, and
an EWMA would take tens of transfers to follow it.  Otherwise a sequence of
n identical samples x moves the estimate from P to x + (1 - alpha)^n * (P - x).

Bandwidth samples are (bytes, seconds the bytes were in service on the wire)
as the sending link measured them, so queueing behind other traffic does not
read as a slow link; RTT samples are heartbeat round trips, each counted once.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pddgw.config import PolicyConfig


class RobustEwma:
    """EWMA of the running median of the last `window` samples."""

    def __init__(self, prior: float, alpha: float, window: int, shift: float = 0.25) -> None:
        if not 0.0 < alpha <= 1.0 or window < 1 or shift <= 0:
            raise ValueError("need 0 < alpha <= 1, window >= 1 and shift > 0")
        self.value = prior
        self.alpha = alpha
        self.shift = shift
        self.samples = 0
        self._window: deque[float] = deque(maxlen=window)

    def update(self, x: float) -> float:
        self._window.append(x)
        self.samples += 1
        med = statistics.median(self._window)
        w, v, k = self._window, self.value, self.shift
        # A shift needs a few samples to tell it from an outlier: windows under 3 never shift.
        if w.maxlen is not None and len(w) == w.maxlen >= 3 and (all(s > v * (1 + k) for s in w)
                                                                 or all(s < v * (1 - k) for s in w)):
            self.value = med
        else:
            self.value += self.alpha * (med - self.value)
        return self.value


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    bandwidth_bytes_per_s: float
    rtt_ms: float
    bandwidth_samples: int
    rtt_samples: int

    def transfer_ms(self, nbytes: int) -> float:
        """Time for `nbytes` to land on the far side: one-way latency + serialisation."""
        return self.rtt_ms / 2.0 + nbytes * 1000.0 / self.bandwidth_bytes_per_s


class LinkEstimator:
    """Bandwidth and RTT of one link (e.g. the WAN between cluster A and B)."""

    def __init__(self, *, prior_bandwidth_bytes_per_s: float, prior_rtt_ms: float,
                 alpha: float = 0.2, window: int = 5, min_sample_bytes: int = 65_536) -> None:
        if prior_bandwidth_bytes_per_s <= 0 or prior_rtt_ms < 0 or min_sample_bytes < 1:
            raise ValueError("need bandwidth > 0, rtt >= 0, min_sample_bytes >= 1")
        self._bw = RobustEwma(prior_bandwidth_bytes_per_s, alpha, window)
        self._rtt = RobustEwma(prior_rtt_ms, alpha, window)
        self.min_sample_bytes = min_sample_bytes

    @classmethod
    def from_config(cls, cfg: PolicyConfig) -> LinkEstimator:
        return cls(prior_bandwidth_bytes_per_s=cfg.link_prior_mbps * 1e6 / 8.0,
                   prior_rtt_ms=cfg.link_prior_rtt_ms, alpha=cfg.link_ewma_alpha,
                   window=cfg.link_median_window, min_sample_bytes=cfg.link_min_sample_bytes)

    def observe_transfer(self, nbytes: int, seconds: float) -> bool:
        """A transfer of `nbytes` kept the link busy for `seconds`.

        Measure at the link layer (first byte written to last byte
        acknowledged, not counting time spent waiting for P to compute the
        bytes), else the sample measures prefill speed.  Transfers under
        `min_sample_bytes` are latency-dominated and are ignored; returns
        whether the sample was used.
        """
        if nbytes < 0 or seconds < 0:
            raise ValueError("nbytes and seconds must be >= 0")
        if nbytes < self.min_sample_bytes or seconds == 0:
            return False
        self._bw.update(nbytes / seconds)
        return True

    def observe_rtt(self, rtt_ms: float) -> None:
        """A round trip (heartbeat ping/pong, request/ack) took `rtt_ms`."""
        if rtt_ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        self._rtt.update(rtt_ms)

    def estimate(self) -> LinkEstimate:
        return LinkEstimate(self._bw.value, self._rtt.value, self._bw.samples, self._rtt.samples)
