"""How a seeded request's draws follow from its seed, torch-free, for the two places that must
agree on it: the engine's sampler (``ops/gumbel.row_keys``) and the gateway, which resumes a
request on another worker with the tokens so far in its prompt.

Token *k* of a request with seed *s* draws its noise from the key of ``s + k·GOLDEN`` (mod 2⁶⁴,
splitmix64's sequence). A resumed request counts its tokens from 0 again, so it is given the
seed that lands on the same keys:

    uninterrupted:  s + 0·G   s + 1·G  …  s + d·G   s + (d+1)·G  …
    resumed at d:                         s'+ 0·G   s'+ 1·G      …   with s' = s + d·G
"""

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2⁶⁴ / φ, odd
_MOD = 1 << 64


def continued_seed(seed: int, done: int) -> int:
    """The seed under which a request that already sampled ``done`` tokens, started again with
    them in its prompt, draws what it would have drawn next. A signed 64-bit value, as the
    API's ``seed`` (−2⁶³ … 2⁶³ − 1)."""
    z = (seed + done * GOLDEN) % _MOD
    return z - _MOD if z >= _MOD >> 1 else z
