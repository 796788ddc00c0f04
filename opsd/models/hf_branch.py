"""The steps of `HFBackend.branch`: one cached forward over a base sequence, then what each cut needs from it.

`opsd.models.hf.HFBackend.branch` (its docstring holds the contract) checks
the arguments, runs these steps in order and raises for non-finite results:

1. `scored_offsets`: which ids of ``base[start:]`` are scored (score_mask);
2. `score_base`: one forward over the base, keeping its KV cache, the
   log-probs (and entropies) of the scored ids and each cut's next-token logits;
3. `generate_at_cuts`: a sampled response after each cut that fits, batched
   on copies of the cached prefix;
4. `force_continuations`: the teacher-forced log-probs of each cut's continuations.

Every function takes the HFBackend as `backend` (its model, device, ids and
`_decode`); none changes the base cache: a batch runs on its own copy of the
prefix it needs (`_prefix_cache`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from opsd.credit.policy_loss import entropy_from_logits, token_logprobs


def check_branch_options(generate_tokens: int, temperature: float, top_p: float, score_temperature: float) -> None:
    """The sampling and scoring parameters of `branch`; raises ValueError for a bad one."""
    if generate_tokens < 0:
        raise ValueError(f"generate_tokens must be >= 0, got {generate_tokens}")
    if generate_tokens > 0:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is not supported), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not score_temperature > 0:
        raise ValueError(f"score_temperature must be > 0, got {score_temperature}")


def scored_offsets(score_mask: Sequence[bool] | np.ndarray | None, n: int) -> np.ndarray:
    """The offsets in ``base[start:]`` (`n` ids) that `branch` scores: all of them, or where `score_mask` is True.

    Raises ValueError for a mask that is not of shape (n,)."""
    if score_mask is None:
        return np.arange(n)
    score_mask = np.asarray(score_mask, dtype=bool)
    if score_mask.shape != (n,):
        raise ValueError(f"branch: score_mask of shape {score_mask.shape} for {n} scored ids")
    return np.flatnonzero(score_mask)


def score_base(backend, base: list[int], start: int, cuts: list[int], scored: np.ndarray, score_temperature: float,
               return_entropy: bool):
    """The forward over `base` and what is read from it: (cache, base_lp, base_ent, cut_logits).

    base_lp: float32 [len(base) - start], the log-prob of each scored id (0.0
    elsewhere); base_ent: the same for the entropy with `return_entropy`, else
    None; cut_logits: float32 [len(cuts), V], the raw logits predicting each
    cut's next id (None without cuts); cache: the base's KV cache (only
    ``base[:max(cuts)]`` when start == len(base)). Needs at least one cut or
    scored id. Raises NotImplementedError for a sliding-window cache.
    """
    n = len(base) - start
    base_lp = np.zeros(n, dtype=np.float32)
    base_ent = np.zeros(n, dtype=np.float32) if return_entropy else None
    # LM-head rows needed: predictions of the scored ids of base[start:] and of each cut's next token.
    keep_rows = sorted({c - 1 for c in cuts} | set((start - 1 + scored).tolist()))
    where = {r: k for k, r in enumerate(keep_rows)}
    cache, logits = _forward_base(backend, base[: len(base) if n else max(cuts)], keep_rows)
    if len(scored):
        rows = [where[start - 1 + j] for j in scored.tolist()]
        target = torch.tensor(np.asarray(base[start:])[scored], dtype=torch.long, device=backend.device)
        base_lp[scored], ent = _scored_logprobs(backend, logits, rows, target, score_temperature, return_entropy)
        if base_ent is not None:
            base_ent[scored] = ent
    cut_logits = logits[[where[c - 1] for c in cuts]].float() if cuts else None  # [n_cuts, V]
    return cache, base_lp, base_ent, cut_logits


def _forward_base(backend, ids_L: list[int], keep_rows: list[int]):
    """One batch-1 forward over `ids_L` with a KV cache; returns (cache, logits [len(keep_rows), V]) of the rows
    `keep_rows` only. Raises NotImplementedError for a sliding-window cache (a prefix of it is not a prefix cache)."""
    ids = torch.tensor([ids_L], dtype=torch.long, device=backend.device)
    out = backend._forward(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(len(ids_L), device=backend.device).unsqueeze(0),
        use_cache=True,
        logits_to_keep=torch.tensor(keep_rows, dtype=torch.long, device=backend.device),
    )
    cache = out.past_key_values
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("branch: sliding-window caches cannot be shared by prefixes")
    return cache, out.logits[0]


def _scored_logprobs(backend, logits: torch.Tensor, rows: list[int], target: torch.Tensor, temperature: float,
                     return_entropy: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Log-probs of `target` (int64 [K]) under the `logits` rows `rows` (K of them) at `temperature`, and with
    `return_entropy` the entropies, in chunks of `backend._ENTROPY_ROWS` rows (one [chunk, V] block at a time)."""
    K = len(rows)
    lo = rows[0]
    # Consecutive rows (no score_mask, or one without holes) are read as slices: views, no copy of [K, V] logits.
    idx = None if rows[-1] - lo == K - 1 else torch.tensor(rows, dtype=torch.long, device=backend.device)

    def pick(a: int, b: int) -> torch.Tensor:
        return logits[lo + a : lo + b] if idx is None else logits[idx[a:b]]

    lp = token_logprobs(pick(0, K), target, temperature).cpu().numpy()
    if not return_entropy:
        return lp, None
    step = backend._ENTROPY_ROWS
    ent = np.concatenate([entropy_from_logits(pick(a, min(a + step, K)), temperature).clamp(min=0.0).cpu().numpy()
                          for a in range(0, K, step)])
    return lp, ent


