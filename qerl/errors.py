"""The error types a user can cause (bad files, bad settings), reported without a traceback."""
from qerl.checkpoint import CheckpointError
from qerl.data.tasks import DataError
from qerl.models.arch import UnsupportedArchitectureError
from qerl.quant.format import CheckpointFormatError
from qerl.quant.nvfp4 import NVFP4Error

USER_ERRORS = (CheckpointError, DataError, CheckpointFormatError, NVFP4Error, UnsupportedArchitectureError,
               FileNotFoundError, ValueError)
