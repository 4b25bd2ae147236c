"""Does projecting per capture change what the draft proposes? A tiny Eagle3-style draft,
trained on a small random target's own greedy continuations (CPU, minutes), evaluated on
held-out prompts with its input projected both ways.

    PYTHONPATH=. python benchmarks/draft_acceptance.py --out docs/results/draft_acceptance_cpu.json

Target: a random causal LM (vocab 512, hidden 256, 8 layers of RMSNorm + causal attention +
MLP, residual stream), capturing ``hidden + residual`` at Eagle3's layers (2, L//2, L-3).
Draft (Eagle3's shape, smaller): ``fc`` over the K=3 captures (``--combines``: ``plain``,
``norm_before_fc``, ``fc_norms``) -> with the embedding of the next token, one MLP block -> the target's
``lm_head``; trained with teacher forcing to predict the target's next greedy token. At
evaluation each draft runs ``--gamma`` steps from each position (later steps read the draft's
own features, as Eagle does), fp32 and bf16, its first input computed

- ``cat``: as the engines do, ``fc(cat(captures))`` (the draft's own code);
- ``per_capture``: by ``compile_pass.ProjectingAccumulator`` (each capture projected as made).

Reported per dtype: the draft's greedy proposals agreeing between the two (first token, and
every token of the gamma-token proposal), the mean accepted length against the target's
greedy tokens for each, the max abs and relative difference of the draft inputs, and the same
relative difference and first-token agreement with the accumulator kept in fp32
(``accumulate_dtype=torch.float32``) instead of the captures' dtype (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compile_pass.projection import ProjectingAccumulator, rms_norm  # noqa: E402

V, H, LAYERS, HEADS = 512, 256, 8, 4
CAPTURE = (2, LAYERS // 2, LAYERS - 3)


class TargetLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.qkv = nn.ModuleList(nn.Linear(H, 3 * H, bias=False) for _ in range(LAYERS))
        self.o = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(LAYERS))
        self.up = nn.ModuleList(nn.Linear(H, 2 * H, bias=False) for _ in range(LAYERS))
        self.down = nn.ModuleList(nn.Linear(2 * H, H, bias=False) for _ in range(LAYERS))
        self.norms = nn.Parameter(torch.ones(2 * LAYERS + 1, H))
        self.lm_head = nn.Linear(H, V, bias=False)
        for p in self.parameters():
            if p.dim() == 2 and p is not self.norms:
                nn.init.normal_(p, std=0.08)

    def forward(self, ids: torch.Tensor):
        """(logits [B, T, V], the K captures [B, T, H] each)."""
        hidden, residual = self.embed(ids), None
        aux = []
        b, t, _ = hidden.shape
        for i in range(LAYERS):
            if i in CAPTURE:
                aux.append(hidden if residual is None else hidden + residual)
            residual = hidden if residual is None else hidden + residual
            x = rms_norm(residual, self.norms[2 * i], 1e-6)
            q, k, v = self.qkv[i](x).view(b, t, 3, HEADS, H // HEADS).unbind(2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            residual = residual + self.o[i](att.transpose(1, 2).reshape(b, t, H))
            x = rms_norm(residual, self.norms[2 * i + 1], 1e-6)
            hidden = self.down[i](F.silu(self.up[i](x)))
        out = rms_norm(hidden + residual, self.norms[-1], 1e-6)
        return self.lm_head(out), aux


class Draft(nn.Module):
    """Eagle3's shape: fc over the captures, with the next token's embedding one block,
    then the target's lm_head; later steps read the draft's own features."""

    def __init__(self, combine: str) -> None:
        super().__init__()
        k = len(CAPTURE)
        self.fc = nn.Linear(k * H, H, bias=combine == "plain")
        self.norm_before_fc = nn.Parameter(torch.ones(k * H)) if combine == "norm_before_fc" else None
        self.fc_norms = nn.ParameterList(nn.Parameter(torch.ones(H)) for _ in range(k)) \
            if combine == "fc_norms" else None
        self.inp = nn.Linear(2 * H, H, bias=False)
        self.up = nn.Linear(H, 2 * H, bias=False)
        self.down = nn.Linear(2 * H, H, bias=False)
        self.norm = nn.Parameter(torch.ones(H))

    def project_cat(self, aux):
        x = torch.cat(aux, -1)
        if self.norm_before_fc is not None:
            x = rms_norm(x, self.norm_before_fc, 1e-6)
        elif self.fc_norms is not None:
            x = torch.cat([rms_norm(c, w, 1e-6) for c, w in zip(x.split(H, -1), self.fc_norms)], -1)
        return self.fc(x)

    def project_per_capture(self, aux, accumulate_dtype=None):
        acc = ProjectingAccumulator(len(aux), self.fc.weight.detach(), fc_bias=self.fc.bias,
                                    norm_before_fc=self.norm_before_fc,
                                    fc_norms=list(self.fc_norms) if self.fc_norms is not None else None,
                                    eps=1e-6, accumulate_dtype=accumulate_dtype)
        for a in aux:
            acc.append(a)
        return acc.finalize()

    def step(self, feature, token_embedding):
        x = self.inp(torch.cat([feature, token_embedding], -1))
        x = x + self.down(F.silu(self.up(rms_norm(x, self.norm, 1e-6))))
        return x  # the draft's feature; logits via the target's lm_head


@torch.no_grad()
def greedy_continuations(target: TargetLM, n: int, prompt: int, total: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, prompt), generator=g)
    while ids.shape[1] < total:
        logits, _ = target(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def train(target: TargetLM, draft: Draft, data: torch.Tensor, steps: int, seed: int) -> float:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    with torch.no_grad():
        _, aux = target(data)
    loss = torch.tensor(0.0)
    for step in range(steps):
        idx = torch.randint(0, data.shape[0], (32,))
        feats = draft.project_cat([a[idx, :-1] for a in aux])
        x = draft.step(feats, target.embed(data[idx, 1:]).detach())
        logits = target.lm_head(rms_norm(x, draft.norm, 1e-6))[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, V), data[idx, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


@torch.no_grad()
def propose(target: TargetLM, draft: Draft, feature: torch.Tensor, ids: torch.Tensor, gamma: int) -> torch.Tensor:
    """``gamma`` greedy draft tokens from every position (feature of position t, token t+1)."""
    tokens = []
    token = ids[:, 1:]
    for _ in range(gamma):
        feature = draft.step(feature, target.embed(token))
        token = target.lm_head(rms_norm(feature, draft.norm, 1e-6)).argmax(-1)
        tokens.append(token)
    return torch.stack(tokens, -1)  # [B, T-1, gamma]: proposals for positions t+2 ..


def accepted_length(proposals: torch.Tensor, truth: torch.Tensor, gamma: int) -> float:
    """Mean number of leading proposed tokens equal to the target's greedy tokens."""
    t = truth.shape[1]
    n = t - 1 - gamma
    want = torch.stack([truth[:, 2 + j: 2 + j + n] for j in range(gamma)], -1)
    ok = (proposals[:, :n] == want).int()
    return float(ok.cumprod(-1).sum(-1).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--combines", default="plain,norm_before_fc,fc_norms")
    ap.add_argument("--train-sequences", type=int, default=256)
    ap.add_argument("--eval-sequences", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    started = time.time()
    torch.manual_seed(0)
    target = TargetLM().eval()
    data = greedy_continuations(target, args.train_sequences, 8, args.tokens, seed=1)
    held_out = greedy_continuations(target, args.eval_sequences, 8, args.tokens, seed=2)
    rows = []
    for combine in args.combines.split(","):
        draft = Draft(combine)
        loss = train(target, draft, data, args.steps, seed=3)
        for dtype in (torch.float32, torch.bfloat16):
            t, d = TargetLM().eval(), Draft(combine)
            t.load_state_dict(target.state_dict())
            d.load_state_dict(draft.state_dict())
            t.to(dtype), d.to(dtype)
            with torch.no_grad():
                _, aux = t(held_out)
                aux = [a[:, :-1] for a in aux]
                f_cat = d.project_cat(aux)
                f_per = d.project_per_capture(aux)
                f_fp32 = d.project_per_capture(aux, accumulate_dtype=torch.float32)  # the other default
            p_cat = propose(t, d, f_cat, held_out, args.gamma)
            p_per = propose(t, d, f_per, held_out, args.gamma)
            p_fp32 = propose(t, d, f_fp32, held_out, args.gamma)
            scale = float(f_cat.float().abs().max())
            row = {"combine": combine, "dtype": str(dtype).replace("torch.", ""), "train_loss": round(loss, 3),
                   "draft_input_max_abs_diff": float((f_per.float() - f_cat.float()).abs().max()),
                   "draft_input_max_rel_diff": float((f_per.float() - f_cat.float()).abs().max()) / scale,
                   "fp32_accumulate_max_rel_diff": float((f_fp32.float() - f_cat.float()).abs().max()) / scale,
                   "fp32_accumulate_first_token_agreement": float((p_cat[..., 0] == p_fp32[..., 0]).float().mean()),
                   "first_token_agreement": float((p_cat[..., 0] == p_per[..., 0]).float().mean()),
                   "all_tokens_agreement": float((p_cat == p_per).all(-1).float().mean()),
                   "accepted_length_cat": round(accepted_length(p_cat, held_out, args.gamma), 4),
                   "accepted_length_per_capture": round(accepted_length(p_per, held_out, args.gamma), 4),
                   "positions": int(p_cat[..., 0].numel())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "argv": sys.argv[1:], "gamma": args.gamma,
                       "seconds": round(time.time() - started, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
