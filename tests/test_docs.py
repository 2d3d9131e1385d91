"""The documentation stays true: the configuration page is the CLI's own parser, every relative link
lands on a file (and heading), every page is reachable from the README, and the README stays a
five-minute read. (No file referring outside the repository is tests/test_layout.py's check.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 200

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_config_doc", REPO / "scripts" / "gen_config_doc.py")
    assert spec and spec.loader
    sys.path.insert(0, str(REPO / "scripts"))  # it imports scripts/checkout.py
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return mod


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_configuration_page_is_the_cli_parser():
    gen = _gen_module()
    committed = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    assert committed == gen.render(), f"docs/configuration.md is stale: run `{gen.COMMAND}` and commit it"


def test_configuration_page_lists_every_serve_flag():
    gen = _gen_module()
    page = gen.render()
    serve = gen._subcommands(gen.build_parser())["serve"]
    for action in serve._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in page, flag


def test_readme_is_a_five_minute_read():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (limit {README_MAX_LINES})"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if REPO not in dest.parents and dest != REPO:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{path.relative_to(REPO)}: " + "; ".join(broken)


def test_docs_have_links_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in _LINK.findall(_prose(README.read_text()))}
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p.name not in linked]
    assert not orphans, f"docs/ pages the README does not link to: {orphans}"
