"""The training wing: a config -> a trained run folder.

setup (model, optimiser, schedule, task and backend from a config) and data (store, split,
packing plans, loaders) prepare a run; loop trains it, with budget, guard, state and lock;
log and records write the run folder; evaluation scores a split during training, and
finished_runs scores or predicts a run's split afterwards (``train.py evaluate``, ``predict
--run``).
"""
