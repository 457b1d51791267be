"""kvstrata.worker: the step thread's model stack. The model runner turns a
frozen SchedulerOutput into a ModelRunnerOutput (``model_runner.py``; a
no-cost ``null_runner.py`` for benchmarks), with its persistent input batch
(``input_batch.py``), the sampler (``sampler.py``) and the model definitions
and checkpoint loading (``model/``)."""
