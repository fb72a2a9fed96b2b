"""The soft-attention decoder's teacher-forced recurrence as one autograd node, for float32
training on the CPU (``models/sat.py`` decides when it applies).

Why: run step by step under autograd, every word adds some 40 nodes to the graph, and their
backward is where a training step spent most of its time at the tutorial's sizes -- the
weight gradients of h_proj and gates_ctx taken word by word as matmuls of inner size B (32)
and summed into .grad one word at a time, zero-filled full-size buffers for every slice of
(B, T, 4H) and (B, A + 1 + 4H), and a dozen small element-wise kernels per word. Here the
forward writes what backward needs into preallocated (T, B, ...) buffers; backward runs the
recurrence in reverse with the LSTM cell, the gate, the softmax and the attention energy
differentiated by hand, keeps every word's gradient of the gates and of h_proj's output, and
takes the weight gradients once for all words: one matmul of inner size T * B per weight.
Per word, what is not a matmul (the energy and softmax, the gate, the LSTM cell, forward and
backward) is one C kernel each (kernels/recurrence.c), not a dozen small operators; with the
feature store's float16 features, the energy, softmax, context and gate are one pass a caption
(``attend_forward``/``attend_backward``, the same arithmetic, 0.4 ms a word less). The
energy's tanh there is a rational approximation, accurate to 3e-7 and 2-3x cheaper than
glibc's tanhf (kernels/attention.c); decoding keeps tanhf. The per-word matmuls of 32 rows are
gemm.c's kernel on weights packed once a call, on AVX2 CPUs (``kernels.RowProducts``).

The math is the step-by-step code's (``SoftAttentionDecoder._unroll`` without a sampled
location): per word t, with hp = h_proj(h_{t-1}) = [q | beta_logit | gates_h],
    alpha = softmax(w . tanh(proj + q)),  zc = sum_l alpha_l a_l,  z = sigmoid(beta_logit) * zc
    gates = gates_x[t] + gates_h + W_ctx z,  (i, f, g, o) -> c, h
tests/test_sat_recurrence.py checks values and gradients against a copy of that code.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .. import kernels as K


class SoftRecurrence(torch.autograd.Function):
    """apply(proj, feats, gates_x, h0, c0, w_h, b_h, att_w, w_ctx, gate, feats_half) -> (hs, zs, alphas)

    proj (B, L, A): W_a a, float32 contiguous; feats (B, L, D); gates_x (B, T, 4H): the
    embedding's share of the gates, bias included; h0, c0 (B, H); w_h (A + 1 + 4H, H) and
    b_h: h_proj; att_w (A,); w_ctx (4H, D): gates_ctx; gate: multiply the context by beta;
    feats_half: feats as float16 (``kernels.half_copy``) for the context's products, or None.
    Returns h_1..h_T (B, T, H), the gated contexts z_1..z_T (B, T, D), alphas (B, T, L).

    Per word, the matmuls run as :class:`kernels.RowProducts` (gemm.c's kernel on the weights
    packed once a call, where it is preferred; else PyTorch's W x^T) and the rest in the C
    kernels of recurrence.c: the energy and softmax (with attention.c's rational tanh), the
    gate, the LSTM cell."""

    @staticmethod
    def forward(ctx, proj, feats, gates_x, h0, c0, w_h, b_h, att_w, w_ctx, gate: bool, feats_half=None):
        B, L, A = proj.shape
        T, H, D = gates_x.shape[1], h0.shape[1], feats.shape[2]
        gx = gates_x.transpose(0, 1).contiguous()  # (T, B, 4H): each word's rows in one block
        hs = torch.empty(T + 1, B, H)  # h_0 .. h_T
        cs = torch.empty(T + 1, B, H)  # c_0 .. c_T
        tanh_c = torch.empty(T, B, H)  # tanh(c_t), reused by backward
        acts = torch.empty(T, B, 4 * H)  # sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)
        hps = torch.empty(T, B, A + 1 + 4 * H)  # h_proj(h_{t-1}) = [q | beta's logit | W_hh h + b]
        alphas = torch.empty(T, B, L)
        zcs = torch.empty(T, B, D)  # ungated contexts
        betas = torch.empty(T, B)
        zs = torch.empty(T, B, D) if gate else zcs  # gated contexts
        gz = torch.empty(B, 4 * H)  # W_ctx z
        hs[0], cs[0] = h0, c0
        h_proj, gates_ctx = K.RowProducts(w_h), K.RowProducts(w_ctx)
        for t in range(T):
            hp = h_proj(hs[t], hps[t], bias=b_h)  # (B, A + 1 + 4H)
            if feats_half is not None:  # the same, a caption at a time, reading half the bytes
                K.attend_forward(proj, hp, att_w, feats_half, gate, alphas[t], zcs[t], betas[t], zs[t])
            else:
                K.attention_softmax(proj, hp[:, :A], att_w, alphas[t])  # (B, L)
                torch.bmm(alphas[t].unsqueeze(1), feats, out=zcs[t].unsqueeze(1))  # (B, 1, D)
                if gate:
                    K.gate_forward(hp[:, A], zcs[t], betas[t], zs[t])
            gates_ctx(zs[t], gz)  # (B, 4H)
            K.lstm_forward(gz, hp[:, A + 1:], gx[t], cs[t], acts[t], cs[t + 1], tanh_c[t], hs[t + 1])
        ctx.gate, ctx.feats_half = gate, feats_half
        ctx.save_for_backward(proj, feats, w_h, att_w, w_ctx, hs, cs, tanh_c, acts, hps, alphas, zcs, betas, zs)
        # (copies: the outputs must not be views of what backward reads)
        return (hs[1:].transpose(0, 1).contiguous(), zs.transpose(0, 1).contiguous(),
                alphas.transpose(0, 1).contiguous())  # (B, T, H), (B, T, D), (B, T, L)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_hs, g_zs, g_alphas):
        proj, feats, w_h, att_w, w_ctx, hs, cs, tanh_c, acts, hps, alphas, zcs, betas, zs = ctx.saved_tensors
        T, B, H = tanh_c.shape
        D = feats.shape[2]
        A = proj.shape[2]
        g_hs = torch.zeros(T, B, H) if g_hs is None else g_hs.transpose(0, 1).contiguous()
        g_zs = torch.zeros(T, B, zs.shape[2]) if g_zs is None else g_zs.transpose(0, 1).contiguous()
        g_alphas = None if g_alphas is None else g_alphas.float().transpose(0, 1).contiguous()
        g_proj = torch.zeros_like(proj)  # the kernel adds every word's share in place
        g_feats = torch.zeros_like(feats) if ctx.needs_input_grad[1] else None
        g_att_w = torch.zeros(A)
        g_hp = torch.empty(T, B, A + 1 + 4 * H)  # every word's gradient of h_proj's output
        g_gates = g_hp[:, :, A + 1:]  # (T, B, 4H): gates_h, gates_x and W_ctx z share it
        dh, dc = torch.zeros(B, H), torch.zeros(B, H)
        dz = torch.empty(B, D)
        if not ctx.gate:
            g_hp[:, :, A] = 0  # beta's logit: no gate, no gradient
        gates_ctx_t, h_proj_t = K.RowProducts(w_ctx, transposed=True), K.RowProducts(w_h, transposed=True)
        for t in reversed(range(T)):
            # h_t's gradient (from h_{t+1}'s words and the loss), c_t's -> the gates', c_{t-1}'s
            K.lstm_backward(dh, g_hs[t], dc, acts[t], tanh_c[t], cs[t], g_gates[t])
            gates_ctx_t(g_gates[t], dz, addend=g_zs[t])  # (B, D)
            g_alpha = None if g_alphas is None else g_alphas[t]
            if ctx.feats_half is not None:  # the gate's, the context's, the softmax's and the energy's
                K.attend_backward(dz, zcs[t], betas[t], ctx.gate, alphas[t], g_alpha, ctx.feats_half, proj,
                                  hps[t], att_w, g_proj, g_hp[t], g_att_w)
            else:
                if ctx.gate:  # -> beta's logit's gradient; dz becomes the ungated context's
                    K.gate_backward(dz, zcs[t], betas[t], g_hp[t, :, A])
                if g_feats is not None:
                    g_feats.baddbmm_(alphas[t].unsqueeze(2), dz.unsqueeze(1))  # (B, L, 1) x (B, 1, D)
                # (as a row times feats^T: the (B, L, D) x (B, D, 1) form runs a far slower kernel)
                d_alpha = torch.bmm(dz.unsqueeze(1), feats.transpose(1, 2)).squeeze(1)  # (B, L)
                K.attention_softmax_backward(d_alpha, g_alpha, alphas[t], proj, hps[t, :, :A], att_w, g_proj,
                                             g_hp[t, :, :A], g_att_w)
            h_proj_t(g_hp[t], dh)  # -> h_{t-1}'s gradient, (B, H)
        # the weight gradients once for all words: inner size T * B
        flat = g_hp.view(T * B, -1)  # (T B, A + 1 + 4H)
        g_w_h = flat.t() @ hs[:T].reshape(T * B, H)
        g_b_h = flat.sum(0)
        g_w_ctx = g_gates.reshape(T * B, 4 * H).t() @ zs.view(T * B, -1)
        return (g_proj, g_feats, g_gates.transpose(0, 1), dh, dc, g_w_h, g_b_h, g_att_w, g_w_ctx, None, None)
