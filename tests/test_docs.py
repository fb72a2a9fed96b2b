"""The documentation's own checks: every relative link in README.md, docs/*.md and the model
cards (src/captionkit/pretrained/*/README.md) leads to a file that exists (and, for a link to a
heading of a Markdown file, to a heading that exists), every captionkit name the pages give (a
module, or a name in one: the deep imports they promise) imports, every `captionkit` command they
give has the options they give it, `captionkit models`' example and the README's table of shipped
models are what the package ships, and the README stays short."""

from __future__ import annotations

import argparse
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


# ---- the commands the pages give -----------------------------------------------------------
# Every `captionkit ...` command in a code block or inline code of README.md, docs/*.md and the
# model cards: its --help exits 0 and names every option the page gives it (issue 29, item 6:
# the pages had drifted from the command line). A line such as `captionkit score: error: ...`
# (a quoted message) and a placeholder command in capitals (`captionkit COMMAND --help`) are not
# commands.
FENCED = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.S | re.M)
COMMAND_IN_BLOCK = re.compile(r"(?:^|(?<=[\s;&|(]))captionkit((?: +[^\s#|;&)`]+)*)")
COMMAND_INLINE = re.compile(r"^\s*(?:\$ )?captionkit((?: +[^\s#|;&)`]+)*)")
OPTION = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")


def documented_commands(text: str) -> list[list[str]]:
    """The words of each `captionkit ...` command in the page's code (after `captionkit`)."""
    found = []
    for _, body in FENCED.findall(text):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():  # continued lines joined
            found += [m.group(1).split() for m in COMMAND_IN_BLOCK.finditer(line)]
    for code in INLINE_CODE.findall(FENCED.sub("", text)):
        m = COMMAND_INLINE.match(code.strip("`"))
        if m:
            found.append(m.group(1).split())
    return [words for words in found if words and not re.search(r"[:,]$", words[0]) and not words[0].isupper()]


def command_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Each runnable command's words (("caption",), ("export", "onnx")) and its parser."""
    from captionkit.cli.main import build_parser

    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, prefix + (name,))
                return
        yield prefix, parser

    return dict(walk(build_parser(), ()))


def split_command(words: list[str], parsers: dict) -> tuple[tuple[str, ...] | None, list[str]]:
    """(the command's words, the options given to it); (None, ...) for a name no command has."""
    for n in (2, 1):
        if tuple(words[:n]) in parsers:
            options = [m.group(1) for w in words[n:] if (m := OPTION.match(w))]
            return tuple(words[:n]), options
    return None, []


def docs_commands() -> dict[tuple[str, ...], dict[str, set[str]]]:
    """{command: {option: the pages giving it}}; the top level (captionkit --help) as ()."""
    parsers = command_parsers()
    found: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for path in markdown_files():
        page = path.relative_to(ROOT).as_posix()
        for words in documented_commands(path.read_text(encoding="utf-8")):
            if words[0].startswith("-"):
                command, options = (), [w for w in words if w.startswith("--")]
            else:
                command, options = split_command(words, parsers)
                if command is None:
                    command, options = tuple(words[:1]), []  # fails below: no such command
            for option in ["", *options]:
                found.setdefault(command, {}).setdefault(option, set()).add(page)
    return found


def help_text(command: tuple[str, ...], capsys) -> str:
    from captionkit.cli.main import main

    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0, command
    return capsys.readouterr().out


DOCUMENTED = docs_commands()


@pytest.mark.parametrize("command", sorted(DOCUMENTED), ids=lambda c: " ".join(("captionkit",) + c))
def test_every_documented_command_has_the_options_the_docs_give(command, capsys):
    pages = DOCUMENTED[command]
    assert command == () or command in command_parsers(), f"no command {' '.join(command)} (in {sorted(pages[''])})"
    text = help_text(command, capsys)
    missing = {opt: sorted(where) for opt, where in pages.items()
               if opt and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)}
    assert missing == {}, f"options the docs give that `captionkit {' '.join(command)} --help` does not have"


def test_the_docs_cover_the_commands():
    """The extraction above finds the commands (so the test cannot pass on nothing)."""
    assert {("caption",), ("evaluate",), ("score",), ("train",), ("export", "onnx"), ("models",)} <= set(DOCUMENTED)
    assert "--max-images" in DOCUMENTED[("evaluate",)] and "--subset" in DOCUMENTED[("score",)]
    words = documented_commands("```sh\ncaptionkit caption a.jpg \\\n  --beam 3  # x\n```\n"
                                "`captionkit score --captions C [--subset]` and `captionkit score: error: x`\n")
    assert words == [["caption", "a.jpg", "--beam", "3"], ["score", "--captions", "C", "[--subset]"]]
    assert split_command(["export", "onnx", "--web"], command_parsers()) == (("export", "onnx"), ["--web"])


def test_the_models_example_is_what_captionkit_models_prints(capsys):
    """docs/cli.md shows `captionkit models`'s output: it is the output (the table of the
    shipped models and their scores)."""
    from captionkit.cli.main import main

    text = (ROOT / "docs/cli.md").read_text(encoding="utf-8")
    example = re.search(r"^\$ captionkit models\n(.*?)^```", text, re.S | re.M)
    assert example, "docs/cli.md: no `$ captionkit models` example"
    assert main(["models"]) == 0
    assert example[1] == capsys.readouterr().out


def test_the_readme_table_has_the_scores_the_models_ship_with():
    """README.md's table of shipped models and each folder's scores.json (what `captionkit
    models` prints) give the same BLEU-4, METEOR and CIDEr-D."""
    import json

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    folders = sorted(p for p in (ROOT / "src/captionkit/pretrained").iterdir() if p.is_dir())
    for folder in folders:
        row = re.search(rf"^\| \[`{re.escape(folder.name)}`\].*$", readme, re.M)
        assert row, f"README.md: no table row for {folder.name}"
        cells = [c.strip() for c in row[0].strip("|").split("|")]
        scores = json.loads((folder / "scores.json").read_text())["scores"]
        assert [float(c) for c in cells[2:5]] == [scores["Bleu_4"], scores["METEOR"], scores["CIDEr"]], folder.name
    count = re.search(r"\b(\w+) trained\s+models ship", readme)
    assert count and count[1].lower() == ["zero", "one", "two", "three", "four", "five", "six"][len(folders)]
