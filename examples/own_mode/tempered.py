"""A correction mode of your own: the decoupled weight tempered by a power β < 1.

    w = (π_prox / π_behav)^β,   log w = β · (log π_prox − log π_behav)

β = 1 is decoupled PPO, β = 0 is no weight at all. A power below 1 shrinks every log ratio
towards 0: lower variance than decoupled's weight, some bias (the same trade as segment-wise,
made by a different route). Train with it, inspect it, compare it:

    sdp train +preset=decoupled loss.mode=examples/own_mode/tempered.py:tempered_decoupled
    sdp inspect-weights runs/<run>/batches --mode examples/own_mode/tempered.py:tempered_decoupled

The function receives the log-probs of the sampled tokens, [sequences, tokens]: π_behav
(``old``), π_prox (``proximal``) and π_prox_t (``proximal_t``, None unless declared in
``needs``), and the bool ``mask`` of valid tokens (padding may hold anything). It returns the
log of the weight, detached, with the same shape. ``anchor`` is the policy the PPO ratio is
taken against: "proximal" (π_prox, as decoupled and segment_wise) or "behav" (π_behav, bypass).
See docs/design.md "Adding a mode".
"""

from sdp_cli.modes import mode

#: the tempering power β
BETA = 0.5


@mode(needs=("proximal_logprobs",), anchor="proximal")
def tempered_decoupled(old, proximal, proximal_t, mask):
    return BETA * (proximal - old)
