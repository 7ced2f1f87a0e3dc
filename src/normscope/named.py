"""``normscope.named``: the short name of :mod:`normscope.tools.named`, where the code lives."""

from .tools import named as _target

__all__ = _target.__all__


def __getattr__(name: str):
    return getattr(_target, name)
