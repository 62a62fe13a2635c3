"""flame.errors.first_line: the one line a report quotes from an exception."""

import pytest

from flame.errors import first_line


@pytest.mark.parametrize(
    "message, expected",
    [
        ("\n  shape mismatch  \nmore detail", "shape mismatch"),
        # torch's BackendCompilerFailed introduces the inner error on the next line
        (
            "backend='inductor' raised:\nInductorError: out of resource\ntraceback",
            "backend='inductor' raised: InductorError: out of resource",
        ),
        ("ends with a colon:", "ends with a colon:"),
        ("x" * 400, "x" * 300),
    ],
)
def test_first_line(message, expected):
    assert first_line(RuntimeError(message)) == expected


def test_first_line_of_an_empty_message_is_the_type():
    assert first_line(KeyError()) == "KeyError"
