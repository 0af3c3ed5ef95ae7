"""Every generated block in docs/*.md and README.md is what its command prints now
(tools/gendocs.py --check): a kernel change that moves a quoted counter or estimate fails here
until `python tools/gendocs.py` is rerun and the pages committed."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GENDOCS = os.path.join(ROOT, "tools", "gendocs.py")


def test_generated_docs_are_current():
    p = subprocess.run([sys.executable, GENDOCS, "--check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-4000:]


def test_check_names_a_stale_block(tmp_path):
    """--check reports a block whose body differs, naming the page and the command (on a copy)."""
    sys.path.insert(0, os.path.dirname(GENDOCS))
    import gendocs
    text = "x\n<!-- gen: python -c \"print(6 * 7)\" -->\n```\n41\n```\n<!-- end gen -->\ny\n"
    new, blocks = gendocs.render(text, {})
    assert new == "x\n<!-- gen: python -c \"print(6 * 7)\" -->\n```\n42\n```\n<!-- end gen -->\ny\n"
    assert blocks == [('python -c "print(6 * 7)"', "```\n41\n```\n", "```\n42\n```\n")]
    raw, _ = gendocs.render(text.replace("gen:", "gen-raw:"), {})
    assert "\n42\n<!-- end gen -->" in raw
