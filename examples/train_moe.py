"""Train a small Mixture-of-Experts byte-level language model with expert parallelism, on CPU (gloo).

The text is the Python standard library's own source (the `*.py` files next to `os.py`, in sorted order), read
as bytes: vocabulary 256, no tokenizer, no download. The model is a tiny decoder: byte embedding + learned
positions, `--layers` blocks of (causal self-attention, MoE), a final norm and a byte head. Each MoE layer has 8
experts (2-layer GELU MLPs, fp32) and a top-2 softmax router; the experts are sharded over the ranks (8 / ranks
per rank) and tokens travel with `epcomm.TokenDispatcher` in the expand layout. Router weights are applied to
the expert outputs before the (unweighted) combine, so they get gradients through dispatch's backward.

Parallelism: the global batch (`--batch` sequences) is cut into 2 equal data shards, one per rank with
`--ranks 2`, both on the one rank with `--ranks 1`. Everything except the experts is data parallel: the dense
layers run on each shard separately and their gradients are summed over the ranks; each MoE layer dispatches the
tokens of all the rank's shards at once, and the expert gradients (which arrive from every rank through
combine's backward) stay on the expert's rank. Each rank's objective is its share of the global mean loss (its
loss sum / the global token count), so the summed gradients are those of the global mean. The model is
initialised from `--seed` as a whole and then sharded. A `--ranks 2` run therefore does the same arithmetic as
a `--ranks 1` run on the same global batches: epcomm's combine sums in a fixed order, every expert sees its
rows in the same order, and two-term sums do not depend on their order, so the per-step losses agree (bitwise
on one machine; the contract tested is 1e-5 relative).

    python examples/train_moe.py                      # 2 ranks, default sizes (about a minute on 2 cores)
    python examples/train_moe.py --ranks 1 --out-losses ep1.txt
    python examples/train_moe.py --ranks 2 --out-losses ep2.txt   # same losses, per step

Shape legend (docs/shapes.md): B sequences on this rank, Q sequence length, D model width, T = B * Q tokens,
S expanded rows received by this rank, F expert hidden width, E experts, L local experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import epcomm
from epcomm.routing import softmax_topk

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
    """Run settings (the command-line flags of the same names)."""

    steps: int = 250
    batch: int = 32  # global batch in sequences, split evenly over the ranks
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 2
    num_experts: int = 8
    topk: int = 2
    ffn: int = 128
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 4 << 20  # use the first 4 MiB of the concatenated sources
    shards: int = 2  # the global batch is split into this many data shards, spread over the ranks
    log_every: int = 1


# ------------------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------------------
def load_corpus(max_bytes: int) -> torch.Tensor:
    """[N] int64 -- the bytes of the standard library's `*.py` files, concatenated in sorted file order."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def global_batch(corpus: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> tuple:
    """(inputs [batch, seq], targets [batch, seq]) int64 -- random windows, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=g)
    windows = corpus[starts[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]


# ------------------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------------------
class MoE(nn.Module):
    """Top-k softmax router + `num_experts` GELU MLPs sharded over the EP group; tokens move with epcomm."""

    def __init__(self, cfg: Config, dispatcher: epcomm.TokenDispatcher, rank: int):
        super().__init__()
        self.dispatcher, self.topk = dispatcher, cfg.topk
        num_local = dispatcher.num_local_experts
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        # Draw every expert (the same RNG stream for any number of ranks), then keep this rank's shard.
        w1_EDF = torch.randn(cfg.num_experts, cfg.dim, cfg.ffn) / math.sqrt(cfg.dim)
        w2_EFD = torch.randn(cfg.num_experts, cfg.ffn, cfg.dim) / math.sqrt(cfg.ffn)
        mine = slice(rank * num_local, (rank + 1) * num_local)
        self.w1_LDF = nn.Parameter(w1_EDF[mine].clone())
        self.w2_LFD = nn.Parameter(w2_EFD[mine].clone())

    def forward(self, xs: list) -> list:
        """xs: this rank's data shards, each [T_i, D] fp32 -> the MoE output of each, same shapes."""
        routes = [softmax_topk(self.router(x_TD), self.topk) for x_TD in xs]
        topk_idx = torch.cat([idx for idx, _ in routes])
        topk_weights = torch.cat([w for _, w in routes])
        recv_x_SD, recv_w_S, handle = self.dispatcher.dispatch(torch.cat(xs), topk_idx, topk_weights)
        outs, start = [], 0
        for e, n in enumerate(handle.num_recv_tokens_per_expert_list):  # rows grouped by local expert
            h = recv_x_SD[start:start + n]
            outs.append(F.gelu(h @ self.w1_LDF[e]) @ self.w2_LFD[e])
            start += n
        expert_out_SD = torch.cat(outs) * recv_w_S[:, None]  # router weights applied before the combine
        y_TD = self.dispatcher.combine(expert_out_SD, handle)
        return list(y_TD.split([x.shape[0] for x in xs]))


