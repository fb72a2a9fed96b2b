"""captionkit models on the Hub (issue 33, item 3), offline: `captionkit push --dry-run` writes the
folder that push uploads; that folder, placed in a huggingface_hub cache as a download leaves it
(blobs, snapshots/COMMIT, refs/BRANCH), loads by `--model hub:ORG/NAME` with HF_HUB_OFFLINE=1 and
gives the captions of the local folder; a changed weight file is refused by the digest; the card's
YAML parses and its scores are the evaluation JSON's. Nothing here reaches the network: the upload
itself (HfApi.upload_folder) is not run."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_captions, direct_captions, place_in_cache

pytest.importorskip("huggingface_hub")
yaml = pytest.importorskip("yaml")

from captionkit.cli.main import main  # noqa: E402
from captionkit.core.errors import CheckpointError, WeightsUnavailable  # noqa: E402
from captionkit.inference import hub  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = sorted((ROOT / "samples").glob("*.jpg"))
REPO = "captionkit-tests/tiny-sat"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(autouse=True)
def _fresh_resolution():
    """hub_folder keeps what it verified for the process; each test starts without it."""
    hub._verified_snapshot.cache_clear()
    yield
    hub._verified_snapshot.cache_clear()


@pytest.fixture(scope="module")
def pushed(tiny_run, flickr_dir, tmp_path_factory):
    """tiny_run's best checkpoint evaluated (`captionkit evaluate --out`) and pushed with --dry-run:
    (the checkpoint, the evaluation JSON, the folder push would upload)."""
    tmp = tmp_path_factory.mktemp("pushed")
    best = tiny_run / "best"
    scores = tmp / "eval.json"
    assert main(["evaluate", "--model", str(best), "--dataset", str(flickr_dir), "--split", "test",
                 "--tokenizer", "python", "--metrics", "bleu,rouge,cider", "--device", "cpu", "--precision", "fp32",
                 "--out", str(scores)]) == 0
    out = tmp / "upload"
    assert main(["push", str(best), REPO, "--dry-run", str(out), "--scores", str(scores)]) == 0
    return best, scores, out


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    head, sep, _ = card[4:].partition("\n---\n")
    assert sep, "no end to the YAML front matter"
    return yaml.safe_load(head)


def test_the_dry_run_folder_is_the_checkpoint_with_a_card_its_scores_and_a_digest(pushed):
    best, scores, out = pushed
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == [".captionkit.json", "README.md", "captionkit-digest.json", "config.json", "model.safetensors",
                     "scores.json"]
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (best / name).read_bytes()
    assert (out / "scores.json").read_bytes() == scores.read_bytes()
    digest = json.loads((out / "captionkit-digest.json").read_text())
    assert digest["format"] == "captionkit-digest" and sorted(digest["sha256"]) == [
        ".captionkit.json", "config.json", "model.safetensors", "scores.json"]  # all but the card
    for name, want in digest["sha256"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == want, name
    # the checkpoint's own digest of its weights (config.json) is the one pushed
    assert digest["sha256"]["model.safetensors"] == json.loads((best / "config.json").read_text())["sha256"][
        "model.safetensors"]


def test_the_card_yaml_parses_and_its_scores_are_the_evaluation_json_s(pushed):
    best, scores, out = pushed
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "captionkit" and meta["pipeline_tag"] == "image-to-text"
    assert {"captionkit", "image-captioning", "sat"} <= set(meta["tags"])
    assert meta["datasets"] == [Path(json.loads((best / "config.json").read_text())["train"]["data"]["dataset"]).name]
    evaluation = json.loads(scores.read_text())
    (result,) = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == REPO
    assert result["task"]["type"] == "image-to-text" and result["dataset"]["split"] == "test"
    names = {"Bleu_1": "BLEU-1", "Bleu_2": "BLEU-2", "Bleu_3": "BLEU-3", "Bleu_4": "BLEU-4", "ROUGE_L": "ROUGE-L",
             "CIDEr": "CIDEr-D"}
    assert {m["name"]: m["value"] for m in result["metrics"]} == {names[k]: v for k, v in evaluation["scores"].items()}
    assert len(evaluation["scores"]) == 6
    # the table gives the same figures, and the command that produced them, for the pushed model
    for k, v in evaluation["scores"].items():
        assert f"| {names[k]} | {v} |" in card
    assert f"captionkit evaluate --model hub:{REPO} --dataset {Path(evaluation['dataset']).name} --split test " \
           f"--beam 3" in card
    # the sample photos (the repository's, by default) captioned by this model
    local = Captioner.load(best, device="cpu", precision="fp32")
    for r in local(list(map(str, SAMPLES))):
        assert f"| `{Path(r.source).name}` | {r.text} |" in card
    for section in ("## Model", "## Training data", "## Scores", "## Sample captions", "## Intended use and limits"):
        assert section in card
    assert str(best.parent) not in card  # no path of this machine


@pytest.mark.slow  # a child process (its own torch import): HF_HOME and HF_HUB_OFFLINE as a user sets them
def test_hub_model_offline_gives_the_local_folder_s_captions(pushed, tmp_path):
    best, _, out = pushed
    hf_home = tmp_path / "hf"
    place_in_cache(out, hf_home / "hub", REPO, COMMIT_A)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    photos = [str(p) for p in SAMPLES[:3]]
    run = subprocess.run([sys.executable, "-m", "captionkit", "caption", "--model", f"hub:{REPO}", "--device", "cpu",
                          "--precision", "fp32", "--json", str(tmp_path / "hub.json"), *photos],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    local = cli_captions(tmp_path, ["caption", "--model", str(best), "--device", "cpu", "--precision", "fp32", *photos])
    assert json.loads((tmp_path / "hub.json").read_text()) == local and len(local) == 3
    # nothing in the cache but what was placed there: no download was tried, none happened
    assert sorted(p.name for p in (hf_home / "hub").iterdir()) == ["models--" + REPO.replace("/", "--")]


def test_from_pretrained_loads_the_cached_snapshot_with_the_same_captions(pushed, tmp_path):
    best, _, out = pushed
    place_in_cache(out, tmp_path / "cache", REPO, COMMIT_A)
    cap = Captioner.from_pretrained(REPO, cache_dir=tmp_path / "cache", local_files_only=True, device="cpu",
                                    precision="fp32")
    assert cap.config["sha256"] == json.loads((best / "config.json").read_text())["sha256"]
    local = Captioner.load(best, device="cpu", precision="fp32")
    assert direct_captions(cap, SAMPLES[:3]) == direct_captions(local, SAMPLES[:3])


def test_a_changed_weight_file_is_refused_by_the_digest(pushed, tmp_path, monkeypatch, capsys):
    _, _, out = pushed
    cache = tmp_path / "cache"
    snapshot = place_in_cache(out, cache, REPO, COMMIT_A)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor: a file that still reads, with other weights
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not the file that was pushed"):
        hub.hub_folder(REPO, cache_dir=cache, local_files_only=True)
    # on the command line: one line naming the file, before anything loads
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["caption", "--model", f"hub:{REPO}", str(SAMPLES[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is not the file that was pushed" in err
    assert err.startswith(f"captionkit caption: error: hub:{REPO}: ")


def test_a_changed_config_is_refused_too(pushed, tmp_path):
    """The digest covers what the checkpoint's own digests cannot: config.json itself."""
    _, _, out = pushed
    snapshot = place_in_cache(out, tmp_path, REPO, COMMIT_A)
    blob = (snapshot / "config.json").resolve()
    cfg = json.loads(blob.read_text())
    cfg["decoding"]["max_len"] = 3
    blob.write_text(json.dumps(cfg, indent=1))
    with pytest.raises(CheckpointError, match=r"config\.json is not the file that was pushed"):
        hub.hub_folder(REPO, cache_dir=tmp_path, local_files_only=True)


