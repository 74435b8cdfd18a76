"""``from schnet_ipu.calculator import SchNetCalculator``, as users' scripts write it: the
calculator itself is :mod:`schnet_ipu.inference.calculator`."""

from schnet_ipu.inference.calculator import SchNetCalculator

__all__ = ["SchNetCalculator"]
