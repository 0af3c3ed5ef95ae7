"""The docs stay true: generated numbers match their commands, pages stay short, the map is whole."""
from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOCS = os.path.join(ROOT, "docs")


def gendocs():
    spec = importlib.util.spec_from_file_location("gendocs", os.path.join(ROOT, "tools", "gendocs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_blocks_are_current(capsys):
    """Every `<!-- gen: CMD -->` block is what CMD prints now (a changed kernel that moves a quoted
    counter fails here until `python tools/gendocs.py` is rerun). Full tier: it runs every command."""
    rc = gendocs().main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, f"stale generated docs:\n{out.out}\n{out.err}"


def test_check_fails_on_a_changed_number_and_regeneration_fixes_it(tmp_path):
    mod = gendocs()
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    good = "x\n<!-- gen: echo 'dispatches 262'; echo 'barriers 261' -->\n```text\ndispatches 262\nbarriers 261\n```\n<!-- end gen -->\n"
    (tmp_path / "README.md").write_text("no blocks here\n")
    page.write_text(good.replace("barriers 261\n```", "barriers 260\n```"))
    assert mod.main(["--check"], root=str(tmp_path)) == 1
    assert page.read_text() != good                      # --check rewrites nothing
    assert mod.main([], root=str(tmp_path)) == 0
    assert page.read_text() == good
    assert mod.main(["--check"], root=str(tmp_path)) == 0


def test_a_failing_command_is_an_error_naming_it(tmp_path):
    mod = gendocs()
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- gen: exit 3 -->\n<!-- end gen -->\n")
    try:
        mod.main(["--check"], root=str(tmp_path))
    except RuntimeError as e:
        assert "exit 3" in str(e) and "exited 3" in str(e)
    else:
        raise AssertionError("a failing command must raise")


def pages():
    return sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))


def test_every_page_is_at_most_400_lines():
    long = {p: n for p in pages()
            if (n := len(open(os.path.join(DOCS, p), encoding="utf-8").read().splitlines())) > 400}
    assert not long, f"split these pages by topic: {long}"


def test_the_map_lists_every_page_and_only_pages_that_exist():
    text = open(os.path.join(DOCS, "README.md"), encoding="utf-8").read()
    listed = set(re.findall(r"\]\(([a-z0-9_-]+\.md)\)", text))
    assert listed == set(pages()) - {"README.md"}


def test_links_between_docs_name_pages_that_exist():
    missing = []
    for root in (ROOT, DOCS):
        for p in (os.listdir(DOCS) if root == DOCS else ["README.md", "CONTRIBUTING.md"]):
            if not p.endswith(".md"):
                continue
            text = open(os.path.join(root, p), encoding="utf-8").read()
            for ref in re.findall(r"docs/([A-Za-z0-9_-]+\.md)", text):
                if not os.path.exists(os.path.join(DOCS, ref)):
                    missing.append((p, ref))
    assert not missing, missing
