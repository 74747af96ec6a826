"""A dead process ends its job on the NVLink backend too: the cases and checks of
`jax_latent_ep.testing.dead_process` in two processes that share GPU 0 (one rank each, their symmetric buffers
exchanged by CUDA IPC within the device, their kernels time-sliced), the nvlink kernels' waits bounded by
`timeout_s` = 5 s. Process 0 must end by itself, within the bound, with an error that names process 1: the
watcher's (process 1 raised), the heartbeat's, or a kernel timeout naming rank 1 (SIGKILL: whichever comes first);
launcher-armed and on the plain path (plain `jax.distributed.initialize`, the watcher armed by `ExpertParallel`)."""

import pytest

from jax_latent_ep.testing.dead_process import CASES, check_dead_process

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

#: The shape of the prebuilt GPU test cubins (.kernel_cache): L, E, K.
SHAPE = dict(latent=512, experts=64, topk=4)


@pytest.mark.parametrize("plain", [False, True], ids=["launcher", "plain"])
@pytest.mark.parametrize("when", CASES)
def test_dead_process_ends_the_nvlink_job(when, plain):
    check_dead_process(when, backend="nvlink", shape=SHAPE, gpus=[0], plain=plain)
