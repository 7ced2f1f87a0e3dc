"""(d) Run to run: the same call twice gives the same bits -- outputs, running statistics and every
gradient, the weight's and bias's included (a sum over scopes, which must not depend on scheduling:
the design forbids atomics in the dW/dB reduction)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .conftest import examples
from .harness import Cotangents, assert_bitwise
from .ops import draw_case, pairs, run


@pytest.mark.parametrize("op,path", pairs())
def test_the_same_call_twice_gives_the_same_bits(op, path):
    @examples(1, key=f"{op.name}-{path}")
    @given(data=st.data())
    def check(data):
        case = draw_case(op, path, data)
        cot = Cotangents()
        first, second = run(op, path, case, cot=cot), run(op, path, case, cot=cot)
        for name, g in first.grads.items():
            assert_bitwise(f"grad of {name}, second run", second.grads[name], g)
        for k, (a, b) in enumerate(zip(first.outputs, second.outputs)):
            assert_bitwise(f"output {k}, second run", b, a)
        for name, s in first.state.items():
            assert_bitwise(f"{name}, second run", second.state[name], s)

    check()
