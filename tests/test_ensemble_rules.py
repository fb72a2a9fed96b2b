"""An ensemble folder's decoding rules (issue 32): ensemble.json's "decoding" may name the caption
controls' rules (no_repeat_ngram, repetition_penalty, min_words, max_words); the ensemble decodes
with them by default, and the command line or the API overrides them."""

from __future__ import annotations

import json

import pytest
from helpers import cli_captions, direct_captions

from captionkit.cli.main import main
from captionkit.core.errors import CheckpointError, UserError
from captionkit.inference.captioner import Captioner
from captionkit.inference.ensemble import ENSEMBLE_FILE, read_ensemble, write_ensemble
from captionkit.inference.shipped import SHIPPED


def ruled_ensemble(tmp_path, members, rules: dict | None):
    """An ensemble folder of ``members``, equal weights, decoding ``rules``, written by hand."""
    out = tmp_path / f"ens{len(list(tmp_path.glob('ens*')))}"
    out.mkdir()
    (out / ENSEMBLE_FILE).write_text(json.dumps(
        {"format": "captionkit-ensemble", "version": 1,
         "members": [{"path": str(m.resolve()), "weight": 1} for m in members],
         "decoding": {"length_penalty": 0.0, **(rules or {})}}))
    return out


def repeats_a_word(text: str) -> bool:
    words = text.split()
    return len(set(words)) < len(words)


def test_ensemble_folder_rules_change_the_captions_and_flags_override_them(picky_models, picky_data, tmp_path):
    a, b = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    folder = ruled_ensemble(tmp_path, [a, b], {"no_repeat_ngram": 1})
    written = write_ensemble(tmp_path / "written", [{"path": str(m.resolve())} for m in (a, b)], [1, 1], 0.0,
                             rules={"no_repeat_ngram": 1})
    assert json.loads(written.read_text())["decoding"] == {"length_penalty": 0.0, "no_repeat_ngram": 1}
    plain = direct_captions(Captioner.load_ensemble([a, b]), photos)
    ruled = Captioner.load(folder)
    assert ruled.controls.no_repeat_ngram == 1
    blocked = direct_captions(ruled, photos)
    # what makes the test mean something: the plain ensemble repeats words on these photos
    assert any(repeats_a_word(t) for t in plain.values())
    assert not any(repeats_a_word(t) for t in blocked.values())
    both = Captioner.load_ensemble([a, b])
    assert blocked == direct_captions(both, photos, controls=both.controls_for(no_repeat_ngram=1))
    assert blocked == direct_captions(Captioner.load_ensemble([a, b], rules={"no_repeat_ngram": 1}), photos)
    # the API and the command line override the folder's rule
    assert direct_captions(ruled, photos, controls=ruled.controls_for(no_repeat_ngram=0)) == plain
    assert cli_captions(tmp_path, ["caption", *map(str, photos), "--model", str(folder)]) == blocked
    assert cli_captions(tmp_path, ["caption", *map(str, photos), "--model", str(folder),
                                   "--no-repeat-ngram", "0"]) == plain
    # `captionkit ensemble` writes the rule given to it
    cli_folder = tmp_path / "cli"
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--length-penalty", "0",
                 "--no-repeat-ngram", "1", "--out", str(cli_folder)]) == 0
    assert read_ensemble(cli_folder).rules == {"no_repeat_ngram": 1}
    assert direct_captions(Captioner.load(cli_folder), photos) == blocked


def test_a_folder_without_rules_decodes_as_before(picky_models, picky_data, tmp_path):
    a, b = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    folder = ruled_ensemble(tmp_path, [a, b], None)
    assert set(json.loads((folder / ENSEMBLE_FILE).read_text())["decoding"]) == {"length_penalty"}
    assert read_ensemble(folder).rules == {}
    cap = Captioner.load(folder)
    assert cap.controls.given() == {}
    assert direct_captions(cap, photos) == direct_captions(Captioner.load_ensemble([a, b]), photos)


