"""Every command's --help reads as finished sentences in the command line's own words: no text
cut where a docstring's first line ended, no parameter names of the Python API, and an option's
default said once."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvreuse.cli import build_parser, main

# Words a sentence does not end on: a help that ends so was cut.
DANGLING = {"a", "an", "the", "and", "or", "of", "in", "to", "with", "for", "by", "from", "plus"}
# Names of the generators' and the API's parameters that a user never types.
INTERNAL = re.compile(r"\b(?:prefix_len|suffix_len|max_tokens|num_blocks)\b|Deployment")
# What a code span in a help may hold: an option, a command, an action word.
TYPED = re.compile(r"--[a-z-]*|kvreuse .*|list|show NAME")


def _texts(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    if parser.description:
        yield f"{path} (description)", parser.description, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{path} {choice.dest} (summary)", choice.help or "", parser
            for name, sub in action.choices.items():
                yield from _texts(sub, f"{path} {name}")
        elif action.help and action.help is not argparse.SUPPRESS:
            formatter = parser._get_formatter()
            yield f"{path} {action.dest}", formatter._expand_help(action), parser


TEXTS = list(_texts(build_parser(), "kvreuse"))


def _sentence_problems(where: str, text: str) -> Iterator[str]:
    if text.count("(") != text.count(")"):
        yield f"{where}: cut inside parentheses: {text!r}"
    if text.count("`") % 2:
        yield f"{where}: cut inside a code span: {text!r}"
    last = re.findall(r"[\w']+", text)[-1].lower()
    if not text.rstrip().endswith((".", "!", "?")) and last in DANGLING:
        yield f"{where}: ends mid-sentence: {text!r}"
    if INTERNAL.search(text):
        yield f"{where}: names an internal: {text!r}"
    for span in re.findall(r"`([^`]*)`", text):
        if not TYPED.fullmatch(span):
            yield f"{where}: `{span}` is not something a user types"


def test_help_is_whole_sentences_in_the_command_lines_words() -> None:
    """Every help text of every command (one problem per line; none expected)."""
    assert len(TEXTS) > 150  # every option of every command is read
    assert [p for where, text, _ in TEXTS for p in _sentence_problems(where, text)] == []


def test_an_options_default_is_said_once() -> None:
    said_twice = [f"{w}: {t!r}" for w, t, _ in TEXTS if t.lower().count("default") > 1]
    leaked = [f"{w}: {t!r}" for w, t, _ in TEXTS if "None" in t or "(default: False)" in t]
    assert said_twice == [] and leaked == []


def test_the_help_of_every_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    commands = [w.split(" (")[0].split()[1:] for w, _, _ in TEXTS if w.endswith("(description)")]
    assert ["workload", "pressure"] in commands and ["simulate"] in commands
    for command in commands:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "(default: None)" not in out and "(default: False)" not in out


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_commands(build_parser())))
def test_a_named_command_alone_parses_and_helps_as_in_the_whole_line(command: str) -> None:
    """`kvreuse COMMAND` builds only its own subparser (a run imports what it needs): that
    subparser is the one the whole command line holds, to the last help word."""
    whole, alone = _commands(build_parser())[command], _commands(build_parser(command))
    assert command in alone and set(alone) <= {command, "fleet", "route"}
    assert alone[command].format_help() == whole.format_help()


def test_simulate_does_not_import_the_servers() -> None:
    code = (
        "import sys; from kvreuse.cli import build_parser; build_parser('simulate'); "
        "print(*sorted(m for m in sys.modules if m.startswith(('kvreuse.serve', "
        "'kvreuse.fleet.serving', 'importlib.metadata'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
