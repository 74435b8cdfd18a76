"""SchNet for packed fixed-shape batches and the ops it is built from."""

from schnet_ipu.model.schnet import SchNet

__all__ = ["SchNet"]
