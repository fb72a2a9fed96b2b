"""The sample captions README.md shows are what the default model prints: the block between
``<!-- sample-captions:start -->`` and ``<!-- sample-captions:end -->`` holds ``make demo``'s
lines (``filename<TAB>caption``), and the caption command with no ``--model``, run as the
Makefile's demo target runs it (in float32), must print exactly those lines for those photos. A
change of the shipped default (or of decoding) that changes them fails here until the README is
updated."""

import re
from pathlib import Path

import pytest
from helpers import FLICKR8K

from captionkit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- sample-captions:start -->", "<!-- sample-captions:end -->"
# where a photo the README names may be: the repository's samples, or Flickr8k's images
PHOTO_FOLDERS = (ROOT / "samples", FLICKR8K / "Flicker8k_Dataset")


def readme_samples() -> dict[str, str]:
    """{file name: caption} from the README's sample-captions block (skips when it has none)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    if START not in text or END not in text:
        pytest.skip(f"README.md has no {START} ... {END} block around its sample captions")
    block = text.split(START, 1)[1].split(END, 1)[0]
    samples = dict(re.findall(r"^([^\t\n`]+)\t([^\n]+)$", block, flags=re.M))
    assert samples, f"README.md's sample-captions block holds no 'filename<TAB>caption' line:\n{block}"
    return samples


def demo_arguments() -> list[str]:
    """The caption options of the Makefile's demo target that change captions (its --beam)."""
    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe and "captionkit caption" in recipe[1] and "--model" not in recipe[1], "Makefile: demo target"
    beam = re.search(r"--beam (\d+)", recipe[1])
    return ["--beam", beam[1]] if beam else []


def photo(name: str) -> Path:
    for folder in PHOTO_FOLDERS:
        if (folder / name).is_file():
            return folder / name
    pytest.skip(f"README sample photo {name} not found in {' or '.join(map(str, PHOTO_FOLDERS))}")


@pytest.mark.slow  # loads the shipped default model and its encoder
def test_default_model_prints_the_readme_sample_captions(capsys):
    want = readme_samples()
    paths = [str(photo(name)) for name in want]
    # float32, as the README says: on a CPU that multiplies bf16 natively, precision auto decodes
    # under bf16 autocast, and a caption or two come out otherwise
    assert main(["caption", *paths, *demo_arguments(), "--precision", "fp32"]) == 0
    printed = dict(line.split("\t", 1) for line in capsys.readouterr().out.splitlines())
    assert printed == want


def test_make_demo_names_only_the_photos():
    """Issue 29, item 16: `make demo` opened with "skipped 1 file that is not an image to
    caption: samples/LICENSE.md"; its recipe now names the photos, so the writer has nothing to
    say before the captions (the recipe's paths expanded as the shell does)."""
    import glob
    import io
    import shlex
    from contextlib import redirect_stderr

    from captionkit.inference.writer import CaptionWriter

    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)[1]
    words = shlex.split(recipe)
    paths = []
    for word in words[words.index("caption") + 1:]:
        if word.startswith("-"):
            break
        paths += sorted(glob.glob(str(ROOT / word))) or [str(ROOT / word)]
    err = io.StringIO()
    with redirect_stderr(err):
        writer = CaptionWriter("caption", paths, {})
    assert err.getvalue() == ""
    photos = sorted(p.name for p in (ROOT / "samples").iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    assert sorted(p.name for p in writer.keys) == photos == sorted(readme_samples())


def test_make_demo_prints_only_what_it_made():
    """Issue 29: on a fresh clone `make demo` prints the captions and the figures line; make's
    echo of each recipe line (the set-up's commands, the caption command) came before them.
    Every recipe line of the set-up and of demo is silent (@); the set-up says once, on stderr,
    what it is doing."""
    text = (ROOT / "Makefile").read_text()
    for target in (r"\$\(STAMP\)", "demo"):
        block = re.search(rf"^{target}:.*\n((?:\t.*\n|\\\n)+)", text, flags=re.M)[1]
        rows = block.split("\n")
        # a recipe line's own start, not the continuation of a line that ends with a backslash
        lines = [ln for i, ln in enumerate(rows) if ln.startswith("\t") and not (i and rows[i - 1].endswith("\\"))]
        assert lines and all(ln.lstrip("\t-").startswith("@") for ln in lines), (target, lines)


def test_the_default_models_card_shows_the_readme_sample_captions():
    """Issue 32, item 4: the default model's card shows each sample photo's caption (its table's
    rows: | `NAME` | what it shows | caption |) and the command that gives them; they are the
    README's, which the slow test above checks against the model itself."""
    from captionkit.inference.shipped import DEFAULT_MODEL

    card = (DEFAULT_MODEL / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([^`]+\.jpg)` \| [^|]+ \| ([^|]+?) \|$", card, flags=re.M))
    assert rows == readme_samples()
    assert "captionkit caption samples/*.jpg --precision fp32" in card
