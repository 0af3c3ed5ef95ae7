"""Every generated block in docs/*.md and README.md is what its command prints now
(tools/gendocs.py --check): a kernel change that moves a quoted counter or estimate fails here
until `python tools/gendocs.py` is rerun and the pages committed."""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GENDOCS = os.path.join(ROOT, "tools", "gendocs.py")


def check(*flags):
    p = subprocess.run([sys.executable, GENDOCS, "--check", *flags], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-4000:]


def test_generated_docs_are_current():
    """Every block but those marked `gen slow:` (seconds)."""
    check("--quick")


def slow_pages() -> list[str]:
    """The pages with a block marked `gen slow:` / `gen-raw slow:` (gendocs' own block pattern),
    from the repository root."""
    sys.path.insert(0, os.path.dirname(GENDOCS))
    import gendocs
    return [os.path.relpath(p, ROOT) for p in gendocs.pages()
            if any(m["slow"] for m in gendocs.BLOCK.finditer(open(p, encoding="utf-8").read()))]


@pytest.mark.full
@pytest.mark.parametrize("page", slow_pages())
def test_slow_generated_docs_are_current(page):
    """The blocks marked `gen slow:` (the int8 study on the engine: minutes), one page a test so
    that the workers of `-n auto` share them; the quick tier's test_generated_docs_are_current
    checks the others, in the same run of the full tier."""
    check("--slow-only", "--page", page)


def test_slow_pages_are_found():
    """The parametrization above sees the slow blocks (an empty list would check nothing)."""
    assert slow_pages() == ["docs/bf16-error.md", "docs/fixtures.md", "docs/int8.md", "docs/kernels.md",
                            "docs/memory.md", "docs/tools.md"], slow_pages()


def test_page_option_limits_and_checks_names(tmp_path):
    def gendocs(*args, cwd=ROOT):
        return subprocess.run([sys.executable, GENDOCS, *args], cwd=cwd, capture_output=True, text=True)
    listed = gendocs("--list", "--page", "docs/int8.md")
    assert listed.returncode == 0 and listed.stdout
    assert all(line.startswith("docs/int8.md:") for line in listed.stdout.splitlines())
    both = gendocs("--list", "--page", os.path.abspath(os.path.join(ROOT, "README.md")), "--page",
                   os.path.abspath(os.path.join(ROOT, "docs", "int8.md")), cwd=tmp_path)  # absolute, from elsewhere
    assert both.returncode == 0, both.stderr
    assert {line.split(":")[0] for line in both.stdout.splitlines()} == {"README.md", "docs/int8.md"}
    # --check --page runs that page's commands only (its blocks are greps of committed data: fast)
    page = "docs/gpu-decode-ab.md"
    blocks = len(gendocs("--list", "--page", page).stdout.splitlines())
    checked = gendocs("--check", "--page", page)
    assert blocks >= 3 and checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == f"{blocks} command(s), 0 block(s) stale", checked.stdout
    bad = gendocs("--check", "--page", "docs/nope.md")
    assert bad.returncode == 2 and "no such page: docs/nope.md" in bad.stderr


def test_check_names_a_stale_block(tmp_path):
    """render() rewrites a stale body with the command's stdout and reports (command, old, new);
    gen-raw: leaves the fence out; gen slow: blocks are left alone under quick=True."""
    sys.path.insert(0, os.path.dirname(GENDOCS))
    import gendocs
    text = "x\n<!-- gen: python -c \"print(6 * 7)\" -->\n```\n41\n```\n<!-- end gen -->\ny\n"
    new, blocks = gendocs.render(text, {})
    assert new == "x\n<!-- gen: python -c \"print(6 * 7)\" -->\n```\n42\n```\n<!-- end gen -->\ny\n"
    assert blocks == [('python -c "print(6 * 7)"', "```\n41\n```\n", "```\n42\n```\n")]
    raw, _ = gendocs.render(text.replace("gen:", "gen-raw:"), {})
    assert "\n42\n<!-- end gen -->" in raw
    slow = text.replace("gen:", "gen slow:")
    assert gendocs.render(slow, {}, quick=True) == (slow, [])
    assert gendocs.render(slow, {})[0] == new.replace("gen:", "gen slow:")
    assert gendocs.render(text, {}, slow_only=True) == (text, [])
    assert gendocs.render(slow, {}, slow_only=True)[0] == new.replace("gen:", "gen slow:")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the pages' error figures are generated on x86-64; elsewhere gendocs pins no kernels")
def test_commands_run_with_one_cpu_level_of_kernels():
    """The error figures of the pages depend on which kernels NumPy and its OpenBLAS pick for the
    CPU; gendocs holds every x86 machine to x86-64-v3's (tools/gendocs.py): OpenBLAS's Haswell
    core, as OpenBLAS itself reports it, and no NumPy dispatch target above X86_V3 enabled,
    whatever the machine has (a later NumPy's new target, or an older NumPy's other names, fails
    here until NUMERICS_ENV names them)."""
    sys.path.insert(0, os.path.dirname(GENDOCS))
    import gendocs
    assert gendocs.run("python tools/numerics_env.py", {}) == "openblas Haswell\nnumpy X86_V3\n"
