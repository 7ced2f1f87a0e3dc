"""``normscope.tour``: the short name of :mod:`normscope.tools.tour`, where the code lives."""

from .tools import tour as _target

__all__ = _target.__all__


def __getattr__(name: str):
    return getattr(_target, name)
