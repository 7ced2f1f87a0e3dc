"""The opening every kernel test module shares: on CPU the kernels run in Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel, so it is set here, when pytest loads
this folder -- before any test module of it imports ``normscope.kernels`` -- and kept at 1 while each
module's tests run (the Triton backend reads it per call); after each module the session's own value
(what it was before this folder was collected) is put back, so later test folders see the environment
they expect. ``NORMSCOPE_TEST_DEVICE=cuda`` (tests/conftest.py) runs the same modules on the compiled
kernels and leaves the variable alone.
"""

import os

import pytest

from conftest import TEST_DEVICE, kernel_interpreter_env

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module", autouse=True)
def _interpreter_env():
    yield from kernel_interpreter_env(_PREVIOUS_INTERPRET)
