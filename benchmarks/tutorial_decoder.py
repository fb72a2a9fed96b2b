"""A speed baseline written to behave like the popular sgrvinod "Show, Attend and Tell" tutorial
decoder (our own code, same algorithm and sizes): LSTMCell, additive attention with ReLU, a
vector gate, and -- the costly part -- the encoder's attention projection recomputed for every
word over the still-running captions of a length-sorted batch. Used only by speed.py."""

from __future__ import annotations

import torch
from torch import nn


class TutorialDecoder(nn.Module):
    def __init__(self, vocab_size: int, feat_dim: int = 1280, dim: int = 512, dropout: float = 0.5):
        super().__init__()
        self.encoder_att = nn.Linear(feat_dim, dim)
        self.decoder_att = nn.Linear(dim, dim)
        self.full_att = nn.Linear(dim, 1)
        self.embedding = nn.Embedding(vocab_size, dim)
        self.lstm = nn.LSTMCell(dim + feat_dim, dim)
        self.init_h = nn.Linear(feat_dim, dim)
        self.init_c = nn.Linear(feat_dim, dim)
        self.f_beta = nn.Linear(dim, feat_dim)
        self.fc = nn.Linear(dim, vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, feats: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor):
        """feats (B, L, D); captions (B, T+1) starting with <start>; lengths (B,) words + 1."""
        lengths, order = lengths.sort(descending=True)
        feats, captions = feats[order], captions[order]
        B, L, _ = feats.shape
        T = int(lengths.max())
        mean = feats.mean(1)
        h, c = self.init_h(mean), self.init_c(mean)
        emb = self.embedding(captions)
        scores = torch.zeros(B, T, self.fc.out_features)
        alphas = torch.zeros(B, T, L)
        for t in range(T):
            bt = int((lengths > t).sum())
            att1 = self.encoder_att(feats[:bt])  # recomputed at every word: (bt, L, A)
            att2 = self.decoder_att(h[:bt])
            e = self.full_att(torch.relu(att1 + att2.unsqueeze(1))).squeeze(2)
            alpha = torch.softmax(e, dim=1)
            ctx = (feats[:bt] * alpha.unsqueeze(2)).sum(1)
            ctx = torch.sigmoid(self.f_beta(h[:bt])) * ctx
            h, c = self.lstm(torch.cat([emb[:bt, t], ctx], 1), (h[:bt], c[:bt]))
            scores[:bt, t] = self.fc(self.dropout(h))
            alphas[:bt, t] = alpha
        return scores, alphas
