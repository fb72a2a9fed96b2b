"""The documentation's own checks: every relative link in README.md, docs/*.md and the model
cards (src/captionkit/pretrained/*/README.md) leads to a file that exists (and, for a link to a
heading of a Markdown file, to a heading that exists), every captionkit name the pages give (a
module, or a name in one: the deep imports they promise) imports, and the README stays short."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 220
# pages other branches add; the README links them ahead of the merge that brings them
PENDING = {"docs/devices.md", "docs/scale.md", "docs/distributed-training.md"}

# [text](target) and ![alt](target), the target up to whitespace or ")"; no nested brackets
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "src/captionkit/pretrained").glob("*/README.md"))]


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces to hyphens (so "Large folders: `--jsonl`" -> "large-folders---jsonl")."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8")))}


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto: ...


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``path`` (a Markdown file under ``root``) that lead nowhere."""
    broken = []
    for target in filter(is_relative, links(path)):
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
        if where in PENDING and not dest.exists():
            continue
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {where}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_existing_files(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: broken links"


def test_every_shipped_model_has_a_card_linked_from_the_readme():
    readme = set(links(ROOT / "README.md"))
    for folder in sorted(p for p in (ROOT / "src/captionkit/pretrained").iterdir() if p.is_dir()):
        card = folder / "README.md"
        assert card.is_file(), f"{folder.name}: no model card ({card.relative_to(ROOT)})"
        assert card.relative_to(ROOT).as_posix() in readme, f"README.md does not link {folder.name}'s card"


def test_readme_stays_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; long-form text belongs in docs/"


def test_the_link_checker_finds_a_broken_link(tmp_path):
    """The checker itself: a missing file and a missing heading are reported, good links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text("# A page\n\n## Large folders: `--jsonl` and `--csv`\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#large-folders---jsonl-and---csv) [web](https://example.org/x)\n"
                    "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
                    "[gone](docs/missing.md) [bad anchor](docs/a.md#nope)\n")
    assert broken_links(page, tmp_path) == ["docs/missing.md: no such file", "docs/a.md#nope: no heading #nope in docs/a.md"]


# `captionkit.wing.module[.name]` in the text, and the module of `from captionkit.x import a, b` lines
DOTTED = re.compile(r"\bcaptionkit(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"^\s*from (captionkit[.\w]*) import ([\w, ]+)$", re.M)


def named_in_docs(text: str) -> set[str]:
    names = set(DOTTED.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        names.update(f"{module}.{n.strip()}" for n in imported.split(",") if n.strip())
    return names


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c.d`` is a module, or a name reached from the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_captionkit_name_the_docs_give_imports(path):
    text = path.read_text(encoding="utf-8")
    names = {n for n in named_in_docs(text) if not n.startswith("captionkit.json")}  # a file name, not a module
    assert [n for n in sorted(names) if not resolves(n)] == []


def test_the_name_checker_finds_a_moved_name():
    assert resolves("captionkit.scoring.evaluation.score_captions") and resolves("captionkit.models")
    assert not resolves("captionkit.evaluation.score_captions")  # the flat module before the wings
    assert not resolves("captionkit.scoring.evaluation.no_such_function")
    assert named_in_docs("see `captionkit.core.outputs`.\nfrom captionkit.data.vocab import Vocab, Tokens\n") == {
        "captionkit.core.outputs", "captionkit.data.vocab", "captionkit.data.vocab.Vocab", "captionkit.data.vocab.Tokens"}
