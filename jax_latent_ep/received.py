"""Result types shared by every backend."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Received(NamedTuple):
    """One rank's receive rows after `dispatch`, source-major: row `s * S + t` is token `t` of source rank `s`.

    Attributes:
      x: float8_e4m3fn `[N*S, L]`, the MXFP8 elements of each received token (unspecified in empty rows).
      sf: uint8 `[N*S, L // 32]`, their E8M0 block scales (unspecified in empty rows).
      ids: int32 `[N*S, K]`, all `K` global expert ids of the token; in empty rows `((d + 1) % N) * (E // N)`
        on rank `d` (an expert that is not local when `N > 1`).
      weights: float32 `[N*S, K]`, the token's routing weights; 0 in empty rows.
      src: int32 `[N*S]`, `(source_rank << 16) | token`, or -1 in empty rows.
    """

    x: jax.Array
    sf: jax.Array
    ids: jax.Array
    weights: jax.Array
    src: jax.Array
