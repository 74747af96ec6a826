"""Developer tools of jax_latent_ep (not shipped in the wheel): the kernel harness, the protocol model checker and
`sass_loop` (a kernel loop's SASS instructions by opcode)."""
