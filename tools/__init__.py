"""Developer tools of jax_latent_ep (not shipped in the wheel): the kernel harness and the protocol model checker."""
