"""What frameworks run: torchtitan's own code, DeepSpeed's checkpointing, Megatron's and torchtitan's activation policies, attention and MoE as the frameworks execute them."""
