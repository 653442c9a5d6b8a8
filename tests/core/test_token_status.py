"""token_status: the segment-wise invariant's one rule (docs/design.md §2), on ints and tensors."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.core.token_status import (
    FILL,
    INVALID,
    OK,
    UNCORRECTABLE,
    covered_tokens,
    lacks_next_version,
    token_status,
)


def test_every_case_at_trainer_version_4_by_hand():
    # (v, π_prox_t version) → status at c = 4, from the module's table:
    cases = {
        (2, 3): OK,  # v ≤ c − 2 with π_{v+1}
        (2, 2): UNCORRECTABLE,  # v ≤ c − 2 still at π_v: weights 3 are gone
        (2, 4): UNCORRECTABLE,  # scored by the wrong version
        (3, 4): OK,  # v = c − 1 scored by the loaded weights c
        (3, 3): FILL,  # v = c − 1 not scored yet: weights 4 still loaded
        (3, 2): UNCORRECTABLE,
        (4, 4): OK,  # current version: π_prox_t = π_behav
        (4, 3): INVALID,
        (5, 5): INVALID,  # newer than the trainer
    }
    for (v, pv), expected in cases.items():
        assert token_status(v, pv, 4) == expected, (v, pv)
    v = torch.tensor([[v for v, _ in cases]])
    pv = torch.tensor([[pv for _, pv in cases]])
    assert token_status(v, pv, 4).tolist() == [list(cases.values())]
    assert token_status(v, pv, 4).dtype == torch.int64  # an integer tensor, whatever the rule's arithmetic
    assert type(token_status(3, 3, 4)) is int
    mask = torch.tensor([[True] * 8 + [False]])
    assert token_status(v, pv, 4, mask).tolist() == [[*list(cases.values())[:8], OK]]
    assert lacks_next_version(token_status(v, pv, 4)).tolist() == [[s in (FILL, UNCORRECTABLE) for s in cases.values()]]


def test_only_a_weight_that_reads_prox_t_leaves_out_the_tokens_without_the_next_version():
    # at c = 4: OK, FILL, UNCORRECTABLE, OK (padding); decoupled and bypass cover every valid token
    status = torch.tensor([[OK, FILL, UNCORRECTABLE, OK]])
    valid = torch.tensor([[True, True, True, False]])
    assert covered_tokens(valid, status, reads_proximal_t=True).tolist() == [[True, False, False, False]]
    assert covered_tokens(valid, status, reads_proximal_t=False).tolist() == valid.tolist()
    assert covered_tokens(valid, None, reads_proximal_t=True) is valid  # π_prox_t not tracked


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 9)), min_size=1, max_size=30), st.integers(0, 8))
def test_tensor_and_int_forms_agree_and_match_the_stale_token_rule(tokens, c):
    v = torch.tensor([t[0] for t in tokens])
    pv = torch.tensor([t[1] for t in tokens])
    status = token_status(v, pv, c)
    assert status.tolist() == [token_status(a, b, c) for a, b in tokens]
    # a stale token lacks π_{v+1} exactly when its π_prox_t is not from version v + 1
    assert lacks_next_version(status).tolist() == [a < c and b != a + 1 for a, b in tokens]
    # a per-row trainer version (inspect-weights stacks batches of several versions) gives the same
    assert token_status(v, pv, torch.full_like(v, c)).tolist() == status.tolist()
