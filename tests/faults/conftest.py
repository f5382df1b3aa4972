"""The fault tests run the same real sidecars and ranks as the data-path tests, through the same fixtures."""

from data_path.conftest import short_tmp, start_rank, start_sidecar, storage

__all__ = ["short_tmp", "start_rank", "start_sidecar", "storage"]
