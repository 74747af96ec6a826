"""An example built on the library: a latent MoE decode model (`moe`) and the demo that runs it (`demo`)."""
