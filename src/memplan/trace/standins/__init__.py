"""Library stand-ins: bitsandbytes quantized layers and optimizers, fused losses, activation offloading, optimizer in backward."""
