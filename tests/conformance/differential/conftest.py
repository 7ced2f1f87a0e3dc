"""Hypothesis settings of the differential suite: deterministic (a fixed seed per test and path, no
example database), no deadline, and a number of examples per path sized for CI's minutes.

Two environment variables widen a run without editing the suite (CI sets neither):

* ``NORMSCOPE_DIFF_EXAMPLES=N``: N examples per test and path wherever CI draws more than one (the
  threshold and one-layout tests keep their one; ``test_matches_torch`` shares them out between the
  dtypes, at least one each);
* ``NORMSCOPE_DIFF_SEED=S``: another fixed seed for every test (S an integer), for a sweep of seeds.
"""

from __future__ import annotations

import os
import zlib

from hypothesis import HealthCheck, Phase, seed, settings

#: examples per test and path: the Triton interpreter runs a kernel program at a time
EXAMPLES = {"triton": 2}
DEFAULT_EXAMPLES = 2

RAISED = int(os.environ.get("NORMSCOPE_DIFF_EXAMPLES", "0") or 0)
_SALT = os.environ.get("NORMSCOPE_DIFF_SEED", "")


def examples(n: int = DEFAULT_EXAMPLES, key: str | None = None):
    """Settings for ``n`` generated examples: reproducible in CI, shrinking off (a failing case is
    printed with every drawn choice labelled, and shrinking large cases would cost minutes).

    ``key`` (the test's parameters, e.g. ``"layer_norm-aten"``) seeds the draws: without one,
    hypothesis's derandomized seed is a digest of the test function, the *same* for every op and path
    of a parametrized test -- every pair then drew the same choices (the same dtype in each example,
    so bf16 was drawn on no CPU path; tests/conformance/differential/test_registry.py holds this)."""
    n = max(n, RAISED) if n > 1 else n
    s = settings(
        max_examples=n,
        deadline=None,
        derandomize=key is None and not _SALT,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    if key is None and not _SALT:
        return s

    def apply(test):
        return seed(zlib.crc32(f"{key}/{_SALT}".encode()))(s(test))

    return apply
