"""The error types a user can cause (bad files, bad settings, a run that cannot continue), reported without a
traceback."""
from qerl.checkpoint import CheckpointError
from qerl.outputs import OutputInUse, OutputNotWritable
from qerl.data.tasks import DataError
from qerl.models.arch import UnsupportedArchitectureError
from qerl.quant.format import CheckpointFormatError
from qerl.quant.nvfp4 import NVFP4Error


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss / reward, out of GPU memory); the last checkpoint is intact."""


class TrainingInterrupted(TrainingError):
    """Ctrl-C / SIGINT stopped a run; the message says at which step and which checkpoint is intact."""


USER_ERRORS = (TrainingError, OutputInUse, OutputNotWritable, CheckpointError, DataError, CheckpointFormatError, NVFP4Error, UnsupportedArchitectureError,
               FileNotFoundError, ValueError)
