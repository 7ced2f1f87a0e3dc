"""``normscope.explain``: the short name of :mod:`normscope.tools.explain`, where the code lives."""

from .tools import explain as _target

__all__ = _target.__all__


def __getattr__(name: str):
    return getattr(_target, name)
