"""The Triton kernels' tests: a package, so that this folder's conftest.py is ``kernels.conftest`` and
``from conftest import ...`` everywhere still reaches tests/conftest.py's shared helpers."""
