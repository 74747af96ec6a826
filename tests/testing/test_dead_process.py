"""A dead process ends its job, bounded and named (`runtime.liveness`, set up by the launcher), two CPU processes
over gloo: the cases and checks of `jax_latent_ep.testing.dead_process` (the liveness bound 10 s here; 60 s by
default). The measured time from the death to the survivor's end is printed."""

import pytest

from jax_latent_ep.testing.dead_process import CASES, check_dead_process


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", CASES)
def test_dead_process_ends_the_job(when):
    check_dead_process(when)
