"""Nothing let in: every field of a run config -- [data], [encoder], [train] and each model
family's [model] -- is checked when the file is read (type, range, unknown key), and a mistake
is one ConfigError line naming the file and the field, before any dataset, feature or model
loads (issue 17, point 2)."""

import dataclasses
import datetime
import math
import re
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from captionkit.cli.main import main
from captionkit.core.errors import ConfigError
from captionkit.models import family_fields
from captionkit.training.config import SECTIONS, TRAINER_SET, DataConfig, EncoderConfig, RunConfig, TrainConfig

BASE = '[data]\ndataset = "x"\n'
FAMILIES = ["sat", "transformer", "prefix_lm", "vit_gpt2"]


def load(tmp_path, text: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return RunConfig.load(path)


@pytest.mark.parametrize("text,message", [
    # the reproductions of issue 17
    ('[train]\nlr = "fast"', "train.lr must be a number, got 'fast'"),
    ('[model]\nembed_dim = "big"', "model.embed_dim must be an integer, got 'big'"),
    ('[train]\ngrad_clip = "no"', "train.grad_clip must be a number, got 'no'"),
    ("[train]\nepochs = 1.5", "train.epochs must be an integer, got 1.5"),
    ("[model]\nembed_dims = 300", r"unknown field\(s\) in \[model\]: embed_dims \(did you mean embed_dim\?\)"),
    # ranges, choices, lists and tables
    ("[train]\nbatch_size = 0", "train.batch_size must be >= 1, got 0"),
    ("[train]\nlr = nan", "train.lr must be a finite number, got nan"),
    ("[train]\nlabel_smoothing = 1.0", r"train.label_smoothing must be in \[0, 1\), got 1.0"),
    ("[train]\nlength_penalties = []", "train.length_penalties must not be empty"),
    ('[train]\nlength_penalties = [0.5, "long"]', r"train.length_penalties\[1\] must be a number, got 'long'"),
    ("[train]\nlr_groups = { lora = -1 }", "train.lr_groups.lora must be > 0"),
    ("[train]\nfreeze_embeddings = 1", "train.freeze_embeddings must be true or false, got 1"),
    ('[data]\ntokenizer = "wordpiece"', "data.tokenizer must be one of word, char, bpe, lm, not 'wordpiece'"),
    ("[data]\nmin_count = true", "data.min_count must be an integer, got True"),
    ('[encoder]\nname = "vgg20"', "encoder.name must be one of .*, not 'vgg20'"),
    ('[trian]\nepochs = 2', r"unknown table\(s\): trian \(did you mean train\?\)"),
    ("data = 3", r"\[data\] must be a table, got 3"),
    # cross-field and cross-table
    ('[train]\nobjective = "scst"\nscst_baseline = "mean"\nsamples = 1',
     'train.scst_baseline = "mean" needs train.samples >= 2'),
    ('[data]\ntokenizer = "bpe"\n[train]\nglove = "g.txt"', "train.glove: word vectors need a word tokenizer"),
    ('[model]\nfamily = "transformer"\nwidth = 10', r"model.width \(10\) must be a multiple of heads \(4\)"),
    ('[model]\nfamily = "rnn"', "model.family: unknown model family 'rnn'; known: hf_blip, hf_git, hf_idefics3, "
                                "hf_ved, prefix_lm, sat, transformer, vit_gpt2"),
    ("[model]\nvocab_size = 100", r"model.vocab_size is set by the trainer \(the tokenizer's size\); leave it out"),
])
def test_a_bad_field_is_one_line_naming_the_file_and_the_field(tmp_path, text, message):
    if text.startswith("[data]"):
        text = BASE + text.split("\n", 1)[1]
    elif not text.startswith("data ="):
        text = BASE + text
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'run.toml'))}: {message}") as e:
        load(tmp_path, text)
    assert "\n" not in str(e.value)


