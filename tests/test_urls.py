"""http(s) URLs on the command line (issue 29, item 10): `captionkit caption URL` downloads the
photo (with a size limit and a timeout, captionkit.data.fetch) and captions it as the file; a
URL that fails is that image's one error line naming the URL, and the others go on. Served
by a local HTTP server in a thread of the test."""

from __future__ import annotations

import json
import time

import pytest
from helpers import LocalServer, cli_captions, http_body, http_redirect, http_trickle

from captionkit.cli.main import main


@pytest.fixture(scope="module")
def photos(picky_data):
    """Three photos, smallest file first."""
    return sorted(sorted((picky_data / "Flicker8k_Dataset").iterdir())[:3], key=lambda p: p.stat().st_size)


@pytest.fixture
def server(photos):
    routes = {f"/{p.name}": http_body(p.read_bytes()) for p in photos}
    routes["/same/" + photos[0].name] = http_body(photos[0].read_bytes())
    routes["/slow.png"] = http_trickle(photos[0].read_bytes(), every=0.05)
    routes["/to-ftp.png"] = http_redirect("ftp://127.0.0.1/x.png")
    with LocalServer(routes) as s:
        yield s


def test_caption_a_url_as_its_file(picky_models, photos, server, tmp_path, capsys):
    model = ["--model", str(picky_models[0])]
    want = cli_captions(tmp_path, ["caption", *map(str, photos), *model])
    urls = [server.url(f"/{p.name}") for p in photos]
    got = cli_captions(tmp_path, ["caption", *urls, str(photos[0]), *model])
    # each URL is written under its URL, beside a file of the same name written under its name
    assert got == {**{u: want[p.name] for u, p in zip(urls, photos)}, photos[0].name: want[photos[0].name]}
    capsys.readouterr()
    assert main(["caption", urls[1], *model]) == 0
    assert capsys.readouterr().out == f"{urls[1]}\t{want[photos[1].name]}\n"
    (tmp_path / "list.txt").write_text(f"# photos\n{urls[2]}\n{photos[0]}\n")
    assert cli_captions(tmp_path, ["caption", "--paths-from", str(tmp_path / "list.txt"), *model]) == {
        urls[2]: want[photos[2].name], photos[0].name: want[photos[0].name]}


def test_downloads_go_to_a_temporary_folder_removed_at_the_end(picky_models, photos, server, tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    url = server.url(f"/{photos[0].name}")
    assert main(["caption", url, server.url("/gone.png"), "--model", str(picky_models[0])]) == 1
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_download_is_its_images_error_line(picky_models, photos, server, tmp_path, capsys, monkeypatch):
    model = ["--model", str(picky_models[0])]
    missing, slow, to_ftp, good = (server.url(p) for p in ("/gone.png", "/slow.png", "/to-ftp.png", f"/{photos[1].name}"))
    big = server.url(f"/{photos[2].name}")
    monkeypatch.setenv("CAPTIONKIT_URL_TIMEOUT", "0.5")
    monkeypatch.setenv("CAPTIONKIT_URL_MAX_BYTES", str(photos[2].stat().st_size - 1))  # photos[2] only is over
    t0 = time.perf_counter()
    assert main(["caption", missing, slow, good, to_ftp, big, *model, "--jsonl", str(tmp_path / "c.jsonl")]) == 1
    assert time.perf_counter() - t0 < 10
    lines = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [line["image"] for line in lines] == [missing, slow, good, to_ftp, big]
    errors = {line["image"]: line.get("error") for line in lines}
    assert errors[missing] == f"{missing}: HTTP 404 Not Found"
    assert errors[slow] == f"{slow}: no complete answer within 0.5 s (the timeout, CAPTIONKIT_URL_TIMEOUT)"
    assert errors[to_ftp] == f"{to_ftp}: redirected to ftp://127.0.0.1/x.png, which is not an http(s) URL"
    assert errors[big].startswith(f"{big}: ") and "limit (CAPTIONKIT_URL_MAX_BYTES)" in errors[big]
    assert errors[good] is None and lines[2]["caption"]
    assert capsys.readouterr().err.endswith(f"4 of 5 images could not be captioned; {tmp_path / 'c.jsonl'} lists "
                                            f"them with an error; --retry-failed tries them again\n")

    # resumed: what is done is not downloaded again; --retry-failed downloads the failed ones again
    before = dict(server.hits)
    monkeypatch.delenv("CAPTIONKIT_URL_MAX_BYTES")
    assert main(["caption", missing, good, big, *model, "--jsonl", str(tmp_path / "c.jsonl"), "--retry-failed"]) == 1
    fetched = {path: n - before.get(path, 0) for path, n in server.hits.items() if n - before.get(path, 0)}
    assert fetched == {"/gone.png": 1, f"/{photos[2].name}": 1}
    lines = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert {line["image"]: "caption" in line for line in lines}[big]


def test_a_url_given_twice_is_captioned_once_and_same_names_stay_apart(picky_models, photos, server, tmp_path):
    model = ["--model", str(picky_models[0])]
    a, b = server.url(f"/{photos[0].name}"), server.url(f"/same/{photos[0].name}")
    got = cli_captions(tmp_path, ["caption", a, b, a, *model])
    assert list(got) == [a, b] and got[a] == got[b]
    assert server.hits[f"/{photos[0].name}"] == 1


def test_attention_figures_of_urls(picky_models, photos, server, tmp_path):
    url = server.url(f"/{photos[0].name}")
    assert main(["caption", url, "--model", str(picky_models[0]), "--attention", str(tmp_path / "figs")]) == 0
    assert [p.name for p in (tmp_path / "figs").glob("*.png")] == [url.replace("/", "%2F") + ".png"]


@pytest.mark.parametrize("argv,expect", [
    (["caption", "ftp://example.com/a.jpg"], "ftp://example.com/a.jpg: only http:// and https:// URLs are downloaded, "
                                             "not ftp://"),
    (["caption", "file:///tmp/a.jpg"], "file:///tmp/a.jpg: only http:// and https:// URLs are downloaded, not file://"),
    (["caption", "https://example.com/a.jpg", "--engine", "ray", "--jsonl", "{tmp}/o.jsonl"],
     "https://example.com/a.jpg: --engine ray reads local files"),
    (["zero-shot", "s3://bucket/a.jpg"], "s3://bucket/a.jpg: only http:// and https:// URLs are downloaded"),
])
def test_urls_captionkit_does_not_read_are_one_line(argv, expect, tmp_path, capsys):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1, err


def test_a_bad_url_limit_in_the_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("CAPTIONKIT_URL_TIMEOUT", "soon")
    assert main(["caption", "https://example.com/a.jpg"]) == 2
    assert "CAPTIONKIT_URL_TIMEOUT='soon': give a positive number" in capsys.readouterr().err
