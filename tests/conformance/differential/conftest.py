"""Hypothesis settings of the differential suite: deterministic (derandomized, no example database),
no deadline, and a number of examples per path sized for CI's minutes."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

#: examples per test and path: the Triton interpreter runs a kernel program at a time
EXAMPLES = {"triton": 2}
DEFAULT_EXAMPLES = 2


def examples(n: int = DEFAULT_EXAMPLES):
    """Settings for ``n`` generated examples: reproducible in CI, shrinking off (a failing case is
    printed with every drawn choice labelled, and shrinking large cases would cost minutes)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
