"""How many draft positions a verify step takes (the verify width), chosen per step (#42 item 3).

On a MoE a verify step's cost follows the union of experts its rows route to, so verifying every draft
can cost more than it yields. Each step: for each width w = 0..k (T = 1 + w query tokens a request; w = 0
is a plain step) the expected tokens are sum over requests of 1 + the survival of its first w drafts
(survival: the probability that draft j and every one before it are accepted), and its cost is the
measured time of a (B, T) step; the width with the most expected tokens per millisecond wins. Verify graphs
are uniform per (B, T), so one width serves the whole step; per-request widths would need ragged verify
steps (rows = sum of 1 + w_i), which the specialized path does not have.
"""
from __future__ import annotations

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 4.0  # a drafter's per-position acceptance before it has been seen: 4 draws at 0.5
MIN_GAIN = 1.02  # a wider step must promise 2 % more tokens per ms than the narrower best (timing noise)


def expected_tokens(survival: list[list[float]], w: int) -> float:
    """Tokens a step at width w yields on average: each request's own token plus its surviving drafts."""
    return sum(1.0 + sum(s[:w]) for s in survival)


def choose_width(survival: list[list[float]], step_ms: dict[int, float]) -> int:
    """survival[i][j]: P(request i's drafts 0..j all accepted), non-increasing in j (requests without drafts: []).
    step_ms[T]: this batch's step time at T tokens a request (T = 1: the plain step). -> drafts a request (0: plain)."""
    best_w, best = 0, expected_tokens(survival, 0) / step_ms[1]
    for T in sorted(step_ms):
        w = T - 1
        if w < 1:
            continue
        rate = expected_tokens(survival, w) / step_ms[T]
        if rate > best * MIN_GAIN:
            best_w, best = w, rate
    return best_w


def survival_from_rates(conditional: list[float]) -> list[float]:
    """Per-position conditional acceptance (draft j accepted given 0..j-1 were) -> survival."""
    out, p = [], 1.0
    for c in conditional:
        p *= c
        out.append(p)
    return out


class AcceptanceTracker:
    """A drafter's conditional acceptance per draft position, learnt from its verifies (with a weak prior)."""

    def __init__(self, k: int):
        self.reached = [0] * k   # verifies in which position j was drafted and 0..j-1 were accepted
        self.accepted = [0] * k  # ... and position j was accepted too

    def record(self, drafted: int, accepted: int) -> None:
        for j in range(min(drafted, accepted + 1)):
            self.reached[j] += 1
            self.accepted[j] += j < accepted

    def survival(self, n: int) -> list[float]:
        return survival_from_rates([(self.accepted[j] + PRIOR_RATE * PRIOR_WEIGHT) / (self.reached[j] + PRIOR_WEIGHT)
                                    for j in range(n)])
