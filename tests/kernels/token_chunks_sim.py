"""The chunked combine's schedule (`pipeline._token_chunks`, kernels/_token_chunks_triton.py) under
TRITON_INTERPRET=1 against a plain Python count: the chunk of a token is the last chunk holding one of its returned
rows, where chunk c of a source's n rows is `moves.chunk_bounds(n, moves.return_weights(C))[c: c + 2]` (the rows
the return push writes in step c); tokens grouped by chunk, ascending. Random sources (empty ones included), chunk
counts, `RETURN_EARLIER` values, item widths (none included), a strided item view, more tokens than one block of
the grouping kernel. Run as a script: `python token_chunks_sim.py CASE`."""

import sys

import torch

from epcomm.moves import chunk_bounds
from epcomm.pipeline import _token_chunks


def check(seed: int, trials: int, most_tokens: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    for trial in range(trials):
        rows_R = torch.randint(0, 9, (draw(1, 5),), generator=gen)
        rows_R[draw(0, rows_R.shape[0])] = 0 if trial % 3 == 0 else rows_R[0]
        num_rows, chunks, earlier = int(rows_R.sum()), draw(1, 6), draw(1, 5)
        weights = (earlier,) * (chunks - 1) + (1,)
        num_tokens, width = draw(0, most_tokens), draw(0, 4)
        wide = torch.randint(-1, max(num_rows, 1), (num_tokens, width + 1), generator=gen)
        if num_rows == 0:
            wide.fill_(-1)
        item = wide[:, :width]  # rows of stride width + 1, as `returned_item_rows` leaves them
        row_chunk = []
        for n in rows_R.tolist():
            bounds = chunk_bounds(n, weights)
            row_chunk += [next(c for c in range(chunks) if bounds[c] <= j < bounds[c + 1]) for j in range(n)]
        want = [max([row_chunk[i] for i in item[t].tolist() if i >= 0], default=0) for t in range(num_tokens)]
        tokens, bounds = _token_chunks(item, rows_R, weights)
        want_tokens = [t for c in range(chunks) for t in range(num_tokens) if want[t] == c]
        want_bounds = [sum(1 for t in range(num_tokens) if want[t] < c) for c in range(chunks + 1)]
        assert tokens.tolist() == want_tokens, (trial, tokens.tolist(), want_tokens)
        assert bounds.tolist() == want_bounds, (trial, bounds.tolist(), want_bounds)


CASES = {"small": (3, 60, 12), "many-tokens": (4, 4, 3000)}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        check(*CASES[name])
        print(name, "ok")
    print("ok")
