"""``normscope.explorer``: the short name of :mod:`normscope.tools.explorer`, where the code lives."""

from .tools import explorer as _target

__all__ = _target.__all__


def __getattr__(name: str):
    return getattr(_target, name)


if __name__ == "__main__":  # python -m normscope.explorer
    import sys

    sys.exit(_target.main())