def test_a_model_without_its_digest_or_with_an_unlisted_file_is_refused(pushed, tmp_path):
    _, _, out = pushed
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((out / name).read_bytes())
    place_in_cache(bare, tmp_path / "c1", REPO, COMMIT_A)
    with pytest.raises(CheckpointError, match="has no captionkit-digest.json"):
        hub.hub_folder(REPO, cache_dir=tmp_path / "c1", local_files_only=True)
    digest = json.loads((out / "captionkit-digest.json").read_text())
    del digest["sha256"]["model.safetensors"]  # a weight file no digest vouches for
    (bare / "captionkit-digest.json").write_text(json.dumps(digest))
    (bare / "scores.json").write_bytes((out / "scores.json").read_bytes())
    (bare / ".captionkit.json").write_bytes((out / ".captionkit.json").read_bytes())
    place_in_cache(bare, tmp_path / "c2", REPO, COMMIT_A)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not in captionkit-digest\.json"):
        hub.hub_folder(REPO, cache_dir=tmp_path / "c2", local_files_only=True)


def test_revisions_pin_the_snapshot(pushed, tmp_path):
    _, _, out = pushed
    place_in_cache(out, tmp_path, REPO, COMMIT_A, refs=("main",))
    place_in_cache(out, tmp_path, REPO, COMMIT_B, refs=("v1",))
    assert hub.hub_folder(REPO, cache_dir=tmp_path, local_files_only=True).name == COMMIT_A
    assert hub.hub_folder(REPO, "v1", cache_dir=tmp_path, local_files_only=True).name == COMMIT_B
    assert hub.hub_folder(REPO, COMMIT_B, cache_dir=tmp_path, local_files_only=True).name == COMMIT_B
    assert hub.parse_hub_ref(f"hub:{REPO}@v1") == (REPO, "v1")
    with pytest.raises(WeightsUnavailable, match=r"hub:captionkit-tests/tiny-sat@v2: not in the Hugging Face cache"):
        hub.hub_folder(REPO, "v2", cache_dir=tmp_path, local_files_only=True)


