"""docs/: the generated option reference is current, and relative links and anchors resolve."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def test_option_reference_is_current():
    spec = importlib.util.spec_from_file_location("flag_reference", REPO / "scripts" / "flag_reference.py")
    flag_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flag_reference)
    page = flag_reference.PAGE.read_text()
    assert flag_reference.updated(page) == page, (
        "docs/configs-and-flags.md is stale: python scripts/flag_reference.py"
    )


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    titles = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: {target}"
