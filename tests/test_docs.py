"""The README and docs/ say only what the code does: every ``ddpscope`` command they show
(in code blocks and inline code) is a real subcommand and every flag shown is one of its
flags; every benchmark command's flags are the benchmark's; every marker the docs name
is declared; every link between the pages leads to a file; the README opens with the
two set-up commands and its picture exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.cli.main import build_parser
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = ["python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/ddpscope dashboard",
         "python3 -m venv .venv && .venv/bin/pip install -r requirements-test.txt && .venv/bin/python -m pytest -n 2"]


def _code(page: Path) -> list[str]:
    """Command lines shown in ``page``: indented or fenced code lines, and inline code."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(line.strip())
        lines += re.findall(r"`([^`]+)`", line)
    out = []
    for text in lines:
        for part in re.split(r"&&|;|\|", text.split(" #")[0]):  # one command per part, comments off
            part = re.sub(r"^(\.venv/bin/|[\w/.]*/bin/)", "", part.strip())
            if part.startswith(("ddpscope ", "python -m benchmarks.")) or part == "ddpscope":
                out.append(part)
    return out


def _flags(tokens: list[str]) -> list[str]:
    """The flags in ``tokens`` up to ``--`` (after it: the script's own arguments)."""
    found = []
    for tok in tokens:
        if tok == "--":
            break
        tok = tok.strip("[]")
        if tok.startswith("-") and tok not in ("-", "...") and not re.fullmatch(r"-?\d[\d.,]*", tok):
            found.append(tok.split("=")[0])
    return found


def _subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def test_the_readme_opens_with_the_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    blocks = [line.strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]
    assert blocks[:2] == SETUP
    assert text.index(SETUP[0]) < text.index("## ")  # before any section
    assert (ROOT / "docs" / "images" / "timeline.png").is_file()
    assert len(text.splitlines()) < 150


def test_the_first_command_installs_only_what_the_dashboard_and_tracer_need():
    """The sample opens without the test tools or the frameworks the tests trace; the test
    command (and CI, which runs it) installs them on top."""
    first = (ROOT / "requirements.txt").read_text().lower()
    for name in ("pytest", "playwright", "lightning", "accelerate", "transformers", "deepspeed"):
        assert not re.search(rf"^{name}\b", first, re.M), name
    tests = (ROOT / "requirements-test.txt").read_text()
    assert "-r requirements.txt" in tests and "pytest==" in tests
    assert "pip install -q -r requirements-test.txt" in (ROOT / ".ci" / "run").read_text()


def test_every_ddpscope_command_shown_exists_with_its_flags():
    commands = _subparsers()
    seen = 0
    for page in PAGES:
        for cmd in _code(page):
            if not cmd.startswith("ddpscope"):
                continue
            tokens = shlex.split(cmd.replace("$", ""), posix=True) if "'" not in cmd else cmd.split()
            if len(tokens) == 1 or tokens[1].startswith("<"):  # `ddpscope <command> --help`: a placeholder
                continue
            sub = tokens[1]
            assert sub in commands, f"{page.name}: `{cmd}`: no subcommand {sub!r}"
            known = {s for a in commands[sub]._actions for s in a.option_strings}
            for flag in _flags(tokens[2:]):
                assert flag in known, f"{page.name}: `{cmd}`: {sub} has no flag {flag}"
            seen += 1
    assert seen >= 20  # the check saw the docs' commands


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"))
def test_every_benchmark_command_shown_exists_with_its_flags(module):
    shown = [c for page in PAGES for c in _code(page) if c.split()[2:3] == [f"benchmarks.{module}"]]
    if not shown:
        pytest.skip(f"the docs show no benchmarks.{module} command")
    help_text = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    for cmd in shown:
        for flag in _flags(cmd.split()[3:]):
            assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", help_text), f"`{cmd}`: benchmarks.{module} has no {flag}"


def test_markers_and_links_in_the_docs_exist():
    declared = set(re.findall(r"^\s+(\w+):", (ROOT / "pytest.ini").read_text(), re.M))
    for page in PAGES:
        text = page.read_text()
        for marker in re.findall(r"pytest -m (\w+)", text):
            assert marker in declared, f"{page.name}: marker {marker} is not declared in pytest.ini"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name}: link to {target}, which does not exist"
