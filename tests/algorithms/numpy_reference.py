"""An independent float64 NumPy implementation of the docs/design.md §4 objective, for parity tests.

Written straight from the formulas with explicit loops (groups, rows, tokens) and an analytic
gradient with respect to logp; it shares no code with rlax_tasks.algorithms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Reference:
    loss: float
    grad: np.ndarray  # d loss / d logp, [B, T]
    adv: np.ndarray  # token advantages [B, T]
    clipped_tokens: int  # completion tokens whose PPO/GSPO mask is 0
    dual_clipped_tokens: int  # completion tokens with A < 0 and r > clip_ratio_c
    truncated_tokens: int  # completion tokens whose TIS weight hit the cap
    masked_tokens: int  # completion tokens whose MIS ratio left [1/C, C] (weight 0)
    completion_tokens: int


def _std1(x: list[float]) -> float:
    if len(x) < 2:
        return 0.0
    mean = sum(x) / len(x)
    return math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))


def sequence_advantages(cfg, rewards, group_ids, valid) -> np.ndarray:
    b = len(rewards)
    adv = np.zeros(b)
    rows = [i for i in range(b) if valid[i]]
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(int(group_ids[i]), []).append(i)
    if cfg.adv in ("batch_norm", "group_batch_norm"):
        if cfg.adv == "batch_norm":
            x = {i: rewards[i] for i in rows}
        else:
            x = {}
            for members in groups.values():
                mean = sum(rewards[j] for j in members) / len(members)
                for i in members:
                    x[i] = rewards[i] - mean
        mean = sum(x.values()) / len(rows)
        std = _std1(list(x.values()))
        for i in rows:
            adv[i] = (x[i] - mean) / (std + cfg.adv_eps)
        return adv
    for members in groups.values():
        rs = [rewards[j] for j in members]
        mean = sum(rs) / len(rs)
        for i in members:
            if cfg.adv == "grpo":
                adv[i] = (rewards[i] - mean) / (_std1(rs) + cfg.adv_eps)
            elif cfg.adv == "dr_grpo":
                adv[i] = rewards[i] - mean
            elif cfg.adv == "rloo":
                others = [rewards[j] for j in members if j != i]
                adv[i] = rewards[i] - sum(others) / len(others) if others else 0.0
            else:
                raise AssertionError(cfg.adv)
    return adv


def gae_reference(rewards, values, mask, gamma, lam) -> tuple[np.ndarray, np.ndarray]:
    """GAE over each row's completion tokens in order; R on the last one; terminal after it."""
    b, t = mask.shape
    adv, ret = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        pos = [j for j in range(t) if mask[i, j] > 0]
        next_v = next_a = 0.0
        for k in reversed(range(len(pos))):
            j = pos[k]
            r = rewards[i] if k == len(pos) - 1 else 0.0
            delta = r + gamma * next_v - values[i, j]
            a = delta + gamma * lam * next_a
            adv[i, j], ret[i, j] = a, a + values[i, j]
            next_v, next_a = values[i, j], a
    return adv, ret


def token_advantages(cfg, batch) -> np.ndarray:
    mask = np.asarray(batch["mask"], np.float64)
    valid = mask.sum(1) > 0
    rewards = np.asarray(batch["rewards"], np.float64)
    if cfg.adv == "gae":
        adv, _ = gae_reference(
            rewards, np.asarray(batch["values"], np.float64), mask, cfg.gamma, cfg.gae_lambda
        )
        if cfg.whiten_advantages:
            vals = adv[mask > 0]
            mean, std = vals.mean(), _std1(list(vals))
            adv = np.where(mask > 0, (adv - mean) / (std + cfg.adv_eps), 0.0)
        return adv
    seq = sequence_advantages(cfg, rewards, np.asarray(batch["group_ids"]), valid)
    return seq[:, None] * mask


