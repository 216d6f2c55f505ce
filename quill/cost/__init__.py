"""What a step of inference costs: a roofline model of arithmetic against memory movement.

Torch-free on purpose, so the simulator, the planner and `quill cost` can price millions of
steps, or hardware quill never ran on, without loading a model.
"""

from quill.cost.batch import BatchShape
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel, StepCost

__all__ = ["BatchShape", "CostModel", "HardwareSpec", "ModelSpec", "StepCost"]