# one bad value and one misspelt field per family: each family's [model] is checked against its
# own config dataclass when the file is read (no language model or encoder is loaded for it)
FAMILY_CASES = {
    "sat": ('attention = "spiky"', "model.attention must be one of soft, hard", "hiden_dim", "hidden_dim"),
    "transformer": ("heads = 0", "model.heads must be >= 1, got 0", "decoder_layer", "decoder_layers"),
    "prefix_lm": ("pool = [3, 3, 3]", r"model.pool must have 2 items", "lora_rnak", "lora_rank"),
    "vit_gpt2": ('freeze_encoder_blocks = "some"', 'model.freeze_encoder_blocks must be a number of blocks >= 0 or "all"',
                 "freeze_encoder", "freeze_encoder_blocks"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_familys_model_fields_are_checked_when_the_file_is_read(tmp_path, family):
    bad, message, typo, meant = FAMILY_CASES[family]
    head = BASE + f'[model]\nfamily = "{family}"\n'
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, head + bad)
    with pytest.raises(ConfigError, match=rf"unknown field\(s\) in \[model\]: {typo} \(did you mean {meant}\?\)"):
        load(tmp_path, head + f"{typo} = 1")
    assert load(tmp_path, head).model == {"family": family}


@pytest.mark.parametrize("cls", [DataConfig, TrainConfig])
def test_integer_fields_refuse_floats(tmp_path, cls):
    hints = typing.get_type_hints(cls)
    ints = [f.name for f in dataclasses.fields(cls) if hints[f.name] is int]
    assert ints
    for name in ints:
        with pytest.raises(ConfigError, match=rf"{cls.SECTION}.{name} must be an integer, got 2.0"):
            load(tmp_path, BASE + f"[{cls.SECTION}]\n{name} = 2.0\n" if cls is TrainConfig
                 else f'[data]\ndataset = "x"\n{name} = 2.0\n')


def test_a_model_typo_is_reported_before_any_dataset_or_feature_loads(tiny_config, tmp_path, no_expensive_work,
                                                                      capsys):
    cfg = tmp_path / "typo.toml"
    cfg.write_text(tiny_config.read_text().replace("hidden_dim = 24", "hiden_dim = 24"))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"captionkit train: error: {cfg}: unknown field(s) in [model]: hiden_dim "
                   f"(did you mean hidden_dim?)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sets,why", [
    (["train.sed=1"], "{cfg} with --set train.sed=1: unknown field(s) in [train]: sed (did you mean seed?)"),
    (["train.seed=-1"], "{cfg} with --set train.seed=-1: train.seed must be in [0, 4.29497e+09], got -1"),
    (["train.optimizer=sgd"], "{cfg} with --set train.optimizer='sgd': train.optimizer must be one of adam, "
                              "adamw, rmsprop, not 'sgd'"),
    (["model.hiden_dim=24"], "{cfg} with --set model.hiden_dim=24: unknown field(s) in [model]: hiden_dim "
                             "(did you mean hidden_dim?)"),
    (["train.epochs.x=1"], "{cfg} with --set train.epochs.x=1: --set train.epochs.x: epochs is a value, "
                           "not a table"),
    (["train.seed=1", "train.seed=2"], "--set train.seed is given twice"),
])
def test_a_set_mistake_is_one_line_naming_it_before_any_work(tiny_config, tmp_path, sets, why, no_expensive_work,
                                                             capsys):
    """train --set: a field that does not exist, a value out of its range, a key through a value,
    the same key twice: one line, exit 2, nothing loaded and no run folder."""
    args = [x for s in sets for x in ("--set", s)]
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), *args]) == 2
    assert capsys.readouterr().err == f"captionkit train: error: {why.format(cfg=tiny_config)}\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["trainseed=1", "train.seed=", "=2", "train..seed=1", "train.seed"])
def test_a_set_that_is_not_a_dotted_key_and_a_value_is_refused_by_the_parser(tiny_config, text, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(tiny_config), "--set", text])
    assert e.value.code == 2
    assert f"argument --set: expected TABLE.FIELD=VALUE, e.g. train.seed=2, got {text!r}" in capsys.readouterr().err


def test_set_values_are_toml_and_replace_the_files_fields(tiny_config):
    """What --set's values parse to (TOML; a bare word is a string), as RunConfig.load applies them."""
    from captionkit.cli.argtypes import config_setting
    sets = [config_setting(t) for t in ("train.seed=7", "train.lr=5e-4", "train.optimizer=adamw",
                                        'train.schedule="cosine"', "train.length_penalties=[0.5, 1.5]",
                                        "train.flip=0.25", "model.hidden_dim=32")]
    cfg = RunConfig.load(tiny_config, settings={s.key: s.value for s in sets})
    t = cfg.train
    assert (t.seed, t.lr, t.optimizer, t.schedule, t.length_penalties, t.flip) == \
        (7, 5e-4, "adamw", "cosine", [0.5, 1.5], 0.25)
    assert cfg.model["hidden_dim"] == 32
    base = RunConfig.load(tiny_config)  # the file itself is untouched
    assert (base.train.seed, base.train.lr, base.model["hidden_dim"]) == (0, 1e-2, 24)


@pytest.mark.parametrize("value,why", [("-1", "must be at least 1, got -1"), ("0", "must be at least 1, got 0"),
                                       ("1.5", "expected a whole number, got '1.5'"),
                                       ("many", "expected a whole number, got 'many'")])
