"""What a client reads of a library's exception (common/library_errors.py): its words, not its internals."""

from __future__ import annotations

import pytest

from common.library_errors import MAX_CHARS, library_message


class Undefined:
    pass


@pytest.mark.parametrize(
    "raised, read",
    [
        (  # xgrammar: a timestamp and its C++ source file and line first
            RuntimeError("[05:59:55] /project/cpp/json_schema_converter.cc:4944: Type should be a string\n"),
            "Type should be a string",
        ),
        (
            RuntimeError(
                "[05:59:55] /project/cpp/json_schema_converter.cc:4939: Check failed: (error.empty()) is false: "
                "Failed to parse JSON: syntax error at line 1"
            ),
            "Failed to parse JSON: syntax error at line 1",
        ),
        (
            RuntimeError(
                "[06:00:01] /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 10: Rule "
                '"foo" is not defined\nStack trace:\n  [bt] (0) /usr/lib/libxgrammar.so(+0x1234) [0x7f00]'
            ),
            'EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
        (  # a Python object's repr: its class, not its module and address
            TypeError(f"unsupported operand type(s) for +: {Undefined()!r} and 'int'"),
            "unsupported operand type(s) for +: <Undefined> and 'int'",
        ),
        (  # a template's own words are kept as they are
            ValueError("Conversation roles must alternate user/assistant/user/assistant/..."),
            "Conversation roles must alternate user/assistant/user/assistant/...",
        ),
        (ValueError(""), "ValueError"),
    ],
)
def test_a_library_message_keeps_its_words_and_drops_its_internals(raised, read):
    assert library_message(raised) == read


def test_a_library_message_that_echoes_its_input_is_cut_short():
    message = library_message(RuntimeError("bad input: " + "x" * 10_000))
    assert len(message) == MAX_CHARS and message.endswith("…")
