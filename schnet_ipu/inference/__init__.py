"""The inference wing: a model file -> energies, forces and stress of new structures.

model_file rebuilds a trained model from a checkpoint alone; portable is that model on one
structure in TorchScript-able ops; predictor evaluates structures (one model or an ensemble)
through the force paths of :mod:`~schnet_ipu.inference.force_paths`; export writes the
TorchScript file; calculator (ASE) and lammps serve MD engines. Inference never imports the
feed or training.
"""