def test_max_steps_must_be_a_positive_integer(tiny_config, value, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(tiny_config), "--max-steps", value])
    assert e.value.code == 2
    assert f"argument --max-steps: {why}" in capsys.readouterr().err


def test_checkpoint_configs_are_checked_the_same_way():
    from captionkit.models import family_config
    from captionkit.models.sat import SATConfig
    with pytest.raises(ValueError, match="SATConfig.embed_dim must be an integer, got 1.5"):
        SATConfig(vocab_size=10, embed_dim=1.5)
    assert family_config("transformer", {"vocab_size": 10, "grid": (3, 4), "dropout": 0}).dropout == 0.0


def test_the_trainer_set_fields_are_fields_of_the_families():
    for family in FAMILIES:
        assert {"vocab_size", "feat_dim"} <= family_fields(family)
    assert set(TRAINER_SET) <= set().union(*(family_fields(f) for f in FAMILIES))


# ---- property: whatever the document, it loads or it is one ConfigError line naming a field ----------
NAMES = sorted({f.name for cls in (DataConfig, EncoderConfig, TrainConfig) for f in dataclasses.fields(cls)}
               | {n for fam in FAMILIES for n in family_fields(fam)}
               | {"family"})
WORDS = ["sat", "transformer", "prefix_lm", "vit_gpt2", "word", "char", "bpe", "lm", "adam", "scst", "mean",
         "all", "soft", "hard", "mlp", "CIDEr", "random", "patches", "efficientnet_lite0", "x", ""]
leaves = st.one_of(st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1), st.integers(-3, 70),
                   st.floats(), st.booleans(), st.text(max_size=12), st.sampled_from(WORDS),
                   st.dates())
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), inner, max_size=3),
                      max_leaves=8)
keys = st.sampled_from(NAMES) | st.text(max_size=10)
tables = st.dictionaries(keys, values, max_size=6)
OWN = {cls.SECTION: [f.name for f in dataclasses.fields(cls)] for cls in (DataConfig, EncoderConfig, TrainConfig)}


@st.composite
def near_valid(draw) -> dict:
    """A valid config with a few fields of one table set to random values (mostly its own
    field names, sometimes a stray one): reaches the checks behind the first ones."""
    family = draw(st.sampled_from(FAMILIES))
    doc = {"data": {"dataset": "x"}, "model": {"family": family}}
    section = draw(st.sampled_from(SECTIONS))
    own = OWN.get(section) or sorted(family_fields(family) - set(TRAINER_SET))
    plausible = st.one_of(st.integers(0, 70), st.floats(0, 1), st.booleans(),
                          st.sampled_from(WORDS), st.lists(st.integers(0, 12), max_size=3))
    extra = draw(st.dictionaries(st.sampled_from(own), plausible | values, min_size=1, max_size=3))
    if draw(st.integers(0, 9)) == 0:  # now and then a stray key
        extra[draw(keys)] = draw(values)
    doc[section] = {**doc.get(section, {}), **extra}
    return doc


documents = st.one_of(st.dictionaries(st.sampled_from(SECTIONS) | st.text(max_size=8), tables | values, max_size=5),
                      near_valid())


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, datetime.date):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


def to_toml(doc: dict) -> str:
    lines = [f"{_toml_string(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += [f"[{_toml_string(k)}]"] + [f"{_toml_string(kk)} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


NAMED = re.compile(r"(unknown table\(s\): |unknown field\(s\) in \[(data|encoder|model|train)\]: "
                   r"|\[(data|encoder|model|train)\] |(data|encoder|model|train)\.[a-z_]+|with train\.init )")


@pytest.fixture(scope="module")
def doc_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "run.toml"


def loads_or_names_the_field(path: Path, text: str, parsed: bool) -> None:
    path.write_text(text, encoding="utf-8")
    try:
        RunConfig.load(path)
    except ConfigError as e:  # anything else escaping fails the test
        msg = str(e)
        assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
        rest = msg[len(f"{path}: "):]
        assert (NAMED.match(rest) if parsed else rest.startswith("invalid TOML")), msg


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
@pytest.mark.slow  # hypothesis: many generated documents
def test_any_toml_document_loads_or_is_one_line_naming_the_field(doc_path, doc):
    loads_or_names_the_field(doc_path, to_toml(doc), parsed=True)


@settings(max_examples=100, deadline=None, database=None)
@given(st.text(max_size=80))
def test_any_text_loads_or_is_one_line(doc_path, text):
    path = doc_path
    path.write_text(text, encoding="utf-8")
    try:
        import tomllib
        tomllib.loads(text)
        parsed = True
    except tomllib.TOMLDecodeError:
        parsed = False
    loads_or_names_the_field(path, text, parsed)
