"""Which regexes (``pattern``, ``patternProperties``' names, ``guided_regex``) the engine's
grammar compiler, xgrammar 0.2.9, would misread or match slowly: checked at the gateway, in
one pass over the pattern (``json_schema_check`` uses it for a schema's patterns)."""

import re
from typing import Any

# a regex's characters: the engine's bound on any grammar (its params.MAX_GRAMMAR_CHARS), read
# before the pattern is (the gateway's max_grammar_chars, lower, is checked after validation)
MAX_PATTERN_CHARS = 1 << 20
# escapes xgrammar's regex reads (others but a few errors it raises become plain letters)
ESCAPES = frozenset("dDwWsSnrtfvae0xuc")


def regex_problem(pattern: str) -> str | None:
    """What of ``pattern`` the grammar engine would silently drop or misread, or None. (Syntax
    errors and the constructs it refuses outright come back from the engine as a 400.)"""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"a pattern is at most {MAX_PATTERN_CHARS} characters"
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1 : i + 2]
            if e.isascii() and e.isalnum() and e not in ESCAPES and not (in_class and e == "b"):
                return f"the escape \\{e} is not supported by the grammar engine (xgrammar)"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1
            i += 1 if pattern[i : i + 1] == "]" else 0  # a literal "]" first
            continue
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "lookaround assertions ((?=, (?!, (?<=, (?<!) are not supported: the grammar " \
                "engine (xgrammar) would ignore them"  # fmt: skip
        elif c == "^" and i > 0 and not pattern.endswith(("(", "|", "(?:", "(?i)"), 0, i):
            return "^ in the middle of a pattern is not supported: the grammar engine would " \
                "ignore it"  # fmt: skip
        elif c == "$" and i < n - 1 and pattern[i + 1] not in ")|":
            return "$ in the middle of a pattern is not supported: the grammar engine would " \
                "ignore it"  # fmt: skip
        i += 1
    return _nested_repetition(pattern)


_COUNTS = re.compile(r"\{([0-9]{1,9})(,([0-9]{0,9}))?\}")  # (longer: no count, a literal)


def _quantifier(pattern: str, i: int) -> tuple[int, int | None, int] | None:
    """The quantifier at ``i`` (``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}``): its least
    and most counts (None: unbounded) and where it ends (past a lazy or possessive mark)."""
    c = pattern[i : i + 1]
    hi: int | None
    if c in ("*", "+", "?"):
        lo, hi, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] + (i + 1,)
    elif c == "{":
        m = _COUNTS.match(pattern, i)  # (anchored at i and ASCII digits only: linear in all)
        if m is None:
            return None  # a literal "{"
        lo, end = int(m[1]), m.end()
        hi = (int(m[3]) if m[3] else None) if m[2] else lo
    else:
        return None
    return lo, hi, end + (pattern[end : end + 1] in ("?", "+"))


def _nested_repetition(pattern: str) -> str | None:
    """A repeated group whose whole body is one item repeated a varying number of times
    (``(a*)*``, ``(a{1,100}){1,100}``): the same text splits between the two repetitions in
    many ways and the grammar engine's matcher follows every split, so that each generated
    token costs the worker's step milliseconds to seconds (measured with xgrammar 0.2.9:
    ``(a{1,100}){1,100}`` 77 ms a token by the 200th, ``((a{1,100}){1,100}){1,100}`` 1.8 s).
    The two repetitions are one (``a*``, ``a{1,10000}``), so it is refused, not rewritten."""
    stack: list[list[Any]] = [[0, False, False]]  # a group's items, last one varies, "|" seen
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            if pattern[i + 1 : i + 2] == "?" and pattern[i + 2 : i + 3] not in (":", "P", "<"):
                i = pattern.find(")", i) + 1 or n  # a flag group, (?i): no item
                continue
            stack.append([0, False, False])
            i += 3 if pattern.startswith("(?:", i) else 1
            if pattern.startswith(("?P<", "?<"), i):
                i = pattern.find(">", i) + 1 or n
            continue
        if c == "|":
            stack[-1][2] = True
            i += 1
            continue
        one_varying = False
        if c == ")" and len(stack) > 1:
            items, varies, alternation = stack.pop()
            one_varying = items == 1 and varies and not alternation
            i += 1
        elif c == "\\":
            i += 2
        elif c == "[":  # a class is one item
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1
            i += 1 if pattern[i : i + 1] == "]" else 0
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        else:
            i += 1
        stack[-1][0] += 1  # the item that ends at i, and its quantifier
        stack[-1][1] = one_varying  # ((a*)) varies as (a*) does
        q = _quantifier(pattern, i)
        if q is not None:
            lo, hi, i = q
            if one_varying and (hi is None or hi >= 2):
                return (
                    "a repeated group whose body is one varying repetition (as (a*)* or "
                    "(a{1,100}){1,100}) is not supported: the grammar engine's matching "
                    "of it slows every token; write the two as one repetition"
                )
            stack[-1][1] = hi is None or hi > lo
    return None