@pytest.mark.parametrize("ref,message", [
    ("hub:a/b/c", "'hub:a/b/c': not a model name on the Hub"),
    ("hub:org/na--me", "not a model name on the Hub"),
    (f"hub:{REPO}@", "nothing after '@'"),
])
def test_a_bad_hub_reference_is_one_line(ref, message, no_expensive_work, capsys):
    assert main(["caption", "--model", ref, str(SAMPLES[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_push_mistakes_are_one_line_before_the_model_loads(tiny_run, tmp_path, monkeypatch, no_expensive_work,
                                                           capsys):
    best = str(tiny_run / "best")
    cases = [
        (["push", best, "a/b/c", "--dry-run", str(tmp_path / "x")], "'a/b/c': not a model name on the Hub"),
        (["push", str(tmp_path / "nope"), REPO, "--dry-run", str(tmp_path / "x")], "no such model folder"),
        (["push", best, REPO, "--dry-run", str(tmp_path / "x"), "--scores", str(tmp_path / "s.json")],
         "s.json: no such file"),
        (["push", best, REPO, "--dry-run", str(tmp_path / "x"), "--samples", str(tmp_path / "none.jpg")],
         "none.jpg: no such file"),
    ]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("not captionkit's")
    cases.append((["push", best, REPO, "--dry-run", str(tmp_path / "full")], "exists and is not empty"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "transformer-lite2-flickr8k", "scale": "x100", "scores": {"CIDEr": 1.0}}))
    cases.append((["push", best, REPO, "--dry-run", str(tmp_path / "x"), "--scores", str(other)],
                  "scores of transformer-lite2-flickr8k, not of"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    # an upload needs a login: said before the model loads and its samples are captioned
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert main(["push", best, REPO]) == 2
    assert "not logged in to the Hugging Face Hub" in capsys.readouterr().err
    # without huggingface_hub: the pip command
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["push", best, REPO, "--dry-run", str(tmp_path / "x")]) == 2
    assert "pip install 'captionkit[hub]'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_ensemble_with_members_outside_its_folder_is_pushed_whole(tiny_run, tmp_path):
    """`captionkit ensemble --out` names members by relative paths, here outside the folder: the
    pushed folder holds copies of them, and loads from the cache as the local ensemble does."""
    ens = tmp_path / "ens"
    assert main(["ensemble", "--model", str(tiny_run / "best"), "--model", str(tiny_run / "last"),
                 "--out", str(ens)]) == 0
    out = tmp_path / "upload"
    assert main(["push", str(ens), REPO, "--dry-run", str(out), "--samples", str(SAMPLES[0])]) == 0
    spec = json.loads((out / "ensemble.json").read_text())
    assert [m["path"] for m in spec["members"]] == ["best", "last"]
    assert (out / "best" / "model.safetensors").read_bytes() == (tiny_run / "best" / "model.safetensors").read_bytes()
    # the optimizer's state of a training checkpoint stays behind
    assert (tiny_run / "last" / "optimizer.safetensors").is_file()
    assert not (out / "last" / "optimizer.safetensors").exists()
    place_in_cache(out, tmp_path / "cache", REPO, COMMIT_A)
    cap = Captioner.from_pretrained(f"hub:{REPO}", cache_dir=tmp_path / "cache", local_files_only=True,
                                    device="cpu", precision="fp32")
    local = Captioner.load(ens, device="cpu", precision="fp32")
    assert direct_captions(cap, SAMPLES[:2]) == direct_captions(local, SAMPLES[:2])
    meta = front_matter((out / "README.md").read_text())
    assert "ensemble" in meta["tags"] and "model-index" not in meta  # no scores given, none claimed
    # pushed again over its --dry-run folder: the same bytes (no dates, no paths of this machine)
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["push", str(ens), REPO, "--dry-run", str(out), "--samples", str(SAMPLES[0]), "--overwrite"]) == 0
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_push_uploads_the_staged_folder(pushed, tiny_run, monkeypatch, tmp_path, capsys):
    """The upload's calls, with HfApi replaced by a recorder (the Hub itself is not reached here):
    the repository and the branch made if missing, and the folder uploaded is the --dry-run one."""
    import huggingface_hub

    _, scores, dry = pushed
    calls = []

    class Api:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def create_branch(self, repo_id, **kw):
            calls.append(("create_branch", repo_id, kw))

        def upload_folder(self, *, repo_id, folder_path, **kw):
            folder = Path(folder_path)
            files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
            calls.append(("upload_folder", repo_id, files, kw))
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/{COMMIT_A}"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_token")
    assert main(["push", str(tiny_run / "best"), REPO, "--private", "--revision", "v1", "--scores", str(scores)]) == 0
    assert capsys.readouterr().out.startswith(f"pushed to https://huggingface.co/{REPO}/commit/{COMMIT_A}: 6 files")
    (_, _, made), (_, _, branch), (_, repo, files, kw) = calls
    assert made == {"private": True, "exist_ok": True} and branch == {"branch": "v1", "exist_ok": True}
    assert repo == REPO and kw["revision"] == "v1"
    assert files == {p.relative_to(dry).as_posix(): p.read_bytes() for p in dry.rglob("*") if p.is_file()}
