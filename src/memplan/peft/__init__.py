"""Fine-tuning against a model: which parameters train, which are frozen, which adapters exist
(:mod:`memplan.peft.params`), and the checks of the fine-tuning flags against the model
(:mod:`memplan.peft.checks`). Above :mod:`memplan.job` (it reads ``FineTuning``) and :mod:`memplan.model`."""
