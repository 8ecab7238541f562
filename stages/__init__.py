"""The ML of the pipeline (no Prefect imports). Importing the package applies the process-wide
allocator defaults (`stages.process`) before torch allocates anything."""

from stages.process import apply_defaults

apply_defaults()
