"""Exploration of a `Config`'s state machine: every reachable state (`explore`) or random schedules
(`random_runs`)."""

from __future__ import annotations

import random
import time
from typing import Callable

from tools.protocol_checker.model import _ERR, Config, Model, Result, Violation


def explore(
    config: Config,
    *,
    stop_at: Callable[[Result], bool] | None = None,
    max_states: int | None = None,
    model_class: type | None = None,
) -> Result:
    """Every reachable state of `config` (depth first, visited set). Stops early when `stop_at(result)` is true
    or after `max_states` states (then `complete` is False). Records the first schedule of each violation.
    `model_class`: a subclass of `Model` to explore instead."""
    model = (model_class or Model)(config)
    result = Result()
    start = time.perf_counter()
    init = model.initial()
    seen = {init}
    path = []  # the steps along the current DFS path
    stack = [(init, None)]

    def schedule(*extra):
        return [model.describe(x) for x in path + list(extra)]

    while stack:
        state, it = stack[-1]
        if it is None:
            steps = model.enabled(state)
            if not steps:
                v = model.terminal_check(state)
                if v is None:
                    w = state[0]
                    errs = [(r, w[r * model.rb + _ERR] >> 8, w[r * model.rb + _ERR] & 0xFF) for r in range(model.n)
                            if w[r * model.rb + _ERR]]
                    if errs:
                        result.errors.update(errs)
                    else:
                        result.finished += 1
                elif v.kind not in result.violations:
                    result.violations[v.kind] = (v.message, schedule())
            it = iter(steps)
            stack[-1] = (state, it)
            if stop_at is not None and result.violations and stop_at(result):
                result.complete = False
                break
        step = next(it, None)
        if step is None:
            stack.pop()
            if path:
                path.pop()
            continue
        child = model._apply(state, step)
        result.transitions += 1
        if isinstance(child, Violation):
            if child.kind not in result.violations:
                result.violations[child.kind] = (child.message, schedule(step))
            continue
        if child in seen:
            continue
        seen.add(child)
        if max_states is not None and len(seen) > max_states:
            result.complete = False
            break
        stack.append((child, None))
        path.append(step)
    result.states = len(seen)
    result.seconds = time.perf_counter() - start
    return result


def random_runs(config: Config, runs: int, seed: int = 0) -> Result:
    """`runs` random schedules of `config` from the initial state to a terminal or violating state (a uniformly
    random enabled step at each state); `states` counts the steps taken in all."""
    model = Model(config)
    rng = random.Random(seed)
    result = Result(complete=False)
    start = time.perf_counter()
    for _ in range(runs):
        state, path = model.initial(), []
        while True:
            steps = model.enabled(state)
            if not steps:
                v = model.terminal_check(state)
                w = state[0]
                errs = [(r, w[r * model.rb + _ERR] >> 8, w[r * model.rb + _ERR] & 0xFF) for r in range(model.n)
                        if w[r * model.rb + _ERR]]
                if v is not None:
                    if v.kind not in result.violations:
                        result.violations[v.kind] = (v.message, [model.describe(x) for x in path])
                elif errs:
                    result.errors.update(errs)
                else:
                    result.finished += 1
                break
            step = steps[rng.randrange(len(steps))]
            child = model._apply(state, step)
            result.transitions += 1
            path.append(step)
            if isinstance(child, Violation):
                if child.kind not in result.violations:
                    result.violations[child.kind] = (child.message, [model.describe(x) for x in path])
                break
            state = child
            result.states += 1
    result.seconds = time.perf_counter() - start
    return result
