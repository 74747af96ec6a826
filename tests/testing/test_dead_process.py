"""A dead process ends its job, bounded and named (`runtime.liveness`), two CPU processes over gloo: the cases and
checks of `jax_latent_ep.testing.dead_process`, launcher-armed (`liveness.initialize`, a 10 s bound) and on the plain
path (plain `jax.distributed.initialize`, the watcher armed by `ExpertParallel` with its defaults: a raise ends the
job within 10 s, a silent death within 60 s). The measured time from the death to the survivor's end is printed."""

import pytest

from jax_latent_ep.testing.dead_process import CASES, check_dead_process


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", CASES)
def test_dead_process_ends_the_job(when):
    check_dead_process(when)


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", CASES)
def test_dead_process_ends_the_plain_job(when):
    """What a user gets without doing anything: `jax.distributed.initialize(...)`, then an `ExpertParallel`."""
    check_dead_process(when, plain=True)
