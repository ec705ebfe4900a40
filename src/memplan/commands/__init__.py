"""Command modules of the ``memplan`` CLI beyond ``estimate``/``models``/``gpus``.

Each module registers its command(s) on :data:`memplan.cli.app` when imported and is listed in
:data:`memplan.cli.COMMAND_MODULES`. Modules import torch, numpy or matplotlib only inside the
command functions, so ``memplan estimate`` keeps its fast start.
"""
