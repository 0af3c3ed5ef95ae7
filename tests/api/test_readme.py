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


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert readme_commands()[1] in ci


def test_main_command_arguments_parse(monkeypatch):
    import lily_py.cli as cli
    argv = shlex.split(readme_commands()[0].split("&&", 1)[1])[1:]
    seen = {}
    monkeypatch.setattr(cli, "cmd_generate", lambda a: seen.setdefault("args", a) and 0)
    cli.main(argv)
    assert seen["args"].model is None        # the bundled demo: no download
    assert seen["args"].prompt
