"""JAX-free harness of the EP kernels on `cuda.bindings.driver`: loads the AOT cubins (manifest), allocates and
arms one symmetric buffer per rank, runs N ranks concurrently and checks every layer against numpy.

Modes (`python -m tools.kernel_harness --help`):
  virtual   N ranks on ONE GPU: all buffers on one device, one stream per rank.
  devices   N ranks on N GPUs of one process (peer access), one stream per GPU.
  latency   kernel-only time of one dispatch + combine per layer at T in {1, 5, 32, 128}, N = 2 on 2 GPUs:
            CUDA graphs of `--graph-layers` layers per GPU (programmatic stream serialization), CUDA events
            around each replay, median over the replays of (elapsed / layers). `--latency-virtual`: the ranks on
            one GPU, one stream each (a one-GPU view of the ranks' interplay, without NVLink).
  timeout   N = 2, rank 1 stops (`--timeout-case`): before its dispatch (rank 0's dispatch must trap), or after
            its dispatch (rank 0's combine must trap); the trap fills the host status record {code, rank, peer,
            layer} (run last: the trap kills the context).
  sequence  N = 2 virtual ranks, rank 1's buffer in mapped host memory; rank 0 repeats a dispatch / combine out
            of sequence (`--sequence-case`): it must trap with its error record and leave rank 1's buffer
            unchanged, byte for byte (run last: the trap kills the context).
  stress    `--layers` (e.g. 100000) consecutive layers, one rank per GPU (`--stress-virtual`: on one GPU): input
            sets uploaded once, random sets / T / apply_norm per layer and rank, one rank held back by a host
            busy-wait in half the layers, batches of `--stress-batch` layers launched back to back into their
            own output slots, then one sync and a vectorized check of the batch (same rules as below).

Each checked layer uses fresh random BF16 tokens, fresh routing and a random T <= max_tokens per rank; the
expert stage runs on the host (numpy) from the received rows; receive rows (x, sf of valid rows; ids,
weights, src of all rows) and the routed latent must be bit-exact, the normed output within 1 BF16 ulp.

Modules: `runtime` (driver, kernels from the manifest, arrays, `Rank`, `System`), `inputs` (random tokens and
routings), `expected` (expected outputs from `jax_latent_ep.testing.model`, and the comparisons), `modes.*`
(one per mode), `cli` (the command line). The kernel parameters and error codes are `jax_latent_ep.kernels.abi`'s.
"""

from tools.kernel_harness.cli import MODES, main
from tools.kernel_harness.expected import (
    BF16,
    E4M3,
    Rows,
    bf16_bits,
    expected_receive,
    expected_result,
    host_expert,
    mxfp8_bytes,
    receive_mismatches,
    result_mismatches,
    ulp_distance_bf16,
)
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.modes.latency import TRACE_STAMPS, latency, trace_report
from tools.kernel_harness.modes.layers import run_layers
from tools.kernel_harness.modes.sequence import sequence_test
from tools.kernel_harness.modes.stress import (
    STRESS_MAX_COMBOS,
    Schedule,
    StressBuffers,
    StressPool,
    make_pool_routing,
    stress,
    stress_schedule,
)
from tools.kernel_harness.modes.timeout import timeout_test
from tools.kernel_harness.runtime import (
    COMBINE_PARAMS,
    DEFAULT_ARTIFACTS,
    DISPATCH_PARAMS,
    SHAPES,
    DeviceArray,
    DeviceView,
    HostMappedArray,
    HostMappedView,
    Kernel,
    Manifest,
    Rank,
    SpinKernel,
    System,
    buffer_params,
    check,
    device_name,
    host_status,
    launch_grid,
)

__all__ = [
    "BF16",
    "COMBINE_PARAMS",
    "DEFAULT_ARTIFACTS",
    "DISPATCH_PARAMS",
    "DeviceArray",
    "DeviceView",
    "E4M3",
    "HostMappedArray",
    "HostMappedView",
    "Kernel",
    "MODES",
    "Manifest",
    "Rank",
    "Rows",
    "SHAPES",
    "STRESS_MAX_COMBOS",
    "Schedule",
    "SpinKernel",
    "StressBuffers",
    "StressPool",
    "System",
    "TRACE_STAMPS",
    "bf16_bits",
    "buffer_params",
    "check",
    "device_name",
    "expected_receive",
    "expected_result",
    "host_expert",
    "host_status",
    "latency",
    "launch_grid",
    "main",
    "make_pool_routing",
    "make_routing",
    "make_tokens",
    "mxfp8_bytes",
    "receive_mismatches",
    "result_mismatches",
    "run_layers",
    "sequence_test",
    "stress",
    "stress_schedule",
    "timeout_test",
    "trace_report",
    "ulp_distance_bf16",
]
