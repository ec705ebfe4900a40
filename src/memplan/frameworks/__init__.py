"""Framework readers: Megatron-LM, torchtitan, DeepSpeed and Hugging Face launch files and configs → a
``ModelSpec`` and a ``Job``. The framework profiles themselves are :mod:`memplan.profiles`."""
