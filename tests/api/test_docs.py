"""The docs stay navigable: pages stay short, the map is whole, links name pages that exist
(generated numbers: tests/api/test_docs_generated.py)."""
from __future__ import annotations

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOCS = os.path.join(ROOT, "docs")


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
