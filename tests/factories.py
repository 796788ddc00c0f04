"""Realistic, valid messages built from a seed, for tests of every role.

Every factory is deterministic in its arguments and returns a message whose
`validate()` passes. Token layout follows `opsd.types`:
prompt + response(0) + observation(0) + response(1) + ... + response(K-1);
sampled tokens have loss mask 1 and a negative log-prob, all others mask 0
and log-prob 0. Observations carry multi-byte text (emoji) on purpose.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from opsd.credit.batch import pair_blocks
from opsd.types import CreditBatch, RolloutGroup, ScoredGroup, TaskGroup, Trajectory, TurnRecord

VOCAB_SIZE = 49_152  # SmolLM2's vocabulary
ACTIONS = ("go north", "open door", "take coin", "look", "go east")


def make_task(group_size: int = 4, seed: int = 0, max_turns: int = 4, step: int = 0, policy_version: int = 0) -> TaskGroup:
    """A TextWorld TaskGroup to be played `group_size` times; ids derive from `seed`."""
    return TaskGroup(
        group_id=f"g{seed:04d}-s{step}",
        task_id=f"tw-{seed:04d}",
        step=step,
        policy_version=policy_version,
        group_size=group_size,
        env="textworld",
        game={"seed": 1234 + seed, "world_size": 1, "nb_objects": 3, "quest_length": 1, "goal": "take the coin 🪙"},
        privileged_info="Walkthrough: open door > go north > take coin",
        max_turns=max_turns,
    )


def make_trajectory(rollout_id: str, turns: int, rng: np.random.Generator, reward: float) -> Trajectory:
    """One episode of `turns` turns with consistent spans, mask and log-probs (lengths drawn from `rng`)."""
    ids: list[np.ndarray] = [rng.integers(0, VOCAB_SIZE, rng.integers(8, 17))]  # prompt of turn 0
    mask: list[np.ndarray] = [np.zeros(len(ids[0]), np.uint8)]
    records = []
    pos = len(ids[0])
    for k in range(turns):
        n_resp = int(rng.integers(3, 9))
        ids.append(rng.integers(0, VOCAB_SIZE, n_resp))
        mask.append(np.ones(n_resp, np.uint8))
        action = ACTIONS[int(rng.integers(len(ACTIONS)))]
        valid = bool(rng.random() < 0.8)
        last = k == turns - 1
        records.append(
            TurnRecord(
                turn_id=k,
                response_start=pos,
                response_end=pos + n_resp,
                text=f"<action>{action}</action>" if valid else f"I will {action}",
                thinking="",
                action=action if valid else "",
                format_valid=valid,
                finish_reason="length" if (last and rng.random() < 0.3) else "stop",
                observation="" if last else f"You see a door 🚪 and a coin 🪙 (turn {k}).",
            )
        )
        pos += n_resp
        if not last:  # separator + observation tokens: prompt of the next turn, never trained on
            n_obs = int(rng.integers(2, 7))
            ids.append(rng.integers(0, VOCAB_SIZE, n_obs))
            mask.append(np.zeros(n_obs, np.uint8))
            pos += n_obs
    token_ids = np.concatenate(ids).astype(np.int32)
    loss_mask = np.concatenate(mask)
    logprobs = np.where(loss_mask == 1, -rng.exponential(1.5, len(token_ids)), 0.0).astype(np.float32)
    won = reward > 0.5
    # Deterministic (no rng draw, so every other factory value stays as it was): nats, 0 off the mask.
    entropy = np.where(loss_mask == 1, 0.25 - 0.5 * logprobs, 0.0).astype(np.float32)
    return Trajectory(
        rollout_id=rollout_id,
        token_ids_S=token_ids,
        sampler_logprobs_S=logprobs,
        loss_mask_S=loss_mask,
        turns=records,
        reward=float(reward),
        won=won,
        ending="won" if won else "max_turns",
        sampler_entropy_S=entropy,
        opening="-= Kitchen =-\nYou see a door 🚪 and a coin 🪙. Your task is to take the coin.\n\nAdmissible commands:\n"
                + "\n".join(ACTIONS),
    )


def make_rollout_group(G: int = 4, turns: int = 3, seed: int = 0, rewards: list[float] | None = None) -> RolloutGroup:
    """G sibling trajectories of `make_task(G, seed)`, each with `turns` turns.

    rewards: G terminal rewards (default: random 0/1 from `seed`); a reward
    > 0.5 counts as won.
    """
    rng = np.random.default_rng(seed)
    task = make_task(group_size=G, seed=seed, max_turns=max(turns, 1))
    if rewards is None:
        rewards = [float(r) for r in rng.integers(0, 2, G)]
    if len(rewards) != G:
        raise ValueError(f"rewards has {len(rewards)} values, expected G={G}")
    trajectories = [make_trajectory(f"{task.group_id}-r{i}", turns, rng, rewards[i]) for i in range(G)]
    return RolloutGroup(task=task, trajectories=trajectories, prompt_format="action", rollout_seconds=1.5)


def make_scored_group(G: int = 4, turns: int = 3, seed: int = 0) -> ScoredGroup:
    """`make_rollout_group(G, turns, seed)` plus a plausible teacher view.

    M = G * turns turns; similarity_MM is cosine-like in [-1, 1], eligible_MM
    excludes a turn's own rollout, each target keeps its top-2 eligible
    sources above 0.3 with softmax weights, alpha_M in [0, 0.8].
    """
    rollout = make_rollout_group(G, turns, seed)
    rng = np.random.default_rng(seed + 10_000)
    teacher, corrected = [], []
    for t in rollout.trajectories:
        on = t.loss_mask_S == 1
        noisy = t.sampler_logprobs_S + rng.normal(0, 0.3, on.shape).astype(np.float32)
        teacher.append(np.where(on, noisy, 0).clip(max=0).astype(np.float32))
        corrected.append(np.where(on, teacher[-1] * 0.9, 0).astype(np.float32))
    owner = np.array([i for i, k in rollout.canonical_turns()])
    M = len(owner)
    emb = rng.normal(size=(M, 8))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    similarity = (emb @ emb.T).astype(np.float32)
    eligible = owner[:, None] != owner[None, :]
    sources, weights = [], []
    for target in range(M):
        cand = [s for s in np.argsort(-similarity[:, target]) if eligible[s, target] and similarity[s, target] > 0.3][:2]
        w = np.exp(similarity[cand, target] / 0.1)
        sources.append([int(s) for s in cand])
        weights.append([float(x) for x in w / w.sum()] if cand else [])
    rho = np.array([max(w) if w else 0.0 for w in weights], np.float32)
    return ScoredGroup(
        rollout=rollout,
        teacher_version=0,
        teacher_logprobs_S=teacher,
        corrected_logprobs_S=corrected,
        teacher_thinking_M=[f"The coin 🪙 is north (turn {m})." for m in range(M)],
        similarity_MM=similarity,
        eligible_MM=eligible,
        selected_sources_M=sources,
        source_weights_M=weights,
        rho_M=rho,
        alpha_M=(0.8 * rho).astype(np.float32),
        identity_fallback=False,
        teacher_seconds=2.25,
        teacher_forward_tokens=int(sum(t.token_ids_S.shape[0] for t in rollout.trajectories)) + 7,
        teacher_entropy_S=[np.where(t.loss_mask_S == 1, 0.1 - 0.4 * lp, 0).astype(np.float32) for t, lp in zip(rollout.trajectories, teacher)],
    )


def tiny_llama(num_hidden_layers: int = 2, seed: int = 0, vocab_size: int = 64):
    """A randomly initialized Llama causal LM (hidden 32; vocab 64, or VOCAB_SIZE for factory trajectories)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def ppo_sequences(adv: float = 1.0, mask_on: bool = True):
    """Three trainer Sequences (lengths 10, 14, 7; vocab 64) whose second halves are loss
    tokens with advantage `adv` (no loss tokens when `mask_on` is False)."""
    from services.trainer.update import Sequence

    rng = np.random.default_rng(0)
    out = []
    for n in (10, 14, 7):
        ids = rng.integers(0, 64, n).astype(np.int32)
        mask = np.zeros(n, np.uint8)
        if mask_on:
            mask[n // 2:] = 1
        out.append(Sequence(ids, mask, np.where(mask == 1, adv, 0).astype(np.float32), np.zeros(n, np.float32)))
    return out


def shared_dir() -> Path:
    """The project's shared folder (spec, refvectors): $OPSD_SHARED, else ../shared beside the repo
    (CI clones the repo into another folder with shared/ beside it)."""
    env = os.environ.get("OPSD_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


def random_credit_batch(
    seed: int, tasks: int = 3, rollouts: int = 3, max_turns: int = 3, L: int = 7, edge_cases: bool = True
) -> CreditBatch:
    """A valid random CreditBatch with every field any estimator reads (rows canonical).

    With `edge_cases`: task t0 has one trajectory, and the last trajectory has
    `max_turns` (>= 2) turns, the last without loss tokens and the one before
    with a different reward (rows that disagree). Log-probs and entropies off
    the mask are random (padding may hold anything).
    """
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(tasks):
        n_roll = 1 if edge_cases and t == 0 else rollouts
        for r in range(n_roll):
            reward = float(rng.integers(0, 2))
            last = t == tasks - 1 and r == n_roll - 1
            n_turns = max_turns if edge_cases and last else int(rng.integers(1, max_turns + 1))
            for k in range(n_turns):
                rows.append((f"t{t}", f"r{r}", k, reward))
    M = len(rows)
    lengths = rng.integers(1, L + 1, M)
    mask = (np.arange(L)[None] < lengths[:, None]).astype(np.float32)
    reward = np.asarray([r[3] for r in rows], np.float32)
    if edge_cases:
        mask[M - 1] = 0.0
        reward[M - 2] += 0.5
    student = (-rng.exponential(1.0, (M, L))).astype(np.float32)
    teacher = np.minimum(student + rng.normal(0, 1.0, (M, L)), 0).astype(np.float32)
    valid = rng.random(M) > 0.2
    base = np.minimum(student + rng.normal(0, 0.3, (M, L)), 0).astype(np.float32)
    t_ent = rng.uniform(0, 3, (M, L)).astype(np.float32)
    s_ent = rng.uniform(0, 3, (M, L)).astype(np.float32)
    task = np.asarray([r[0] for r in rows])
    roll = np.asarray([r[1] for r in rows])
    return CreditBatch(
        task_id=list(task), rollout_id=list(roll), turn_id=[r[2] for r in rows],
        data_source=["textworld"] * M, episode_reward=reward, is_action_valid=valid,
        loss_mask_ML=mask, student_logprobs_ML=student, teacher_logprobs_ML=teacher,
        corrected_logprobs_ML=np.minimum(teacher + rng.normal(0, 0.1, (M, L)), 0).astype(np.float32),
        similarity_blocks=pair_blocks(
            np.where(task[:, None] == task[None], rng.uniform(0.5, 1.0, (M, M)), 0).astype(np.float32), list(task)),
        eligible_blocks=pair_blocks((task[:, None] == task[None]) & (roll[:, None] != roll[None]), list(task)),
        base_logprobs_ML=base, teacher_entropy_ML=t_ent, student_entropy_ML=s_ent,
    )
