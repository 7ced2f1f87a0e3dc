"""``normscope.lab``: the short name of :mod:`normscope.tools.lab`, where the code lives."""

from .tools import lab as _target

__all__ = _target.__all__


def __getattr__(name: str):
    return getattr(_target, name)


if __name__ == "__main__":  # python -m normscope.lab
    import sys

    sys.exit(_target.main())
