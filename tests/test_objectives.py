"""Hard attention's lower bound, self-critical training and encoder fine-tuning, on tiny
models and synthetic data."""

import json

import pytest
import torch

from captionkit.core.checkpoint import read_config, read_weights
from captionkit.data.vocab import Vocab
from captionkit.encoders import create_encoder
from captionkit.inference.captioner import Captioner
from captionkit.inference.decoding import greedy
from captionkit.models import create_model
from captionkit.models.sat import caption_loss
from captionkit.scoring.metrics import CiderD
from captionkit.training.config import RunConfig
from captionkit.training.run import train
from captionkit.training.scst import SelfCritical, leave_one_out_mean, sample, sequence_logprobs


def tiny(**kw):
    cfg = dict(vocab_size=12, feat_dim=10, embed_dim=8, hidden_dim=9, attn_dim=7, dropout=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return create_model("sat", cfg)


def batch(B=4, T=7):
    torch.manual_seed(1)
    ids = torch.randint(4, 12, (B, T))
    ids[:, 0], ids[:, -1] = Vocab.start, Vocab.end
    return torch.randn(B, 6, 10), ids


# ---- hard attention ------------------------------------------------------------------------
def test_hard_attention_with_expected_context_only_is_the_soft_objective():
    feats, ids = batch()
    hard = tiny(attention="hard", expected_prob=1.0, entropy_weight=0.0).train()
    soft = tiny().train()
    soft.load_state_dict({k: v for k, v in hard.state_dict().items() if k != "baseline"})
    loss_h, ce_h = hard.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=1.0)
    logits, alphas = soft(feats, ids[:, :-1])
    loss_s, ce_s = caption_loss(logits, ids[:, 1:], alphas, alpha_c=1.0)
    torch.testing.assert_close(loss_h, loss_s)
    torch.testing.assert_close(ce_h, ce_s)


