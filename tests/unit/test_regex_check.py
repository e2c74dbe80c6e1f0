"""The gateway's regex lint (services/gateway/regex_check.py): what xgrammar would misread (a
lookaround, an anchor in the middle, an unknown escape) or match slowly (a repeated group whose
body is one varying repetition), and the common patterns it lets through."""

import pytest

from services.gateway.regex_check import regex_problem


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        (r"^[a-z]+$", None),
        (r"(?i)^a$", None),
        (r"^a$|^b$", None),
        (r"[$^]", None),
        (r"\^a\$", None),
        (r"[\b]x", None),
        (r"(?=a)a", "lookaround"),
        (r"a(?<!b)", "lookaround"),
        (r"a^b", "^ in the middle"),
        (r"a$b", "$ in the middle"),
        (r"\Aa\Z", r"\A"),
        (r"a\bb", r"\b"),
        # a repeated group whose body is one varying repetition: every token slow to match
        (r"(a*)*b?", "one varying repetition"),
        (r"(a{1,100}){1,100}", "one varying repetition"),
        (r"(?:[a-z]+)+", "one varying repetition"),
        (r"(?P<w>\d{1,5}){2,}", "one varying repetition"),
        (r"((a*))*", "one varying repetition"),
        # ... and what is not that: more than one item, a fixed count, no repetition outside
        (r"(\d{1,3}\.){3}\d{1,3}", None),
        (r"(a{1,255}\.){1,127}", None),
        (r"^[a-z]+(-[a-z]+)*$", None),
        (r"(\d{3}){2}", None),
        (r"(a*)?", None),
        (r"(a{1,5}|b)*", None),
        (r"[(]a*[)]*", None),
        (r"\(a*\)*", None),
        (r"a{\u00b2}", None),  # a Unicode digit is no count: a literal (it raised ValueError)
        ("(a{1," + "9" * 5000 + "}){2}", None),  # nor 5,000 digits (int() refuses > 4,300)
        ("a" * ((1 << 20) + 1), "at most 1048576 characters"),  # read before it is scanned
    ],
)
def test_regex_lint(pattern: str, problem: str | None) -> None:
    found = regex_problem(pattern)
    assert found is None if problem is None else problem in (found or "")
