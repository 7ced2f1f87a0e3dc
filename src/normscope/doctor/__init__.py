"""``normscope doctor``: diagnose a model's normalization layers on a real batch.

One forward with hooks measures what each norm sees; each check turns a classic failure of
normalization into a number, a threshold with its source, a severity and a fix::

    report = normscope.doctor(model, x)
    for f in report.findings:                 # most serious first
        print(f.severity, f.check, f.module, f.measured, f.fix)
    report.to_json()                          # schema "normscope.doctor/1"

The model's state is put back bit for bit afterwards. :func:`recalibrate` is the fix for running
statistics that drifted from the data (fvcore's PreciseBN estimator). :func:`watch` is the doctor during
training: forward hooks around a training loop, findings with the step they were first seen (docs/watch.md).
"""

from ._fix import apply_fixes
from ._report import SCHEMA, SEVERITIES, Finding, Group, Report, Series
from ._run import doctor, recalibrate
from ._watch import WATCH_CHECKS, Watch, watch
from .checks import CHECKS

__all__ = [
    "doctor",
    "recalibrate",
    "apply_fixes",
    "watch",
    "Watch",
    "Report",
    "Finding",
    "Group",
    "Series",
    "CHECKS",
    "WATCH_CHECKS",
    "SCHEMA",
    "SEVERITIES",
]
