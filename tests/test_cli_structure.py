"""The command line's structure: every option has a help text, --version comes from the package
metadata, the shipped models are listed from pretrained/, and only a user's mistake becomes a
one-line error (an internal error keeps its traceback)."""

import argparse
import json
import subprocess
import sys
from importlib.metadata import version

import pytest

import captionkit
from captionkit.cli.main import build_parser, main
from captionkit.inference import rerank
from captionkit.inference.shipped import SHIPPED, list_shipped_models


def _walk(parser: argparse.ArgumentParser, name: str = "captionkit"):
    """(command, action) for every argument of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _walk(p, f"{name} {sub}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_option_of_every_command_has_help():
    pairs = list(_walk(build_parser()))
    assert len(pairs) > 150 and any(n == "captionkit export hf" for n, _ in pairs)
    missing = [f"{n} {a.option_strings or a.dest}" for n, a in pairs if not (a.help or "").strip()]
    assert missing == []


def _commands(parser: argparse.ArgumentParser, name: str = "captionkit"):
    """(command, its parser) for every command that runs (export's formats, not export)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                if p._subparsers:
                    yield from _commands(p, f"{name} {sub}")
                else:
                    yield f"{name} {sub}", p


def test_every_command_is_bound_to_its_function():
    bound = {name: p.get_default("func") for name, p in _commands(build_parser())}
    assert len(bound) > 15 and "captionkit export hf" in bound and "captionkit models" in bound
    for name, func in bound.items():
        want = "cmd_export_hf" if name == "captionkit merge-lora" else \
            "cmd_" + "_".join(name.split()[1:]).replace("-", "_")
        assert func.__name__ == want, name


def test_version_is_the_installed_package_metadata(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"captionkit {version('captionkit')}\n"
    assert version("captionkit") == captionkit.__version__  # pyproject.toml and __init__ agree


def test_models_lists_the_pretrained_folder(capsys):
    names = list_shipped_models()
    assert sorted(names) == sorted(p.name for p in SHIPPED.iterdir()
                                   if (p / "config.json").is_file() or (p / "ensemble.json").is_file())
    assert "ensemble-lite2-flickr8k" in names  # an ensemble folder is a shipped model too
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == names and lines[1].endswith("(the default)")
    helps = {n: a.help for n, a in _walk(build_parser()) if "--model" in a.option_strings}
    for command in ("captionkit caption", "captionkit serve"):
        assert all(name in helps[command] for name in names), command
    # export takes one model: its help lists the single ones and names one default, its own
    singles = [n for n in names if not (SHIPPED / n / "ensemble.json").is_file()]
    assert singles and all(name in helps["captionkit export onnx"] for name in singles)
    assert "ensemble-lite2-flickr8k" not in helps["captionkit export onnx"]
    assert helps["captionkit export onnx"].count("default") == 1


def test_models_is_a_table_with_each_model_s_test_scores(capsys):
    """Issue 29, item 16: the lines were not aligned and showed no scores."""
    assert main(["models"]) == 0
    header, *rows, note = capsys.readouterr().out.splitlines()
    assert header.split() == ["model", "family", "encoder", "size", "BLEU-4", "METEOR", "CIDEr-D"]
    assert note.startswith("scores: Flickr8k test split (1,000 images), beam 3")
    # the text columns start where their header does, the size and the scores end where theirs does
    for label in ("family", "encoder"):
        at = header.index(label)
        assert all(row[at - 2:at] == "  " and row[at] != " " for row in rows), label
    for label in ("size", "BLEU-4", "METEOR", "CIDEr-D"):
        end = header.index(label) + len(label)
        assert all(row[end - 1] != " " and row[end:end + 1] in ("", " ") for row in rows), label
    default = next(row for row in rows if row.startswith("ensemble-lite2-flickr8k"))
    assert default.split()[-6:] == ["MB", "24.56", "21.52", "63.03", "(the", "default)"]


def test_a_users_mistake_is_one_line(tmp_path, capsys):
    assert main(["rerank", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"captionkit rerank: error: {tmp_path / 'missing.json'}: no such candidates file\n"


@pytest.mark.parametrize("error", [ValueError("an impossible state"), KeyError("a missing key")])
def test_an_internal_error_is_not_swallowed(error, tmp_path, monkeypatch, capsys):
    """A plain ValueError (or any non-UserError) from the library is a bug: it reaches the
    interpreter, which prints its traceback and exits 1, instead of becoming a one-line message."""
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(rerank, "rerank_files", broken)
    with pytest.raises(type(error)) as e:
        main(["rerank", str(tmp_path / "c.json")])
    assert e.value is error
    assert "error:" not in capsys.readouterr().err


@pytest.mark.slow
def test_an_internal_error_shows_a_traceback_from_the_command(tmp_path):
    code = ("import sys, captionkit.inference.rerank as r\n"
            "def broken(*a, **k): raise ValueError('an impossible state')\n"
            "r.rerank_files = broken\n"
            "from captionkit.cli.main import main\n"
            "sys.exit(main(['rerank', 'c.json']))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1
    assert "Traceback (most recent call last)" in run.stderr and "ValueError: an impossible state" in run.stderr
    user = subprocess.run([sys.executable, "-m", "captionkit.cli.main", "rerank", "c.json"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert user.returncode == 2 and user.stderr == "captionkit rerank: error: c.json: no such candidates file\n"


def test_export_hf_refuses_a_folder_it_did_not_write_before_loading(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "mine.txt").write_text("keep me")
    for command in ("export hf", "merge-lora"):
        assert main([*command.split(), "--model", "no-such-model", "--out", str(victim), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"captionkit {command}: error: {victim}: was not written by captionkit")
        assert err.count("\n") == 1
    assert [p.name for p in victim.iterdir()] == ["mine.txt"]


def test_pack_refuses_its_own_checkpoint_as_out(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"format": "captionkit-checkpoint"}))
    assert main(["pack", str(ckpt), str(ckpt)]) == 2
    assert capsys.readouterr().err == (f"captionkit pack: error: {ckpt}: is the checkpoint being packed; "
                                       f"choose another folder\n")


def test_the_program_exits_with_mains_code_its_objects_frozen(monkeypatch):
    """`captionkit` (console script, `python -m captionkit`) is entry(): main's exit status, and
    the interpreter's objects frozen first (gc.freeze), so exiting skips a last collection over
    torch's objects (0.4-0.5 s of every command); main() alone, as tests call it, freezes nothing."""
    import gc

    from captionkit.cli import main as cli

    monkeypatch.setattr(cli, "main", lambda: 3)
    before = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as stop:
            cli.entry()
        assert stop.value.code == 3
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()