class Block(nn.Module):
    def __init__(self, cfg: Config, dispatcher: epcomm.TokenDispatcher, rank: int):
        super().__init__()
        self.heads = cfg.heads
        self.norm_attn, self.norm_moe = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.moe = MoE(cfg, dispatcher, rank)

    def attention(self, x_BQD: torch.Tensor) -> torch.Tensor:
        b, q, d = x_BQD.shape
        qkv = self.qkv(self.norm_attn(x_BQD)).view(b, q, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(attn.transpose(1, 2).reshape(b, q, d))

    def forward(self, xs: list) -> list:
        xs = [x_BQD + self.attention(x_BQD) for x_BQD in xs]
        ys = self.moe([self.norm_moe(x_BQD).flatten(0, 1) for x_BQD in xs])  # one dispatch for all shards
        return [x_BQD + y.view_as(x_BQD) for x_BQD, y in zip(xs, ys)]


class MoELM(nn.Module):
    def __init__(self, cfg: Config, dispatcher: epcomm.TokenDispatcher, rank: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, dispatcher, rank) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB)

    def forward(self, shards: list) -> list:
        """shards: this rank's data shards, each [B_i, Q] int64 bytes -> logits of each, [B_i, Q, 256] fp32.

        Dense layers run on each shard separately (so their arithmetic does not depend on how many shards a
        rank holds); each MoE layer dispatches the tokens of all the rank's shards at once.
        """
        xs = [self.embed(tokens_BQ) + self.pos[: tokens_BQ.shape[1]] for tokens_BQ in shards]
        for block in self.blocks:
            xs = block(xs)
        return [self.head(self.norm(x_BQD)) for x_BQD in xs]

    def expert_parameters(self) -> list:
        return [p for name, p in self.named_parameters() if name.endswith(("w1_LDF", "w2_LFD"))]


