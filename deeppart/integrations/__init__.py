"""DeepPart inside the training frameworks: every data-parallel rank writes
its planned part of each checkpoint, where the framework would have rank 0
write all of it.

- :mod:`deeppart.integrations.lightning`: a PyTorch Lightning DDP strategy
  and ``CheckpointIO`` plugin;
- :mod:`deeppart.integrations.transformers`: a ``transformers.Trainer``
  subclass;
- :mod:`deeppart.integrations.accelerate`: ``save_state`` / ``load_state``
  for an ``accelerate.Accelerator``.

Each module imports its framework, so import only the one you use; plain
``import deeppart`` needs none of them.
"""
