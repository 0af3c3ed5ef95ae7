"""What the docs say about installing is true: commands that exist (lily-py is not on PyPI: extras
install from a clone, ".[serve]"), the build's needs and time stated, and package metadata that
describes what the package is (the Metal path is built, not yet run on a Mac)."""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))


def text_files():
    for path in (["README.md", "CONTRIBUTING.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
                 + sorted(glob.glob("src/lily_py/**/*.py", root_dir=ROOT, recursive=True))):
        yield path, open(os.path.join(ROOT, path), encoding="utf-8").read()


def test_no_install_command_from_an_index_that_has_no_lily_py():
    bad = []
    for path, text in text_files():
        for m in re.finditer(r"pip install [\"']?lily-py\b", text):
            bad.append((path, text[m.start():m.start() + 40]))
    assert not bad, bad
    assert 'pip install ".[serve]"' in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_the_build_states_its_needs_and_its_time():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    first = " ".join(readme.split("## The two commands", 1)[1].split("```bash", 1)[0].split())
    for s in ("C++20 compiler", "CMake", "pip install -v .", "minutes on 2 cores"):
        assert s in first, s
    contributing = open(os.path.join(ROOT, "CONTRIBUTING.md"), encoding="utf-8").read()
    assert "about 1 minute" not in contributing and "pip install -v" in contributing


def _project_field(name: str) -> str:
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    project = text.split("[project]", 1)[1]
    m = re.search(rf"^{name} = (\[[^\]]*\n\]|[^\n]*)$", project, re.M)
    assert m, name
    return m[1]


def test_package_metadata():
    desc = _project_field("description")
    assert "not yet run" in desc and "Qwen3.6-35B-A3B" in desc
    classifiers = re.findall(r'"([^"]+)"', _project_field("classifiers"))
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert _project_field("license") == '{ text = "Apache-2.0" }'
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    urls = text.split("[project.urls]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^Homepage = "https://', urls, re.M) and re.search(r'^Issues = "https://', urls, re.M)
