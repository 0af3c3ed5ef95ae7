"""The README's two commands stay true: CI runs the README's test command, and the main
command's arguments are ones the CLI accepts."""
import os
import re
import shlex

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def readme_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


def test_readme_has_two_commands():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].startswith("pip install . && lily-py ")
    assert cmds[1].startswith('pip install ".[test]" && ') and "pytest" in cmds[1]


def full_tier_command():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Tests: the quick and the full tier", 1)[1].split("\n## ", 1)[0]
    cmds = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(cmds) == 1, cmds
    return cmds[0]


def test_full_tier_is_the_quick_command_with_full():
    assert full_tier_command() == readme_commands()[1] + " --full"


def test_ci_runs_the_readme_full_tier_command():
    ci = [line.strip() for line in
          open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()]
    assert full_tier_command() in ci


def test_full_tier_option_exists_and_marks_tests(pytestconfig):
    """--full is this suite's option, and tests/tiers.py names tests that exist (the collection
    hook raises on a stale pattern; here: every pattern names a test file that exists)."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiers import FULL_TIER
    assert pytestconfig.getoption("--full") in (True, False)
    for pattern in FULL_TIER:
        assert os.path.exists(os.path.join(ROOT, pattern.split("::", 1)[0])), pattern


def test_main_command_arguments_parse(monkeypatch):
    import lily_py.cli as cli
    argv = shlex.split(readme_commands()[0].split("&&", 1)[1])[1:]
    seen = {}
    monkeypatch.setattr(cli, "cmd_generate", lambda a: seen.setdefault("args", a) and 0)
    cli.main(argv)
    assert seen["args"].model is None        # the bundled demo: no download
    assert seen["args"].prompt
