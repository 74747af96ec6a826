"""A model checker of the v3 dispatch / combine protocol (LL words with layer epochs); pure Python, no JAX.

`model` holds the state machine (`Config`, whose defaults are the shipped kernels' protocol, `SHIPPED`; the
violation kinds; `Model`), `explore` the searches over it (`explore`, `random_runs`). docs/protocol.md has the
protocol, the safety argument and what the checker found.

    python -c "from tools import protocol_checker as p; print(p.explore(p.Config(ranks=3, tokens=2, dispatch_grid=2)))"
"""

from tools.protocol_checker.explore import explore, random_runs
from tools.protocol_checker.model import (
    BAD_FINAL_STATE,
    DEADLOCK,
    ERROR_COMBINE_TIMEOUT,
    ERROR_COMBINE_WITHOUT_DISPATCH,
    ERROR_DISPATCH_TIMEOUT,
    ERROR_DISPATCH_TWICE,
    GUARD_LEAK,
    GUARD_MISSED,
    GUARDS,
    KINDS,
    OVERWRITE_UNREAD,
    READY_LINES,
    SHIPPED,
    SPURIOUS_GUARD,
    STALE_READ,
    TORN_READ,
    WRONG_LAYER_READ,
    Config,
    Model,
    Result,
    Violation,
    default_route,
    random_route,
    sequence,
)

__all__ = [
    "BAD_FINAL_STATE",
    "DEADLOCK",
    "ERROR_COMBINE_TIMEOUT",
    "ERROR_COMBINE_WITHOUT_DISPATCH",
    "ERROR_DISPATCH_TIMEOUT",
    "ERROR_DISPATCH_TWICE",
    "GUARDS",
    "GUARD_LEAK",
    "GUARD_MISSED",
    "KINDS",
    "OVERWRITE_UNREAD",
    "READY_LINES",
    "SHIPPED",
    "SPURIOUS_GUARD",
    "STALE_READ",
    "TORN_READ",
    "WRONG_LAYER_READ",
    "Config",
    "Model",
    "Result",
    "Violation",
    "default_route",
    "explore",
    "random_route",
    "random_runs",
    "sequence",
]
