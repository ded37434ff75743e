"""StepInput.build's index tensors against per-token values written here: positions, flat cache slots
(block_table[p // bs] * bs + p % bs), for short rows (the Python path) and long ones (the tensor path)."""
import random

import pytest
import torch

from peregrine.decode.batch import LOOP_TOKENS, StepInput

BS = 16


@pytest.mark.parametrize("start,n", [(0, LOOP_TOKENS + 1), (5, 3 * LOOP_TOKENS), (BS - 1, LOOP_TOKENS + 17),
                                     (4 * BS, LOOP_TOKENS + BS), (7, 3), (0, 1)])
def test_positions_and_slots_of_each_row_equal_the_per_token_formula(start, n):
    rnd = random.Random(start * 1000 + n)
    rows = []
    for r in range(2):
        need = (start + n + BS - 1) // BS
        table = rnd.sample(range(1000), need + 3)  # shuffled blocks, longer than the row needs
        toks = [rnd.randrange(50_000) for _ in range(n)]
        rows.append((toks, start, r, table))
    step = StepInput.build(rows, BS, "cpu")
    want_pos = [p for toks, s, _, _ in rows for p in range(s, s + len(toks))]
    want_slot = [t[p // BS] * BS + p % BS for toks, s, _, t in rows for p in range(s, s + len(toks))]
    assert step.positions.tolist() == want_pos
    assert step.slot_mapping.tolist() == want_slot
    assert step.input_ids.tolist() == [x for toks, _, _, _ in rows for x in toks]