def objective(cfg, logp, batch, sg_logp=None) -> Reference:
    """loss = −Σ_b Σ_t m·Agg·IS·(Adv·GradTerm1 + GradTerm2) and its gradient w.r.t. logp.

    Where a PPO/GSPO mask (or the dual clip) zeroes GradTerm1's gradient, its value is the
    clipped surrogate's: clip(r) (or clip_ratio_c), held fixed. Stop-gradient quantities
    (CISPO's clipped ratio, masks, those constants) are computed from ``sg_logp`` (default:
    ``logp``), so finite differences in ``logp`` with ``sg_logp`` held fixed measure exactly the
    stop-gradient derivative.
    """
    logp = np.asarray(logp, np.float64)
    sg_logp = logp if sg_logp is None else np.asarray(sg_logp, np.float64)
    old = np.asarray(batch["old_logprobs"], np.float64)
    mask = (np.asarray(batch["mask"]) > 0).astype(np.float64)
    b, t = logp.shape
    lengths = mask.sum(1)
    n_seq = int((lengths > 0).sum())
    n_tok = lengths.sum()
    adv = token_advantages(cfg, batch)
    eps_lo, eps_hi = cfg.eps_low, cfg.eps_high

    loss, grad = 0.0, np.zeros((b, t))
    clipped = truncated = dual = masked = 0
    cap = cfg.behavior_is_cap
    dual_c = getattr(cfg, "clip_ratio_c", None)
    for i in range(b):
        if lengths[i] == 0:
            continue
        pos = [j for j in range(t) if mask[i, j] > 0]
        # sequence quantities
        seq_log_ratio_beh = 0.0
        if cfg.behavior_is in ("sequence", "sequence_mis"):
            seq_log_ratio_beh = sum(old[i, j] - batch["behavior_logprobs"][i, j] for j in pos)
        s = math.exp(sum(logp[i, j] - old[i, j] for j in pos) / len(pos))
        s_sg = math.exp(sum(sg_logp[i, j] - old[i, j] for j in pos) / len(pos))
        seq_adv = sum(adv[i, j] for j in pos) / len(pos)
        seq_keep = 1.0
        if (seq_adv > 0 and s_sg > 1 + eps_hi) or (seq_adv < 0 and s_sg < 1 - eps_lo):
            seq_keep = 0.0
        gspo_coef_sum = 0.0
        for j in pos:
            if cfg.agg == "individual":
                w = 1.0 / (n_seq * lengths[i])
            elif cfg.agg == "group":
                w = 1.0 / n_tok
            elif cfg.agg == "max_length":
                w = 1.0 / (n_seq * (cfg.max_length or t))
            else:
                w = 1.0 / n_seq
            r = math.exp(logp[i, j] - old[i, j])
            r_sg = math.exp(sg_logp[i, j] - old[i, j])
            is_w = 1.0
            if cfg.ratio_is == "clip":
                is_w *= min(max(r_sg, 1 - eps_lo), 1 + eps_hi)
            if cfg.behavior_is == "token":
                lr = old[i, j] - batch["behavior_logprobs"][i, j]
                truncated += lr > math.log(cfg.behavior_is_cap)
                is_w *= min(math.exp(lr), cfg.behavior_is_cap)
            elif cfg.behavior_is == "sequence":
                truncated += seq_log_ratio_beh > math.log(cfg.behavior_is_cap)
                is_w *= min(math.exp(seq_log_ratio_beh), cfg.behavior_is_cap)
            elif cfg.behavior_is in ("token_mis", "sequence_mis"):
                if cfg.behavior_is == "token_mis":
                    ratio = math.exp(old[i, j] - batch["behavior_logprobs"][i, j])
                else:
                    ratio = math.exp(seq_log_ratio_beh)
                keep = 1.0 / cap <= ratio <= cap
                masked += not keep
                is_w *= ratio if keep else 0.0
            c = w * is_w
            a = adv[i, j]
            # GradTerm1 and d/dlogp (GSPO's is collected per row below)
            if cfg.policy_term == "ppo_clip":
                out = (a > 0 and r_sg > 1 + eps_hi) or (a < 0 and r_sg < 1 - eps_lo)
                clipped += out
                if dual_c is not None and a < 0 and r_sg > dual_c:
                    dual += 1
                    term1, dterm1 = dual_c, 0.0
                elif out:
                    term1, dterm1 = min(max(r_sg, 1 - eps_lo), 1 + eps_hi), 0.0
                else:
                    term1, dterm1 = r, r
            elif cfg.policy_term == "logp":
                term1, dterm1 = logp[i, j], 1.0
            else:
                clipped += seq_keep == 0.0
                term1 = s if seq_keep else min(max(s_sg, 1 - eps_lo), 1 + eps_hi)
                dterm1 = 0.0
                gspo_coef_sum += c * a
            # GradTerm2
            term2 = dterm2 = 0.0
            if cfg.kl != "none" and cfg.kl_beta > 0:
                d = batch["ref_logprobs"][i, j] - logp[i, j]
                if cfg.kl == "k3":
                    term2 = -cfg.kl_beta * (math.exp(d) - d - 1)
                    dterm2 = -cfg.kl_beta * (-math.exp(d) + 1)
                else:
                    term2 = -cfg.kl_beta * 0.5 * d * d
                    dterm2 = -cfg.kl_beta * (-d)
            loss -= c * (a * term1 + term2)
            grad[i, j] -= c * (a * dterm1 + dterm2)
        if cfg.policy_term == "gspo":
            for j in pos:  # d s / d logp_ij = s / |o_i|
                grad[i, j] -= gspo_coef_sum * seq_keep * s / len(pos)
    return Reference(
        loss, grad, adv, int(clipped), int(dual), int(truncated), int(masked), int(n_tok)
    )


def value_loss(cfg, values, batch) -> tuple[float, np.ndarray]:
    """Clipped value loss (Agg-weighted) and its gradient w.r.t. the new values."""
    mask = (np.asarray(batch["mask"]) > 0).astype(np.float64)
    old_v = np.asarray(batch["values"], np.float64)
    _, ret = gae_reference(
        np.asarray(batch["rewards"], np.float64), old_v, mask, cfg.gamma, cfg.gae_lambda
    )
    b, t = mask.shape
    lengths = mask.sum(1)
    n_seq, n_tok = int((lengths > 0).sum()), lengths.sum()
    loss, grad = 0.0, np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if mask[i, j] == 0:
                continue
            w = {
                "individual": 1.0 / (n_seq * lengths[i]),
                "group": 1.0 / n_tok,
                "max_length": 1.0 / (n_seq * (cfg.max_length or t)),
                "sequence": 1.0 / n_seq,
            }[cfg.agg]
            v, g = values[i, j], ret[i, j]
            lu, du = 0.5 * (v - g) ** 2, v - g
            if cfg.value_clip is None:
                lc, dc = -math.inf, 0.0
            else:
                delta = v - old_v[i, j]
                inside = abs(delta) <= cfg.value_clip
                vc = old_v[i, j] + max(-cfg.value_clip, min(cfg.value_clip, delta))
                lc, dc = 0.5 * (vc - g) ** 2, (vc - g) * (1.0 if inside else 0.0)
            if lu >= lc:
                loss += w * lu
                grad[i, j] += w * du
            else:
                loss += w * lc
                grad[i, j] += w * dc
    return loss, grad
