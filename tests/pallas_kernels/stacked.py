"""The kernel tests' slow cases where the tier depends on two arguments at once ("the TPU interpreter's form, but not
on this case"), which a mark on one argument's value cannot say: the product that stacked ``pytest.mark.parametrize``
decorators would give, as one parametrisation with the same ids and order, and the slow mark per combination."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

_PARAM = type(pytest.param(None))


def stacked(*axes: tuple, slow: Callable[..., bool]) -> tuple[str, list]:
    """``@pytest.mark.parametrize(*stacked(("impl", IMPLS), ("case", CASES, ids), slow=lambda impl, case: ...))``.

    Each axis is (argnames, values) or (argnames, values, ids), as a decorator takes them, listed in the order
    their parts read in the test's id (the decorator nearest the function first). Every combination keeps its
    values' own marks (``pytest.param(..., marks=pytest.mark.gpu)``) and gets ``pytest.mark.slow`` where
    ``slow`` returns True, called with each axis's part of the id (``"tpu_interpret"``, ``"case0"``, ``"3-8-3"``)."""
    columns = []
    for argnames, values, *ids in axes:
        several = "," in argnames
        column = []
        for index, value in enumerate(values):
            param = value if isinstance(value, _PARAM) else pytest.param(*(value if several else (value,)))
            part = ids[0][index] if ids else param.id
            if part is None:
                assert all(isinstance(v, (str, int, float, bool)) for v in param.values), (argnames, value)
                part = "-".join(str(v) for v in param.values)
            column.append((param, part))
        columns.append(column)
    params = []
    for combination in itertools.product(*columns):
        parts = [part for _, part in combination]
        marks = [mark for param, _ in combination for mark in param.marks]
        if slow(*parts):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(*(v for param, _ in combination for v in param.values), id="-".join(parts),
                                   marks=marks))
    return ", ".join(argnames for argnames, *_ in axes), params
