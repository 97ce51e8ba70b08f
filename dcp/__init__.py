"""dcp: dynamic context parallelism for long-context training."""
from dcp.errors import *  # noqa: F401,F403
