"""``baton --help`` and every sub-command's ``--help`` teach a user: each flag has help text, its
default where it has one (never "default: None"), its unit where it is a time, a size in bytes
or a count of tokens, and no help text sends the reader to a source file."""

import argparse
import re
from collections.abc import Iterator

import pytest

from baton.cli import build_parser
from baton.service_cli import cluster_spec, engine_args, engine_flags_argv

TIME_FLAG = re.compile(r"-(timeout|seconds|s|ms|interval|delay|after|period|ttl)$")
TIME_UNIT = re.compile(r"\b(seconds?|milliseconds?|ms|minutes?)\b")
TOKEN_FLAG = re.compile(r"tokens|-len$|^--block-size$|^--max-position-embeddings$")
SOURCE_FILE = re.compile(r"\b[\w/]+\.py\b")


def commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``baton`` and each of its sub-commands, by name."""
    parser = build_parser()
    yield "baton", parser
    for action in parser._actions:  # argparse lists sub-commands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


COMMANDS = dict(commands())


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions a user sees: all but -h and those hidden on purpose (test hooks)."""
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]  # fmt: skip


def rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry in ``--help`` as the user sees it, on one line."""
    formatter = parser.formatter_class(prog=parser.prog, width=10_000)
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def has_value_default(action: argparse.Action) -> bool:
    """A default that is a value, not "not given" (None, off, empty): --help must show it."""
    default = action.default
    if not action.option_strings or default is None or default is False:
        return False
    if isinstance(default, str | tuple | list) and not default:
        return False
    return action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)


def shown(default: object) -> str:
    return ("on" if default else "off") if isinstance(default, bool) else str(default)


def test_every_sub_command_is_walked() -> None:
    assert set(COMMANDS) >= {"baton", "serve", "gateway", "global-scheduler", "worker",
                             "generate", "make-tiny-model", "transports"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help_with_its_default_and_unit(name: str) -> None:
    parser = COMMANDS[name]
    parser.format_help()  # every help text expands (a stray % would raise here)
    problems = []
    for action in flags(parser):
        label = "/".join(action.option_strings) or action.dest
        text = rendered(parser, action)
        help_text = text.partition(" ")[2] if action.option_strings else text
        if not (action.help or "").strip():
            problems.append(f"{label}: no help text")
            continue
        if SOURCE_FILE.search(help_text):
            problems.append(f"{label}: names a source file: {help_text!r}")
        if re.search(r"default: (None|False|True|\(\)|\[\]|'')\W", help_text + " "):
            problems.append(f"{label}: a default that says nothing: {help_text!r}")
        if has_value_default(action) and f"(default: {shown(action.default)})" not in text:
            problems.append(f"{label}: its default {action.default!r} is not shown: {text!r}")
        long_flags = [f for f in action.option_strings if f.startswith("--")]
        if any(TIME_FLAG.search(f) for f in long_flags) and not TIME_UNIT.search(help_text):
            problems.append(f"{label}: a time without its unit: {help_text!r}")
        if any("bytes" in f for f in long_flags) and "bytes" not in help_text:
            problems.append(f"{label}: a size without its unit (bytes): {help_text!r}")
        if any(TOKEN_FLAG.search(f) for f in long_flags) and "token" not in help_text:
            problems.append(f"{label}: a count of tokens that does not say so: {help_text!r}")
    assert not problems, "\n".join(problems)


def test_top_level_help_is_for_users() -> None:
    """What ``baton`` does and where to start, not the package's import structure."""
    text = build_parser().format_help()
    assert "baton serve --model" in text and "Baton is serving" in text
    for internal in ("service_cli", "launcher", "import", ".py", "``"):
        assert internal not in text, internal


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_kv_recompute_on_failure_says_its_default_and_keeps_the_old_spelling(
    command: str,
) -> None:
    """Recomputing a prompt whose KV pull failed is the default and the help says so; the
    ``--no-…`` spelling that scripts and docs use still turns it off."""
    base = [command, "--model", "m"]
    parse = build_parser().parse_args
    assert parse(base).kv_recompute_on_failure is True
    assert parse([*base, "--kv-recompute-on-failure"]).kv_recompute_on_failure is True
    assert parse([*base, "--no-kv-recompute-on-failure"]).kv_recompute_on_failure is False
    assert parse([*base, "--no-prefix-caching"]).enable_prefix_caching is False
    parser = COMMANDS[command]
    [action] = [a for a in parser._actions if a.dest == "kv_recompute_on_failure"]
    text = rendered(parser, action)
    assert "recompute the prompt" in text and text.endswith("(default: on)"), text


def test_serve_passes_switched_off_bools_on_to_its_workers() -> None:
    """``baton serve --no-kv-recompute-on-failure --no-prefix-caching``: each worker gets the
    same flags, and its engine both switched off."""
    serve = build_parser().parse_args(["serve", "--model", "m", "--no-kv-recompute-on-failure",
                                       "--no-prefix-caching"])  # fmt: skip
    argv = engine_flags_argv(serve)
    assert sorted(argv) == ["--no-kv-recompute-on-failure", "--no-prefix-caching"]
    engine = engine_args(build_parser().parse_args(["worker", "--model", "m", *argv]))
    assert (engine.kv_recompute_on_failure, engine.enable_prefix_caching) == (False, False)


def test_serve_takes_the_gateways_api_key_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``baton serve --api-key-file`` reaches the launcher's spec as a path (the gateway reads
    the keys itself); a missing or empty file fails before anything starts."""
    keys = tmp_path / "keys"
    keys.write_text("# a comment\nsecret-key-1\n")
    parse = build_parser().parse_args
    spec = cluster_spec(parse(["serve", "--model", "m", "--api-key-file", str(keys)]))
    assert spec.api_key_file == str(keys) and spec.api_keys == ()
    assert parse(["gateway", "--model", "m", "--scheduler", "x:1", "--api-key-file",
                  str(keys)]).api_key_file == str(keys)  # fmt: skip
    with pytest.raises(SystemExit, match="baton serve: --api-key-file"):
        cluster_spec(parse(["serve", "--model", "m", "--api-key-file", str(tmp_path / "no")]))
    (tmp_path / "empty").write_text("# no key\n\n")
    with pytest.raises(SystemExit, match="holds no key"):
        cluster_spec(parse(["serve", "--model", "m", "--api-key-file", str(tmp_path / "empty")]))
