"""One module per harness mode (`layers`: virtual and devices; `latency`, `timeout`, `sequence`, `stress`)."""