def generate_at_cuts(backend, cache, cuts: list[int], cut_logits: torch.Tensor, max_new_tokens: int,
                     temperature: float, top_p: float, seed: int | None) -> list:
    """One sampled response (a `Generation`) per cut, in the caller's order; None for a cut where
    ``cut + max_new_tokens`` does not fit the model. The cuts that fit are sampled in batches of at most
    `backend.branch_batch_tokens` positions, all drawing from one generator seeded with `seed`."""
    generations: list = [None] * len(cuts)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=backend.device)
        gen.manual_seed(int(seed))
    rows = [i for i, c in enumerate(cuts) if backend.fits(c, max_new_tokens)]  # caller's order
    for chunk in _branch_chunks(backend, rows, [cuts[i] + max_new_tokens for i in rows]):
        for i, g in zip(chunk, _generate_batch(backend, cache, chunk, cuts, cut_logits, max_new_tokens,
                                               temperature, top_p, gen)):
            generations[i] = g
    return generations


def _generate_batch(backend, cache, rows: list[int], cuts: list[int], cut_logits: torch.Tensor, max_new_tokens: int,
                    temperature: float, top_p: float, gen: torch.Generator | None) -> list:
    """Sample one response after ``base[:cuts[i]]`` for each cut index i in `rows`, as one batch.

    Row r attends to cache positions < its cut (a mask with a hole up to
    the longest cut) and its own new ids at positions cut, cut+1, ...;
    the first id comes from `cut_logits` (the base forward). Mirrors
    `generate`: both run `_decode`.
    """
    B = len(rows)
    c_t = torch.tensor([cuts[i] for i in rows], dtype=torch.long, device=backend.device)
    cmax = int(c_t.max())
    past = _prefix_cache(backend, cache, cmax, B)
    mask = (torch.arange(cmax, device=backend.device).unsqueeze(0) < c_t.unsqueeze(1)).long()
    pos = c_t.view(B, 1)
    stops = torch.tensor(backend.stop_token_ids, dtype=torch.long)
    return backend._decode(past, cut_logits[rows], mask, pos, max_new_tokens, temperature, top_p, gen, stops,
                           labels=list(rows), what="cuts")


