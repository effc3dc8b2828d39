"""A library's exception, as a client may read it: its own words, without where it was raised.

Grammar compilers and template engines say what is wrong with a request in their exceptions, and also
where in their own code they noticed it: xgrammar prefixes a timestamp and its C++ source file and line
("[05:59:55] /project/cpp/json_schema_converter.cc:4944: Type should be a string") and may add a check's
condition or a stack trace; a Python object's repr carries its module and address. A request's error
keeps the first and drops the rest (and is cut short: some messages echo the whole input back).
"""

from __future__ import annotations

import re

MAX_CHARS = 300
_SOURCE_LOCATION = re.compile(r"\[[\d:.]+\]\s*\S+:\d+:\s*")  # "[05:59:55] /project/cpp/file.cc:123: "
_CHECK_FAILED = re.compile(r"Check failed: .*? is (?:false|true):\s*")
_SOURCE_PATH = re.compile(r"(?:/[\w.+\-]+)+\.(?:cc|cpp|cxx|c|h|hpp|py|pyx|rs|so)\b(?::\d+)?")
_QUOTED_INPUT = re.compile(r"\s*The JSON string is:.*", re.DOTALL)  # xgrammar quotes the whole schema back
_OBJECT_REPR = re.compile(r"<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-fA-F]+>")


def library_message(exc: BaseException) -> str:
    text = str(exc).split("Stack trace:")[0].split("Traceback (most recent call last)")[0]
    text = _QUOTED_INPUT.sub("", text)
    text = _SOURCE_LOCATION.sub("", text)
    text = _CHECK_FAILED.sub("", text)
    text = _SOURCE_PATH.sub("", text)
    text = _OBJECT_REPR.sub(r"<\1>", text)
    text = " ".join(text.split())  # one line
    if len(text) > MAX_CHARS:
        text = text[: MAX_CHARS - 1] + "…"
    return text or type(exc).__name__
