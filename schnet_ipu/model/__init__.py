"""SchNet for packed fixed-shape batches, its loss, and the ops it is built from."""

from schnet_ipu.model.schnet import SchNet, masked_mse

__all__ = ["SchNet", "masked_mse"]