def force_continuations(backend, cache, cuts: list[int], cut_logits: torch.Tensor | None,
                        conts: list[list[list[int]]], temperature: float) -> list[list[np.ndarray]]:
    """Per cut, per continuation: float32 log-probs of its ids after ``base[:cut]`` at `temperature`.

    One id needs only the cut's logits from the base forward; longer ones are
    teacher-forced in batches (longest cut first: similar prefixes share one)
    of at most `backend.branch_batch_tokens` cached positions."""
    cont_lps: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.float32) for _ in cs] for cs in conts]
    multi = []
    for i, cs in enumerate(conts):
        for j, cont in enumerate(cs):
            if len(cont) == 1:
                cont_lps[i][j] = token_logprobs(
                    cut_logits[i], torch.tensor(cont[0], device=backend.device), temperature
                ).reshape(1).cpu().numpy().astype(np.float32)
            elif len(cont) > 1:
                multi.append((i, j))
    multi.sort(key=lambda ij: -cuts[ij[0]])  # similar prefixes share a batch
    for chunk in _branch_chunks(backend, multi, [cuts[i] + len(conts[i][j]) - 1 for i, j in multi]):
        for (i, j), lp in zip(chunk, _force_batch(backend, cache, chunk, cuts, cut_logits, conts, temperature)):
            cont_lps[i][j] = lp
    return cont_lps


def _force_batch(backend, cache, chunk: list[tuple[int, int]], cuts: list[int], cut_logits: torch.Tensor,
                 conts: list[list[list[int]]], temperature: float) -> list[np.ndarray]:
    """The log-probs of continuations ``conts[i][j]`` (length >= 2) for each (i, j) in `chunk`, in one forward.

    Each row feeds all its ids but the last after its cut; its first id's log-prob comes from `cut_logits`."""
    dev = backend.device
    B = len(chunk)
    c_t = torch.tensor([cuts[i] for i, _ in chunk], dtype=torch.long, device=dev)
    lens = [len(conts[i][j]) for i, j in chunk]
    cmax, nmax = int(c_t.max()), max(lens) - 1
    step = torch.full((B, nmax), backend.pad_token_id, dtype=torch.long, device=dev)
    for r, (i, j) in enumerate(chunk):
        step[r, : lens[r] - 1] = torch.tensor(conts[i][j][:-1], dtype=torch.long)
    # Row r sees cache positions < its cut plus its own new ids (right
    # padding after them is causal-after, so harmless and discarded).
    hole = (torch.arange(cmax, device=dev).unsqueeze(0) < c_t.unsqueeze(1)).long()
    mask = torch.cat([hole, torch.ones((B, nmax), dtype=torch.long, device=dev)], dim=1)
    pos = c_t.unsqueeze(1) + torch.arange(nmax, device=dev).unsqueeze(0)
    step_logits = backend._forward(
        input_ids=step,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=_prefix_cache(backend, cache, cmax, B),
        use_cache=True,
    ).logits  # [B, nmax, V]
    out = []
    for r, (i, j) in enumerate(chunk):
        lg = torch.cat([cut_logits[i : i + 1], step_logits[r, : lens[r] - 1].float()], dim=0)
        target = torch.tensor(conts[i][j], dtype=torch.long, device=dev)
        out.append(np.ascontiguousarray(token_logprobs(lg, target, temperature).cpu().numpy(), dtype=np.float32))
    return out


def _branch_chunks(backend, items: list, costs: list[int]) -> list[list]:
    """Split `items` (in order) into batches of at most `branch_batch_tokens` rows * max cost (>= 1 row)."""
    chunks: list[list] = []
    cur: list = []
    worst = 0
    for item, cost in zip(items, costs):
        if cur and (len(cur) + 1) * max(worst, cost) > backend.branch_batch_tokens:
            chunks.append(cur)
            cur, worst = [], 0
        cur.append(item)
        worst = max(worst, cost)
    if cur:
        chunks.append(cur)
    return chunks


def _prefix_cache(backend, cache, length: int, batch: int):
    """A new DynamicCache holding positions [0, length) of the 1-row `cache`, repeated `batch` times.

    The source is never modified (forwards append to the copy).
    """
    from transformers import DynamicCache

    data = [
        (
            layer.keys[:, :, :length].expand(batch, -1, -1, -1),
            layer.values[:, :, :length].expand(batch, -1, -1, -1),
        )
        for layer in cache.layers
    ]
    return DynamicCache(data, config=backend.model.config)