def test_the_shipped_default_reads_its_rules():
    spec = read_ensemble(SHIPPED / "ensemble-lite2-flickr8k")
    doc = json.loads((SHIPPED / "ensemble-lite2-flickr8k" / ENSEMBLE_FILE).read_text())["decoding"]
    assert spec.rules == {k: v for k, v in doc.items() if k not in ("length_penalty", "max_len", "tta")}


@pytest.mark.parametrize("rules, why", [({"no_repeat_ngram": -1}, "--no-repeat-ngram"),
                                         ({"repetition_penalty": 0}, "--repetition-penalty"),
                                         ({"min_words": 5, "max_words": 2}, "--min-words 5")])
def test_a_wrong_rule_is_one_line_before_anything_loads(picky_models, tmp_path, rules, why):
    a, _ = picky_models
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / ENSEMBLE_FILE).write_text(json.dumps(
        {"format": "captionkit-ensemble", "version": 1, "members": [{"path": str(a), "weight": 1}],
         "decoding": {"length_penalty": 0.0, **rules}}))
    with pytest.raises(CheckpointError) as e:
        read_ensemble(folder)
    assert str(e.value).startswith(str(folder / ENSEMBLE_FILE)) and why in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=why):
        Captioner.load_ensemble([tmp_path / "missing"], rules=rules)  # refused before the member is looked for


def test_a_misspelt_setting_in_ensemble_json_is_one_line(picky_models, tmp_path):
    a, _ = picky_models
    folder = tmp_path / "typo"
    folder.mkdir()
    (folder / ENSEMBLE_FILE).write_text(json.dumps(
        {"format": "captionkit-ensemble", "version": 1, "members": [{"path": str(a), "weight": 1}],
         "decoding": {"length_penalty": 0.0, "no_repeat_ngrams": 2}}))
    with pytest.raises(CheckpointError) as e:
        read_ensemble(folder)
    assert str(e.value).startswith(str(folder / ENSEMBLE_FILE))
    assert "decoding.no_repeat_ngrams is not a setting an ensemble has" in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_rule_is_refused(picky_models):
    a, _ = picky_models
    with pytest.raises(UserError, match="'no_repeat_ngrams' is not one of no_repeat_ngram"):
        Captioner.load_ensemble([a], rules={"no_repeat_ngrams": 2})


def test_the_ensemble_command_refuses_rules_that_do_not_fit(picky_models, tmp_path, capsys):
    a, b = picky_models
    out = tmp_path / "e"
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--min-words", "5", "--max-words", "2",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--min-words 5 is more than --max-words 2" in err and "\n" not in err
    assert not out.exists()


def test_evaluate_records_the_rules_of_an_ensemble_folder(picky_models, picky_data, tmp_path, capsys):
    folder = ruled_ensemble(tmp_path, list(picky_models), {"no_repeat_ngram": 1, "repetition_penalty": 1.2})
    base = ["evaluate", "--model", str(folder), "--dataset", str(picky_data), "--device", "cpu", "--workers", "0",
            "--tokenizer", "python", "--meteor", "none", "--metrics", "bleu"]
    assert main([*base, "--out", str(tmp_path / "own.json")]) == 0
    assert "no repeat ngram 1 (the model's), repetition penalty 1.2 (the model's)" in capsys.readouterr().out
    assert main([*base, "--out", str(tmp_path / "flag.json"), "--no-repeat-ngram", "0"]) == 0
    printed = capsys.readouterr().out
    assert "no repeat ngram 0, repetition penalty 1.2 (the model's)" in printed
    own, flag = (json.loads((tmp_path / f).read_text()) for f in ("own.json", "flag.json"))
    assert own["rules"]["no_repeat_ngram"] == 1 and own["rules"]["repetition_penalty"] == 1.2
    assert flag["rules"]["no_repeat_ngram"] == 0 and flag["controls"] == {"no_repeat_ngram": 0}