# ------------------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------------------
def train(rank: int, world_size: int, cfg: Config, log: bool = True) -> list:
    """Train on an initialised default process group (collective); returns the global mean loss per step.

    Args:
        rank, world_size: this process's rank and the group size (a divisor of `cfg.shards` and
            `cfg.num_experts`).
        cfg: the run settings.
        log: print the loss every `cfg.log_every` steps (rank 0).

    Raises:
        ValueError: `world_size` does not divide `cfg.shards` or `cfg.num_experts`, or `cfg.shards` does not
            divide `cfg.batch`.
    """
    if cfg.shards % world_size or cfg.batch % cfg.shards or cfg.num_experts % world_size:
        raise ValueError(f"the number of ranks ({world_size}) must divide shards ({cfg.shards}) and num_experts "
                         f"({cfg.num_experts}), and shards must divide --batch ({cfg.batch})")
    corpus = load_corpus(cfg.corpus_bytes)
    shards_per_rank, shard_batch = cfg.shards // world_size, cfg.batch // cfg.shards

    def shard_rows(i: int) -> slice:
        return slice(i * shard_batch, (i + 1) * shard_batch)

    num_tokens = shards_per_rank * shard_batch * cfg.seq
    buffer = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=cfg.dim, num_topk=cfg.topk,
                             dtype=torch.float32)
    with buffer:
        dispatcher = epcomm.TokenDispatcher(buffer, cfg.num_experts, do_expand=True)
        torch.manual_seed(cfg.seed)  # the whole model, identically on every rank; experts are then sharded
        model = MoELM(cfg, dispatcher, rank)
        expert_ids = {id(p) for p in model.expert_parameters()}
        shared = [p for p in model.parameters() if id(p) not in expert_ids]
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        losses, start = [], time.perf_counter()
        for step in range(cfg.steps):
            inputs, targets = global_batch(corpus, step, cfg.batch, cfg.seq, cfg.seed)
            mine = range(rank * shards_per_rank, (rank + 1) * shards_per_rank)
            logits = model([inputs[shard_rows(i)] for i in mine])
            loss_sum = sum(F.cross_entropy(lg.flatten(0, 1), targets[shard_rows(i)].flatten(), reduction="sum")
                           for lg, i in zip(logits, mine))
            # This rank's share of the global mean: the ranks' objectives add up to the global mean loss.
            optimizer.zero_grad(set_to_none=True)
            (loss_sum / (cfg.batch * cfg.seq)).backward()  # collective: runs the MoE layers' backward
            _sum_gradients(shared, world_size)  # data parallel; expert gradients are already complete
            optimizer.step()
            total = loss_sum.detach().reshape(1)
            if world_size > 1:
                dist.all_reduce(total)
            losses.append(total.item() / (cfg.batch * cfg.seq))
            if log and rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                print(f"step {step + 1:4d}  loss {losses[-1]:.6f}  ({time.perf_counter() - start:.1f} s)", flush=True)
        if log and rank == 0 and cfg.steps >= 2:
            k = max(1, min(10, cfg.steps // 2))
            print(f"mean loss: first {k} steps {sum(losses[:k]) / k:.4f} -> last {k} steps {sum(losses[-k:]) / k:.4f}",
                  flush=True)
    return losses


def _sum_gradients(params: list, world_size: int) -> None:
    """All-reduce (sum) the gradients of `params` in one flat buffer."""
    if world_size == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _rank_main(rank: int, world_size: int, init_file: str, cfg: Config, out_losses: Optional[str]) -> None:
    torch.set_num_threads(1)  # one core per rank; also keeps the arithmetic the same for any number of ranks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        losses = train(rank, world_size, cfg)
        if rank == 0 and out_losses:
            with open(out_losses, "w") as f:
                f.write("".join(f"{loss!r}\n" for loss in losses))
    finally:
        dist.destroy_process_group()


def parse_args(argv: Optional[list] = None) -> tuple:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--ranks", type=int, default=2, choices=(1, 2), help="gloo ranks (default 2)")
    p.add_argument("--seed", type=int, default=d.seed, help="model and data seed (default 0)")
    p.add_argument("--batch", type=int, default=d.batch, help=f"global batch in sequences (default {d.batch})")
    p.add_argument("--seq", type=int, default=d.seq, help=f"sequence length in bytes (default {d.seq})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"(attention, MoE) blocks (default {d.layers})")
    p.add_argument("--log-every", type=int, default=d.log_every, help="print the loss every N steps (default 1)")
    p.add_argument("--out-losses", default=None, help="write the per-step losses to this file, one per line")
    a = p.parse_args(argv)
    for name in ("steps", "layers", "log_every", "seq"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.batch < 1 or a.batch % a.ranks:
        p.error(f"--batch must be a positive multiple of --ranks {a.ranks} (each rank takes an equal share), "
                f"got {a.batch}")
    cfg = dataclasses.replace(d, steps=a.steps, seed=a.seed, batch=a.batch, seq=a.seq, layers=a.layers,
                              log_every=a.log_every)
    return cfg, a.ranks, a.out_losses


def main(argv: Optional[list] = None) -> None:
    cfg, ranks, out_losses = parse_args(argv)
    print(f"training a {cfg.layers}-layer MoE LM ({cfg.num_experts} experts, top-{cfg.topk}) on {ranks} gloo "
          f"rank(s): global batch {cfg.batch} x {cfg.seq} bytes, {cfg.steps} steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(ranks, os.path.join(tmp, "init"), cfg, out_losses), nprocs=ranks, join=True)


if __name__ == "__main__":
    sys.exit(main())