def test_hard_attention_trains_its_attention_by_reinforce_with_a_moving_baseline():
    feats, ids = batch()
    m = tiny(attention="hard", expected_prob=0.0, baseline_decay=0.9).train()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ces = []
    for step in range(30):
        loss, ce = m.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=0.0)
        assert torch.isfinite(loss)
        if step == 0:
            att_grad = torch.autograd.grad(loss, m.att_w, retain_graph=True)[0]
            # no baseline yet on the first batch, so no REINFORCE step: the attention MLP
            # only gets the entropy bonus's gradient, which is small
            assert float(m.baseline[1]) == 1 and float(m.baseline[0]) == pytest.approx(-float(ce.detach()))
        if step == 1:  # b <- 0.9 b + 0.1 (this batch's mean log-likelihood per word)
            assert float(m.baseline[0]) == pytest.approx(0.9 * -ces[0] + 0.1 * -float(ce.detach()), rel=1e-5)
            grad = torch.autograd.grad(loss, m.att_w, retain_graph=True)[0]
            assert grad.abs().sum() > att_grad.abs().sum()  # the REINFORCE term reaches alpha
        ces.append(float(ce.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = m.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in ("att_w", "att_feat.weight", "out.weight"))
    assert ces[-1] < 0.5 * ces[0]


def test_hard_attention_decodes_with_the_expected_context():
    hard = tiny(attention="hard")
    soft = tiny()
    soft.load_state_dict({k: v for k, v in hard.state_dict().items() if k != "baseline"})
    feats = torch.randn(3, 6, 10)
    assert [c.ids for c in greedy(hard.eval(), feats, 6)] == [c.ids for c in greedy(soft.eval(), feats, 6)]


# ---- self-critical training --------------------------------------------------------------
def test_samples_end_in_end_then_pad_and_their_logprobs_match_the_step_contract():
    m = tiny().eval()
    feats = torch.randn(3, 6, 10)
    torch.manual_seed(2)
    seqs = sample(m, feats, n=4, max_len=5)
    assert seqs.shape[0] == 12 and seqs.shape[1] <= 6
    for row in seqs.tolist():
        n = row.index(Vocab.end)
        assert not {Vocab.pad, Vocab.start, Vocab.unk} & set(row[:n]) and set(row[n + 1:]) <= {Vocab.pad}
    with torch.no_grad():
        lp = sequence_logprobs(m, feats.repeat_interleave(4, 0), seqs)  # (12, T)
        mem = m.prepare(feats.repeat_interleave(4, 0))
        state, tokens = m.init_state(mem), torch.full((12,), Vocab.start)
        for t in range(seqs.shape[1]):
            logp, state, _ = m.step(tokens, state, mem)
            logp[:, [Vocab.pad, Vocab.start, Vocab.unk]] = float("-inf")
            want = torch.log_softmax(logp, -1).gather(1, seqs[:, t:t + 1]).squeeze(1)
            live = seqs[:, t] != Vocab.pad
            torch.testing.assert_close(lp[live, t], want[live], rtol=1e-5, atol=1e-5)
            tokens = seqs[:, t]
        # each image's side prepared once for its 4 samples: the same numbers
        torch.testing.assert_close(sequence_logprobs(m, feats, seqs, 4), lp)


def test_self_critical_baseline_is_the_greedy_captions_cider():
    m = tiny().eval()
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(8)])
    refs = {k: [[f"w{(k + j) % 8}", f"w{(k * 3 + j) % 8}", "w1"] for j in range(3)] for k in range(5)}
    sc = SelfCritical(refs, vocab, samples=3, max_len=6)
    feats = torch.randn(5, 6, 10)
    torch.manual_seed(7)
    loss, stats = sc.loss(m, feats, list(range(5)))
    # the same computation by hand, from the same random draws
    cider = CiderD(refs)
    base = greedy(m, feats, 6)
    r_greedy = torch.tensor([cider.score(k, vocab.decode(c.ids)) for k, c in enumerate(base)])
    assert stats.greedy_reward == pytest.approx(float(r_greedy.mean()))
    torch.manual_seed(7)
    seqs = sample(m, feats, 3, 6)
    r_sample = torch.tensor([cider.score(i // 3, vocab.decode([w for w in row if w > Vocab.end]))
                             for i, row in enumerate(seqs.tolist())])
    assert stats.sample_reward == pytest.approx(float(r_sample.mean()))
    lp = sequence_logprobs(m, feats.repeat_interleave(3, 0), seqs)
    want = -((r_sample - r_greedy.repeat_interleave(3)).unsqueeze(1) * lp).sum() / (seqs != Vocab.pad).sum()
    torch.testing.assert_close(loss, want)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    loss.backward()
    opt.step()
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_mean_baseline_is_the_other_samples_mean_reward():
    r = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # two images, three samples each
    torch.testing.assert_close(leave_one_out_mean(r, 3), torch.tensor([4.0, 3.5, 1.5, 1.5, 1.5, 0.0]))
    m = tiny().eval()
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(8)])
    refs = {k: [[f"w{(k + j) % 8}", f"w{(k * 3 + j) % 8}", "w1"] for j in range(3)] for k in range(5)}
    sc = SelfCritical(refs, vocab, samples=3, max_len=6, baseline="mean")
    feats = torch.randn(5, 6, 10)
    torch.manual_seed(7)
    loss, stats = sc.loss(m, feats, list(range(5)))
    assert stats.greedy_reward is None  # no greedy caption is decoded
    torch.manual_seed(7)  # the same draws by hand
    seqs = sample(m, feats, 3, 6)
    cider = CiderD(refs)
    r_sample = torch.tensor([cider.score(i // 3, vocab.decode([w for w in row if w > Vocab.end]))
                             for i, row in enumerate(seqs.tolist())])
    advantage = r_sample - torch.stack([(r_sample.view(5, 3).sum(1) - r_sample.view(5, 3)[:, j]) / 2
                                        for j in range(3)], 1).reshape(-1)
    torch.testing.assert_close(advantage.view(5, 3).sum(1), torch.zeros(5), atol=1e-6, rtol=0)
    lp = sequence_logprobs(m, feats.repeat_interleave(3, 0), seqs)
    torch.testing.assert_close(loss, -(advantage.unsqueeze(1) * lp).sum() / (seqs != Vocab.pad).sum())
    with pytest.raises(ValueError, match="the mean baseline needs at least 2 samples"):
        SelfCritical(refs, vocab, samples=1, baseline="mean")
    with pytest.raises(ValueError, match="baseline must be one of greedy, mean, not 'best'"):
        SelfCritical(refs, vocab, baseline="best")


# ---- the trainer: hard attention, self-critical and fine-tuning runs ----------------------
def _variant(tiny_config, tmp_path, name, model=None, train_extra=""):
    text = tiny_config.read_text().replace("epochs = 3", "epochs = 1")
    if model is not None:
        head, _, rest = text.partition("[model]")
        text = head + rest[rest.index("[train]"):] if model == "" else text.replace("[model]", f"[model]\n{model}")
    for line in train_extra.splitlines():  # these override the tiny config's own values
        key = line.split("=")[0].strip()
        text = "\n".join(l for l in text.splitlines() if l.split("=")[0].strip() != key)
    text = text.replace("[train]", f"[train]\n{train_extra}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.slow  # a training run
def test_hard_attention_run(tiny_config, tmp_path):
    cfg = _variant(tiny_config, tmp_path, "hard", model='attention = "hard"')
    train(cfg, out=tmp_path / "hard", progress=False)
    w = read_weights(tmp_path / "hard" / "best")
    assert float(w["baseline"][1]) > 0  # the baseline saw every batch
    cfg = read_config(tmp_path / "hard" / "best")  # decoding with either context was tried on dev
    assert {k.split(",")[0] for k in cfg["length_penalty_search"]["scores"]} == {"expected", "argmax"}
    assert cfg["model"]["decode_context"] in ("expected", "argmax")
    cap = Captioner.load(tmp_path / "hard" / "best", with_encoder=False)
    res = cap.result(cap.decode_features(torch.randn(1, 49, 1280).abs(), beam=2)[0])
    # a hard-attention figure shows the one location each word most likely came from
    assert torch.equal(res.attention.sum(1), torch.ones(len(res.words)))
    assert set(res.attention.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.slow  # a training run
def test_self_critical_run_starts_from_a_checkpoint(tiny_run, tiny_config, tmp_path):
    cfg = _variant(tiny_config, tmp_path, "scst", model="",
                   train_extra=f'init = "{tiny_run / "best"}"\nobjective = "scst"\nsamples = 3\nlr = 1e-3\n')
    train(cfg, out=tmp_path / "scst", progress=False)
    hist = [json.loads(l) for l in (tmp_path / "scst" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [0, 1]  # 0: the starting checkpoint's dev score
    assert hist[1]["reward"] >= 0 and hist[1]["greedy_reward"] >= 0
    best = read_config(tmp_path / "scst" / "best")
    assert best["vocab"] == read_config(tiny_run / "best")["vocab"]
    last = read_weights(tmp_path / "scst" / "last")
    start = read_weights(tiny_run / "best")
    assert any(not torch.equal(last[k], start[k]) for k in start)


@pytest.mark.slow  # a training run
def test_self_critical_run_with_the_mean_baseline(tiny_run, tiny_config, tmp_path):
    cfg = _variant(tiny_config, tmp_path, "scst_mean", model="",
                   train_extra=f'init = "{tiny_run / "best"}"\nobjective = "scst"\nsamples = 3\n'
                               f'scst_baseline = "mean"\nlr = 1e-3\n')
    train(cfg, out=tmp_path / "scst_mean", progress=False)
    hist = [json.loads(l) for l in (tmp_path / "scst_mean" / "history.jsonl").read_text().splitlines()]
    assert hist[1]["reward"] >= 0 and "greedy_reward" not in hist[1]
    last, start = read_weights(tmp_path / "scst_mean" / "last"), read_weights(tiny_run / "best")
    assert any(not torch.equal(last[k], start[k]) for k in start)
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("samples = 3", "samples = 1"))
    with pytest.raises(ValueError, match='train.scst_baseline = "mean" needs train.samples >= 2'):
        RunConfig.load(bad)


@pytest.mark.slow  # a training run
def test_fine_tuning_the_encoders_last_block(tiny_run, tiny_config, tmp_path):
    cfg = _variant(tiny_config, tmp_path, "ft", model="",
                   train_extra=f'init = "{tiny_run / "best"}"\nfinetune_blocks = 1\nencoder_lr = 1e-2\n')
    train(cfg, out=tmp_path / "ft", progress=False)
    folder = tmp_path / "ft" / "last"
    w = read_weights(folder)
    tuned = {k[len("encoder."):]: v for k, v in w.items() if k.startswith("encoder.")}
    base = create_encoder("efficientnet_lite0", weights="random")
    own = base.state_dict()
    assert tuned and all(k.startswith(("_blocks.15.", "_conv_head")) for k in tuned)
    assert any(not torch.allclose(v, own[k]) for k, v in tuned.items())  # the block was trained
    assert read_config(folder)["encoder"]["finetuned_blocks"] == 1
    cap = Captioner.load(folder)  # the captioner runs the tuned encoder
    enc = cap.encoder.state_dict()
    assert all(torch.equal(enc[k], v) for k, v in tuned.items())
    assert cap.encoder.cache_key() != base.cache_key()
    # the trainer's trunk + tail equals the full tuned encoder
    trunk, tail = cap.encoder.split(1)
    x = torch.randn(2, 3, 224, 224).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(tail(trunk(x), trunk.grid()), cap.encoder(x), rtol=1e-4, atol=1e-4)


def test_hard_attention_can_decode_with_the_most_probable_location():
    m = tiny(attention="hard", decode_context="argmax", gate=False).eval()
    feats = torch.randn(3, 6, 10)
    mem = m.prepare(feats)
    h, _ = m.init_state(mem)
    alpha, z, _, _ = m._attend(h, mem)
    torch.testing.assert_close(z, feats[torch.arange(3), alpha.argmax(1)])
